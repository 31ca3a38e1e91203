"""GIFT's two-hop reduction over Horovod on simulated nodes (node_size consecutive ranks a node,
process sets added by GIFT): 2 x 2 under -np 4, 2 x 4 and 4 x 2 under -np 8. The rest of
mpi_tests/ runs under it too with GIFT_TEST_NODE_SIZE (conftest.py)."""
import pytest
import torch
import horovod.torch as hvd

import horovod_gift as gift
from helpers import assert_identical_on_all_ranks, assert_same_on_all_ranks
from horovod_gift.reduce.two_hop import TwoHopLayout
from test_gift import TinyLM, make, run


def node_sizes():
    """The node sizes that make several nodes of several ranks at this job's size."""
    return [n for n in (2, 4) if hvd.size() % n == 0 and 1 < n < hvd.size()]


@pytest.fixture(params=[2, 4])
def node_size(request):
    if request.param not in node_sizes():
        pytest.skip(f"{hvd.size()} ranks make no nodes of {request.param}")
    return request.param


def make_two_hop(node_size, **kw):
    model = TinyLM()
    compression = gift.GIFT(model, format=kw.pop("format", "nvfp4"), topology="two-hop",
                            node_size=node_size, refresh_every=kw.pop("refresh_every", 10),
                            verbose=False, **kw)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    return model, opt, compression


def test_two_hop_trains_like_flat_with_every_rank_identical(node_size):
    flat = run(*make("nvfp4", topology="flat")[:2], steps=30)
    model, opt, compression = make_two_hop(node_size, transform="auto")
    losses = run(model, opt, steps=30)
    assert "two-hop" in compression.describe(), compression.describe()
    assert_identical_on_all_ranks(list(model.parameters()), "parameters after 30 two-hop steps")
    final, reference = sum(losses[-5:]) / 5, sum(flat[-5:]) / 5
    assert losses[-1] < 0.5 * losses[0], losses
    assert abs(final - reference) < 0.05 * reference + 0.02, (final, reference)


def test_error_feedback_is_carried_across_whitening_refreshes(node_size):
    """A fixed gradient per rank, whitened with factors refreshed every 3 rounds: the running
    mean of what comes back converges to the average; a residual left outside a rank's node
    chunk after a change of basis would be lost at every refresh."""
    layer = torch.nn.Linear(100, 63, bias=False)    # node chunks end inside rows
    compression = gift.GIFT(layer, format="nvfp4", transform="whiten", refresh_every=3,
                            topology="two-hop", node_size=node_size, verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0),
                                   named_parameters=[("w", layer.weight)],
                                   compression=compression)
    gen = torch.Generator().manual_seed(hvd.rank())
    g = torch.randn(63, 100, generator=gen) * (1 + hvd.rank())
    truth = hvd.allreduce(g, op=hvd.Average, name="two_hop.truth")
    layout = TwoHopLayout.of((g.numel(),), node_size, hvd.size() // node_size,
                             compression.codec.align, compression.codec)
    (_, lo, hi), = layout.node_pieces[hvd.rank() % node_size]
    total, errors, outside = torch.zeros_like(g), [], []
    for k in range(1, 31):
        # inputs whose scales change every round: each refresh changes the basis a lot
        layer(torch.randn(32, 100, generator=gen) * torch.rand(100, generator=gen).pow(4) * 3)
        layer.weight.grad = g.clone()
        opt.synchronize()
        total += layer.weight.grad
        errors.append(float((total / k - truth).norm() / truth.norm()))
        r1 = compression.reducer.feedback.stage1["weight"].clone()
        r1[lo:hi] = 0
        outside.append(float(r1.norm()))
    assert_identical_on_all_ranks([total], "the sum of the averaged gradients")
    assert errors[-1] < 0.1 * errors[0], errors
    # what a change of basis moved outside this rank's node chunk went into the node's sum
    assert max(outside) == 0, outside
    assert compression.statistics.refresh_every == 3 and compression.step == 30


def test_a_flat_checkpoint_resumes_two_hop_and_two_hop_resumes_bit_identical(node_size):
    model, opt, compression = make("nvfp4", topology="flat")
    run(model, opt, steps=8)
    saved = {"model": {n: t.clone() for n, t in model.state_dict().items()},
             "compressor": compression.state_dict()}
    model, opt, compression = make_two_hop(node_size, transform="auto")
    model.load_state_dict(saved["model"])
    compression.load_state_dict(saved["compressor"])
    losses = run(model, opt, steps=14, start=8)
    assert compression.reducer.feedback.stage2 and all(torch.isfinite(r).all()
                                                for r in compression.reducer.feedback.tensors())
    assert_identical_on_all_ranks(list(model.parameters()), "two-hop parameters after a flat state")
    assert losses[-1] < losses[0] * 1.1, losses

    reference_model, reference_opt, _ = make_two_hop(node_size)
    run(reference_model, reference_opt, steps=14)
    model, opt, compression = make_two_hop(node_size)
    run(model, opt, steps=7)
    saved = {"model": {n: t.clone() for n, t in model.state_dict().items()},
             "optimizer": opt.state_dict(), "compressor": compression.state_dict()}
    model, opt, compression = make_two_hop(node_size)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    compression.load_state_dict(saved["compressor"])
    run(model, opt, steps=14, start=7)
    for a, b in zip(reference_model.parameters(), model.parameters()):
        assert torch.equal(a, b), "a resumed two-hop run differs from the uninterrupted one"


