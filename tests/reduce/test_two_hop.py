"""The two-hop reduction (two_hop.py) on simulated nodes in one process: every rank of every node
gets the same bits, the average it should, fewer bytes across nodes than the flat reduction, and
error feedback that cancels over steps. mpi_tests/test_two_hop.py runs it over Horovod."""
import re

import numpy as np
import pytest
import torch

from horovod_gift.codec.tensor_codec import Codec
from horovod_gift.reduce.collective import BucketLayout
from horovod_gift.reduce.communicator import LocalGroup
from horovod_gift.reduce.feedback import ErrorFeedback
from horovod_gift.reduce.pipeline import StagePipeline
from horovod_gift.telemetry import Telemetry
from horovod_gift.reduce.topology import Flat, TwoHop, owned_pieces, plan_nodes
from horovod_gift.reduce.two_hop import TwoHopLayout, nan_first_elements

SIZES = (1000, 4096, 77, 3000)      # pieces that straddle node and cross chunk boundaries


def topologies(nodes, node_size):
    """Rank r = node * node_size + local's TwoHop, over LocalGroups as Horovod's sets would be."""
    ranks = nodes * node_size
    world = LocalGroup(ranks).communicators()
    node = [LocalGroup(node_size).communicators() for _ in range(nodes)]
    cross = [LocalGroup(nodes).communicators() for _ in range(node_size)]
    return [TwoHop(world[r], node[r // node_size][r % node_size],
                   cross[r % node_size][r // node_size]) for r in range(ranks)]


def run(reductions):
    """Drive every rank's reduction from one thread, each stage once all ranks have posted it:
    ready() must say when."""
    results = [None] * len(reductions)
    while any(r is None for r in results):
        moved = False
        for k, reduction in enumerate(reductions):
            if results[k] is None and reduction.ready():
                if reduction.stage < reduction.final_stage:
                    reduction.exchange()
                else:
                    results[k] = reduction.finish()
                moved = True
        assert moved, "no rank could move: a stage waits for a collective no rank posted"
    return results


def reduce_once(tops, grads, codec, residuals=None, step=0, average=True):
    reductions = []
    for k, top in enumerate(tops):
        r1, r2 = residuals[k] if residuals else (None, None)
        flats = [g.clone() for g in grads[k]]
        reductions.append(top.reduction("b0", flats, codec, r1, r2, average, step,
                                        [None] * len(flats), 0).start())
    return run(reductions), reductions


def gradients(ranks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen) * (1 + i) for i, n in enumerate(SIZES)]
            for _ in range(ranks)]


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_every_rank_gets_the_same_bits_and_the_average(nodes, node_size, fmt):
    ranks, codec = nodes * node_size, Codec(fmt)
    grads = gradients(ranks)
    results, reductions = reduce_once(topologies(nodes, node_size), grads, codec)
    assert all(r.final_stage == 4 for r in reductions)
    for k in range(1, ranks):
        for a, b in zip(results[0], results[k]):
            assert torch.equal(a, b), f"rank {k} differs from rank 0"
    # two quantizations, as in the flat reduction: about its error
    flat, _ = reduce_once([Flat(c) for c in LocalGroup(ranks).communicators()], grads, codec)
    exact = torch.cat([torch.stack([g[i].double() for g in grads]).mean(0)
                       for i in range(len(SIZES))])
    errors = [float((torch.cat(r).double() - exact).norm() / exact.norm())
              for r in (results[0], flat[0])]
    assert errors[0] < 1.3 * errors[1], errors


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (2, 4), (4, 2)])
def test_a_sum_is_the_average_times_the_ranks(nodes, node_size):
    ranks, codec = nodes * node_size, Codec("fp8_e4m3")
    grads = gradients(ranks, seed=1)
    summed, _ = reduce_once(topologies(nodes, node_size), grads, codec, average=False)
    exact = torch.stack([g[1].double() for g in grads]).sum(0)
    assert (summed[0][1].double() - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (2, 4), (4, 2)])
