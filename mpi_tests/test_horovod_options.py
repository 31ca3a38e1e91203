"""Horovod's DistributedOptimizer options with GIFT as the compressor: each is honoured or refused
with the same clear error on every rank (never a hang, a crash or a silently wrong result)."""
import contextlib
import sys

import pytest
import torch
import horovod.torch as hvd

import horovod_gift as gift
from helpers import COMM, assert_identical_on_all_ranks, assert_same_on_all_ranks
from test_gift import TinyLM, batch


def step(model, opt, step_index):
    opt.zero_grad()
    x, y = batch(step_index, hvd.rank())
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss.item()


class SparseLM(torch.nn.Module):
    """A sparse embedding (Horovod reduces its gradient itself) beside compressed Linears."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim, sparse=True)
        self.up = torch.nn.Linear(dim, 64)
        self.head = torch.nn.Linear(64, vocab)

    def forward(self, tokens):
        return self.head(torch.relu(self.up(self.embed(tokens))))


def test_sparse_gradients_bypass_compression():
    model = SparseLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    losses = [step(model, opt, k) for k in range(4)]
    assert losses[-1] < losses[0]
    assert_identical_on_all_ranks(list(model.parameters()), "parameters with a sparse embedding")
    assert "embed.weight" not in compression.reducer.bucket_of
    assert compression.stats()["steps"] == 4


@pytest.mark.parametrize("given", [False, True])
def test_gift_reduces_over_the_optimizers_process_set(given):
    """GIFT made with the optimizer's process set, or without one (it takes the optimizer's)."""
    # not a set GIFT adds for nodes (those have a node's or a node count's ranks): adding one
    # twice is an error of Horovod's
    subset = list(range(hvd.size() - 1))
    process_set = hvd.add_process_set(subset)
    try:
        digest = None
        if hvd.rank() in subset:
            model = TinyLM()
            compression = gift.GIFT(model, format="nvfp4", verbose=False,
                                    process_set=process_set if given else None)
            opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                           named_parameters=model.named_parameters(),
                                           compression=compression, process_set=process_set)
            losses = [step(model, opt, k) for k in range(6)]
            assert losses[-1] < losses[0]
            assert compression.process_set.process_set_id == process_set.process_set_id
            # resume: the compressor's state loads before it knows the optimizer's process set
            saved = {"model": model.state_dict(), "compressor": compression.state_dict()}
            model = TinyLM()
            model.load_state_dict(saved["model"])
            compression = gift.GIFT(model, format="nvfp4", verbose=False)
            compression.load_state_dict(saved["compressor"])
            opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                           named_parameters=model.named_parameters(),
                                           compression=compression, process_set=process_set)
            step(model, opt, 6)
            assert compression.stats()["steps"] == 7
            from helpers import digest as parameters_digest
            digest = parameters_digest(list(model.parameters()))
        digests = {d for d in COMM.allgather(digest) if d is not None}
        assert len(digests) == 1, "parameters differ inside the process set"
    finally:
        hvd.remove_process_set(process_set)


def test_a_process_set_other_than_the_optimizers_raises_on_every_rank():
    # not a set GIFT adds for nodes (those have a node's or a node count's ranks): adding one
    # twice is an error of Horovod's
    subset = list(range(hvd.size() - 1))
    process_set = hvd.add_process_set(subset)
    try:
        model = TinyLM()
        compression = gift.GIFT(model, format="nvfp4", process_set=process_set, verbose=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=compression)        # the global set
        with pytest.raises(ValueError, match=r"GIFT was made with process set .* reduces over"):
            step(model, opt, 0)
    finally:
        hvd.remove_process_set(process_set)


@pytest.mark.parametrize("transform", ["none", "hadamard"])
def test_op_sum_returns_the_sum(transform):
    layer = torch.nn.Linear(256, 64, bias=False)
    compression = gift.GIFT(layer, format="fp8_e4m3", transform=transform, verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0),
                                   named_parameters=[("w", layer.weight)],
                                   compression=compression, op=hvd.Sum)
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(hvd.rank())) + hvd.rank()
    truth = hvd.allreduce(g, op=hvd.Sum, name=f"sum.truth.{transform}")
    layer.weight.grad = g.clone()
    opt.synchronize()
    error = float((layer.weight.grad - truth).norm() / truth.norm())
    assert error < 0.05, f"op=hvd.Sum: result off the sum by {error:.3f}"
    assert_identical_on_all_ranks([layer.weight.grad], "summed gradient")


def test_an_op_gift_cannot_honour_is_refused_on_every_rank():
    model = TinyLM()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=gift.GIFT(model, verbose=False), op=hvd.Max)
    with pytest.raises(ValueError, match=r"supports op=hvd.Average and op=hvd.Sum"):
        step(model, opt, 0)


def test_join_with_uneven_data_takes_the_fp32_path_on_joined_steps():
    """Rank 0 trains 3 steps, the others 1, then all call hvd.join(): the joined steps give what
    Horovod's own fp32 allreduce gives, and a step after the join is compressed and identical."""
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    reference = TinyLM()
    reference_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(reference.parameters(), lr=0.1),
        named_parameters=[(f"reference.{n}", p) for n, p in reference.named_parameters()])
    step(model, opt, 0)
    failure = None
    if hvd.rank() == 0:
        try:        # a failure on rank 0 must not leave the others waiting in join
            joined_steps(model, opt, reference, reference_opt)
        except Exception as error:      # reported after the collectives every rank runs
            failure = error
    hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step(model, opt, 3)
    assert_identical_on_all_ranks(list(model.parameters()), "parameters after the join")
    assert_same_on_all_ranks(compression.stats()["steps"], "GIFT's step count")
    if failure is not None:
        raise failure
    assert compression.stats()["joined_steps"] == (2 if hvd.rank() == 0 else 0)