def test_op_sum_in_two_hops(node_size):
    layer = torch.nn.Linear(256, 64, bias=False)
    compression = gift.GIFT(layer, format="fp8_e4m3", transform="none", topology="two-hop",
                            node_size=node_size, verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0),
                                   named_parameters=[("w", layer.weight)],
                                   compression=compression, op=hvd.Sum)
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(hvd.rank())) + hvd.rank()
    truth = hvd.allreduce(g, op=hvd.Sum, name="two_hop.sum.truth")
    layer.weight.grad = g.clone()
    opt.synchronize()
    assert float((layer.weight.grad - truth).norm() / truth.norm()) < 0.05
    assert_identical_on_all_ranks([layer.weight.grad], "summed gradient")


def first_step(**options):
    """One step of TinyLM with GIFT(**options): the topology is chosen there."""
    model = TinyLM()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=gift.GIFT(model, verbose=False, **options))
    run(model, opt, steps=1)


def test_two_hop_that_cannot_be_formed_is_refused_on_every_rank():
    """Every rank raises the same error at the first step, and none waits on the others."""
    with pytest.raises(ValueError, match="needs several nodes of several ranks") as raised:
        first_step(topology="two-hop", node_size=hvd.size())
    assert_same_on_all_ranks(str(raised.value), "the error")
    with pytest.raises(ValueError, match="node_size differs across ranks"):
        first_step(topology="auto", node_size=1 + hvd.rank() % 2)
    with pytest.raises(ValueError, match="unknown topology"):
        gift.GIFT(TinyLM(), topology="ring", verbose=False)


def test_two_hop_with_a_process_set_is_refused_and_auto_goes_flat():
    ranks = list(range(hvd.size() - 1))     # never one of the sets GIFT adds for nodes
    process_set = hvd.add_process_set(ranks) if hvd.size() > 2 else hvd.global_process_set
    if process_set is hvd.global_process_set:
        pytest.skip("needs a process set smaller than the job")
    try:
        if hvd.rank() in ranks:     # only the set's ranks make these GIFTs
            with pytest.raises(ValueError, match="global process set"):
                gift.GIFT(TinyLM(), topology="two-hop", node_size=2, process_set=process_set,
                          verbose=False)
            compression = gift.GIFT(TinyLM(), node_size=2, process_set=process_set,
                                    verbose=False)
            assert compression.reducer.topology.describe() == "flat"
            model = TinyLM()    # and with the set taken from the optimizer at the first step
            compression = gift.GIFT(model, node_size=2, verbose=False)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=compression, process_set=process_set)
            opt.zero_grad()
            model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
            opt.step()
            assert compression.reducer.topology.describe() == "flat"
    finally:
        hvd.remove_process_set(process_set)


def test_bytes_across_nodes_are_a_node_size_share_of_the_flat_reduction(monkeypatch, node_size):
    """What Horovod is handed for the quantized hop across nodes, counted here, is what GIFT
    reports (bytes_sent less node_bytes_sent), and about 2 (N - 1) / N of 1/L of the elements at
    the format's bits (NVFP4 4.5, INT3 3.25)."""
    counted = {"across": 0}
    real_alltoall, real_allgather = hvd.alltoall_async, hvd.allgather_async

    def across(name):      # two_hop.py names them gift.b<bucket>.l<local rank>.<stage>
        return name.startswith("gift.b") and ".l" in name

    def alltoall_async(tensor, splits=None, name=None, process_set=hvd.global_process_set):
        if across(name):
            counted["across"] += tensor.numel() - int(splits[process_set.rank()])
        return real_alltoall(tensor, splits=splits, name=name, process_set=process_set)

    def allgather_async(tensor, name=None, process_set=hvd.global_process_set):
        if across(name):
            counted["across"] += tensor.numel() * (process_set.size() - 1)
        return real_allgather(tensor, name=name, process_set=process_set)

    monkeypatch.setattr(hvd, "alltoall_async", alltoall_async)
    monkeypatch.setattr(hvd, "allgather_async", allgather_async)
    nodes = hvd.size() // node_size
    for fmt, bits in (("nvfp4", 4.5), ("int3", 3.25)):    # fewer bits, fewer bytes across
        counted["across"] = 0
        model, opt, compression = make_two_hop(node_size, format=fmt, transform="none")
        run(model, opt, steps=3)
        stats = compression.stats()
        assert stats["bytes_sent"] - stats["node_bytes_sent"] == counted["across"], (stats,
                                                                                     counted)
        quantized = stats["elements"] - stats["uncompressed_elements"]
        expected = 2 * (nodes - 1) / nodes * quantized / node_size * bits / 8
        assert abs(counted["across"] - expected) < 0.15 * expected, (fmt, counted, expected)
        assert stats["node_bytes_sent"] > 0