def test_fewer_bytes_cross_nodes_than_in_the_flat_reduction(nodes, node_size):
    ranks, codec = nodes * node_size, Codec("nvfp4")
    _, reductions = reduce_once(topologies(nodes, node_size), gradients(ranks), codec)
    flat = BucketLayout.of(SIZES, ranks, codec.align, codec)
    for rank, reduction in enumerate(reductions):
        mine = range(rank // node_size * node_size, (rank // node_size + 1) * node_size)
        flat_across = (sum(b for j, b in enumerate(flat.chunk_bytes) if j not in mine)
                       + flat.slot * (ranks - node_size))
        two_hop_across = reduction.across.bytes_sent
        # 1/L of the flat bytes, give or take the padding of small pieces
        assert two_hop_across < 1.3 * flat_across / node_size, (rank, two_hop_across, flat_across)


def test_error_feedback_cancels_the_quantization_error_over_steps():
    """The same gradients T steps running: with feedback the sum of the results drifts from T x
    the exact average by about one step's error, without it by T steps' errors."""
    nodes, node_size, steps, codec = 2, 2, 8, Codec("nvfp4")
    ranks = nodes * node_size
    grads = gradients(ranks, seed=2)
    exact = [torch.stack([g[i].double() for g in grads]).mean(0) for i in range(len(SIZES))]
    drift = {}
    for feedback in (False, True):
        tops = topologies(nodes, node_size)
        residuals = None
        if feedback:
            residuals = []
            for top in tops:
                owned = top.owned_pieces(list(SIZES), codec)
                residuals.append(([torch.zeros(n) for n in SIZES],
                                  torch.zeros(sum(hi - lo for _, lo, hi in owned))))
        total = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
        for step in range(steps):
            results, _ = reduce_once(tops, grads, codec, residuals, step=step)
            for t, r in zip(total, results[0]):
                t += r.double()
        drift[feedback] = sum(float((t - steps * e).norm()) for t, e in zip(total, exact))
    assert drift[True] < 0.25 * drift[False], drift


def test_owned_pieces_tile_the_bucket_and_match_the_reduction():
    """Every element of the bucket is in exactly one rank's r2 (so fold loses nothing), and each
    rank's r2 has the size its reduction writes."""
    nodes, node_size, codec = 2, 4, Codec("nvfp4")
    ranks = nodes * node_size
    covered = [torch.zeros(n) for n in SIZES]
    for rank in range(ranks):
        parts = owned_pieces(("two-hop", node_size), list(SIZES), rank, ranks, codec)
        for i, lo, hi in parts:
            covered[i][lo:hi] += 1
        layout = TwoHopLayout.of(SIZES, node_size, nodes, codec.align, codec)
        local, node = rank % node_size, rank // node_size
        assert sum(hi - lo for _, lo, hi in parts) == layout.cross[local].owned[node]
    assert all(torch.equal(c, torch.ones_like(c)) for c in covered)


def test_a_flat_state_folds_into_r1_for_another_topology():
    """ErrorFeedback.fold_saved: rank 1 of 2's r2 covers elements 96-159 of the bucket [a (100),
    b (60)] (chunks of 32-element units: 3 and 2), so a[96:100] and all of b get 2 x r2 (an
    average over 2 ranks); r1 made where missing, every r1 spread, the state given unchanged."""
    params = {"a": torch.nn.Parameter(torch.zeros(100)), "b": torch.nn.Parameter(torch.zeros(60))}
    feedback = ErrorFeedback(params, [["a", "b"]], 32)
    r2 = torch.arange(1.0, 65.0)
    state = {"residual1": {"a": torch.ones(100)}, "residual2": {0: r2}, "spread": []}
    folded = feedback.fold_saved(
        state, lambda sizes: owned_pieces(("flat",), sizes, 1, 2, Codec("nvfp4")), 2)
    a = torch.ones(100)
    a[96:] += 2 * r2[:4]
    assert torch.equal(folded["residual1"]["a"], a)
    assert torch.equal(folded["residual1"]["b"], 2 * r2[4:])
    assert folded["residual2"] == {} and folded["spread"] == ["a", "b"]
    assert torch.equal(state["residual1"]["a"], torch.ones(100)) and "b" not in state["residual1"]


def test_the_pipeline_moves_two_hop_reductions_through_their_stages():
    """StagePipeline.progress on every rank in turn (never waiting) takes each bucket's two-hop
    reduction through its four collectives and decodes it: the same bits on every rank as the
    reductions driven alone."""
    nodes, node_size, codec = 2, 2, Codec("nvfp4")
    ranks = nodes * node_size
    grads = gradients(ranks, seed=5)
    expected, _ = reduce_once(topologies(nodes, node_size), grads, codec)
    pipelines = [StagePipeline([["w0", "w1", "w2", "w3"]], Telemetry()) for _ in range(ranks)]
    for top, pipeline, g in zip(topologies(nodes, node_size), pipelines, grads):
        pipeline.start(0, top.reduction("b0", [t.clone() for t in g], codec, None, None, True,
                                        0, [None] * 4, 0))
    for _ in range(10):
        for pipeline in pipelines:
            pipeline.progress()
    assert all(0 in p.results and not p.in_flight for p in pipelines)
    for pipeline in pipelines:
        for name, flat in zip(["w0", "w1", "w2", "w3"], expected[0]):
            assert torch.equal(pipeline.results[0][name], flat), name
    assert pipelines[0].telemetry.counters["node_bytes_sent"] > 0


def test_small_buckets_take_the_flat_reduction():
    tops = topologies(2, 4)
    flats = [torch.randn(64)]
    reduction = tops[0].reduction("b", flats, Codec("nvfp4"), None, None, True, 0, [None], 0)
    assert reduction.final_stage == 2 and reduction.comm.size == 8


@pytest.mark.parametrize("views,expected", [
    ([[0, 2, r % 2, r] for r in range(4)], 2),          # Horovod's local size
    ([[2, 4, r, r] for r in range(4)], 2),              # node_size given
    ([[0, 4, r, r] for r in range(4)], None),           # one node
    ([[0, 1, 0, r] for r in range(4)], None),           # one rank a node
    ([[3, 4, r, r] for r in range(4)], None),           # 4 ranks do not make nodes of 3
    ([[0, 2, [0, 1, 1, 0][r], r] for r in range(4)], None),    # not consecutive
])
def test_plan_nodes(views, expected):
    assert plan_nodes(views, len(views))[0] == expected


def test_plan_nodes_refuses_node_sizes_that_differ():
    with pytest.raises(ValueError, match="node_size differs across ranks"):
        plan_nodes([[2, 4, 0, 0], [4, 4, 1, 1]], 2)


def test_flat_owned_pieces_are_the_chunk_of_the_rank():
    flat = Flat(LocalGroup(2).communicators()[1])
    codec = Codec("nvfp4")
    assert flat.owned_pieces([100, 60], codec) == BucketLayout.of((100, 60), 2, 32).pieces[1]
    assert np.sum([hi - lo for _, lo, hi in flat.owned_pieces([100, 60], codec)]) == 64


class CrossAborted:
    """A communicator across nodes whose collectives raise on every member (an engine that
    aborted it, as torchft's process group does when a replica dies)."""

    def __init__(self, comm):
        self.rank, self.size = comm.rank, comm.size

    def alltoall_async(self, *args):
        raise RuntimeError("the process group across nodes was aborted")

    allgather_async = alltoall_async


def test_a_hop_across_nodes_that_fails_on_one_local_rank_raises_on_every_rank_of_its_node():
    """Local rank 1's hop across nodes raises (on both nodes); local rank 0's succeeds, then
    waits for local rank 1 in the node's allgather. Every rank must end the reduction with an
    error, local rank 0 naming local rank 1, instead of waiting until the node's collective
    times out (issue 55: two-hop DiLoCo with a replica lost)."""
    nodes, node_size = 2, 2
    tops = topologies(nodes, node_size)
    for top in tops[1::node_size]:
        top.cross = CrossAborted(top.cross)
    reductions = [top.reduction("b0", [g.clone() for g in grads], Codec("int3"), None, None,
                                True, 0, [None] * len(grads), 0).start()
                  for top, grads in zip(tops, gradients(nodes * node_size))]
    outcomes = [None] * len(reductions)
    while any(o is None for o in outcomes):
        moved = False
        for k, reduction in enumerate(reductions):
            if outcomes[k] is None and reduction.ready():
                moved = True
                if reduction.stage < reduction.final_stage:
                    reduction.exchange()
                    continue
                try:
                    outcomes[k] = reduction.finish()
                except RuntimeError as error:
                    outcomes[k] = error
        assert moved, "a rank waits for a collective its node peer never posted"
    for k, outcome in enumerate(outcomes):
        assert isinstance(outcome, RuntimeError), k
        expected = ("was aborted" if k % node_size == 1
                    else r"failed on local rank\(s\) \[1\] of this node")
        assert re.search(expected, str(outcome)), (k, str(outcome))


def test_a_failed_hop_marks_every_tensor_nan_in_one_op_and_an_ok_one_keeps_every_bit():
    """The accelerator's path of a failed hop (no host read of the flags): the first element of
    every tensor becomes NaN; with no failure every bit stays, -0, infinities and subnormals
    included."""
    tensors = [torch.tensor([-0.0, 1.0]), torch.tensor([float("inf"), -2.5]), torch.empty(0),
               torch.tensor([1e-40, 3.0])]
    before = [t.clone() for t in tensors]
    nan_first_elements(tensors, torch.tensor(False))
    for got, was in zip(tensors, before):
        assert torch.equal(got.view(torch.int32), was.view(torch.int32))
    nan_first_elements(tensors, torch.tensor(True))
    for got, was in zip(tensors, before):
        if was.numel():
            assert got[0].isnan() and torch.equal(got[1:], was[1:])