def joined_steps(model, opt, reference, reference_opt):
    for k in (1, 2):
        opt.zero_grad()
        reference.load_state_dict(model.state_dict())
        for m in (model, reference):
            x, y = batch(k, hvd.rank())
            torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        opt.synchronize()
        reference_opt.synchronize()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), f"joined step {k}: {name} differs from fp32"
        with opt.skip_synchronize():
            opt.step()
        reference_opt.zero_grad()


def test_statistics_and_hooks_only_where_whitening_can_be_chosen():
    for transform, hooked in (("none", False), ("hadamard", False), ("auto", True)):
        model = TinyLM()
        compression = gift.GIFT(model, transform=transform, verbose=False)     # noqa: F841 (kept)
        hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
        assert (hooks > 0) == hooked, f"transform={transform}: {hooks} forward hooks"


# ------------------------------------------------------------------------- device placement
FACTORIES = ("zeros", "empty", "ones", "full", "tensor", "arange", "randn", "rand", "randint",
             "as_tensor", "linspace", "eye", "empty_strided")


@contextlib.contextmanager
def unplaced_allocations():
    """Records every call of a torch factory function made from horovod_gift's own code without a
    device=, in every thread. torch.set_default_device("cuda") (common in LLM scripts) would send
    such a tensor to the GPU; a TorchFunctionMode would not see the autograd hooks where Horovod
    calls compress (they do not inherit it), so the factories themselves are wrapped."""
    found, originals = set(), {name: getattr(torch, name) for name in FACTORIES}

    def recorded(factory):
        def call(*args, **kwargs):
            caller = sys._getframe(1)
            if "device" not in kwargs and caller.f_globals.get("__name__", "").startswith(
                    "horovod_gift"):
                found.add(f"{caller.f_code.co_filename}:{caller.f_lineno} torch.{factory.__name__}")
            return factory(*args, **kwargs)
        return call
    for name, factory in originals.items():
        setattr(torch, name, recorded(factory))
    try:
        yield found
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)


@pytest.mark.parametrize("format,transform,residual_dtype", [
    ("nvfp4", "auto", torch.float32), ("fp8_e4m3", "whiten+hadamard", torch.bfloat16)])
def test_every_tensor_gift_creates_is_placed_on_purpose(format, transform, residual_dtype):
    with unplaced_allocations() as found:
        model = SparseLM()
        compression = gift.GIFT(model, format=format, transform=transform, refresh_every=2,
                                residual_dtype=residual_dtype, verbose=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=compression)
        for k in range(5):       # refreshes, votes, residual conversions
            step(model, opt, k)
        compression.state_dict()
    assert not found, "allocations without a device:\n" + "\n".join(sorted(found))
