"""Bad input and rank disagreement: the same outcome on every rank, never a hang."""
import warnings

import pytest
import torch
import horovod.torch as hvd

import horovod_gift as gift
from helpers import COMM, assert_identical_on_all_ranks
from test_gift import TinyLM, batch


def one_step(compression_kwargs, poison=None):
    model = TinyLM()
    compression = gift.GIFT(model, verbose=False, **compression_kwargs)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    if (
        poison is not None and hvd.rank() == hvd.size() - 1
    ):  # before Horovod's hook sees the gradient
        model.up.weight.register_hook(
            lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(poison))
        )
    x, y = batch(0, hvd.rank())
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.synchronize()
    return model


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_gradient_on_one_rank(poison):
    model = one_step(dict(format="nvfp4"), poison)
    up = model.up.weight.grad
    assert not torch.isfinite(up).all(), "the poisoned tensor came back finite"
    others = [p.grad for n, p in model.named_parameters() if n != "up.weight"]
    assert all(torch.isfinite(g).all() for g in others), "another tensor was poisoned"
    assert_identical_on_all_ranks(
        [g.nan_to_num(nan=7.0) for g in [up] + others], "gradients after a NaN step"
    )


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("fp8_e4m3", None), ("fp8_e5m2", 32)])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_the_step_after_a_nonfinite_one_is_finite(fmt, block, poison):
    """The poisoned step's residuals are cleared: the next step's gradients are all finite."""
    model = TinyLM()
    compression = gift.GIFT(model, format=fmt, block_size=block, verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    hook = None
    if hvd.rank() == hvd.size() - 1:
        hook = model.up.weight.register_hook(
            lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(poison)))
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.synchronize()
        if step == 0:
            assert not torch.isfinite(model.up.weight.grad).all()
            if hook is not None:
                hook.remove()
    grads = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads), "a residual carried the poison on"
    assert_identical_on_all_ranks(grads, "gradients the step after a non-finite one")


def test_nonfinite_gradient_raises_on_every_rank_when_asked():
    with pytest.raises(FloatingPointError, match="averaged gradient of up.weight is not finite"):
        one_step(dict(format="fp8_e4m3", nonfinite="raise"), float("nan"))


@pytest.mark.parametrize(
    "field,values",
    [
        ("format", ("nvfp4", "fp8_e4m3")),
        ("transform", ("auto", "none")),
        ("block_size", (None, 32)),
        ("seed", (0, 1)),
    ],
)
def test_configuration_that_differs_between_ranks_raises_everywhere(field, values):
    kwargs = dict(format="fp8_e4m3")
    kwargs[field] = values[hvd.rank() % 2]
    with pytest.raises(ValueError, match=f"GIFT configuration differs across ranks in {field}"):
        one_step(kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_parameters(dtype):
    model = TinyLM().to(dtype)
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    for step in range(3):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
    assert all(p.dtype == dtype for p in model.parameters())
    assert_identical_on_all_ranks(list(model.parameters()), f"{dtype} parameters")


def test_parameters_without_gradient_on_some_ranks_and_zero_gradients():
    model = TinyLM()
    compression = gift.GIFT(model, format="fp8_e4m3", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        if hvd.rank() == 0 and step % 2 == 0:  # rank 0 skips the MLP: no gradient for up/down
            out = model.head(model.norm(model.embed(x)))
        else:
            out = model(x)
        (
            0.0 * out.sum()
            if step == 3
            else torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
        ).backward()
        opt.step()
    assert_identical_on_all_ranks(
        list(model.parameters()), "parameters after steps with missing gradients"
    )


class OddShapes(torch.nn.Module):
    """Parameters of 0, 1, 15, 17 and 2**20 + 3 elements, and a frozen one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.sizes = [0, 1, 15, 17, (1 << 20) + 3]
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n)) for n in self.sizes
        )
        self.frozen = torch.nn.Parameter(torch.randn(4096), requires_grad=False)

    def forward(self, x):
        return (
            sum((w * x[: w.numel()]).square().sum() for w in self.weights)
            + (self.frozen * x[:4096]).sum()
        )


def test_odd_sizes_empty_noncontiguous_and_frozen_parameters():
    model = OddShapes()
    compression = gift.GIFT(model, format="nvfp4", min_elements=1, verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    model.weights[3].register_hook(
        lambda g: g.view(1, -1).expand(2, -1)[0]
    )  # a non-contiguous gradient
    for step in range(4):
        x = torch.randn(
            (1 << 20) + 3, generator=torch.Generator().manual_seed(step * 100 + hvd.rank())
        )
        opt.zero_grad()
        model(x).backward()
        opt.step()
    assert all(torch.isfinite(w).all() for w in model.weights)
    assert_identical_on_all_ranks(list(model.weights), "odd-sized parameters")


def test_parameter_that_becomes_trainable_mid_run():
    model = TinyLM()
    model.head.weight.requires_grad_(False)
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    local = []
    frozen = model.head.weight.detach().clone()
    for step in range(4):
        if step == 2:
            model.head.weight.requires_grad_(True)  # Horovod registered no hook for it
            model.head.weight.register_hook(lambda g: local.append(g.clone()))
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.synchronize()
        if step >= 2:
            mean = (
                sum(torch.from_numpy(g) for g in COMM.allgather(local[-1].double().numpy()))
                / COMM.size
            )
            assert torch.allclose(
                model.head.weight.grad.double(), mean, rtol=1e-5, atol=1e-7
            ), "the newly trainable parameter's gradient is not the average over ranks"
        with opt.skip_synchronize():
            opt.step()
    assert not torch.equal(model.head.weight, frozen), "the unfrozen parameter was not trained"
    assert_identical_on_all_ranks(list(model.parameters()), "parameters after unfreezing")


def test_a_non_finite_unfrozen_parameter_raises_on_every_rank_and_ends_gifts_step():
    """nonfinite="raise" holds for a parameter GIFT averages itself (trainable since the
    optimizer was wrapped): every rank raises naming it, and GIFT's step still ends on every rank
    (counted, residuals scrubbed, a fresh step state). Horovod's optimizer keeps its handles after
    an exception in synchronize(), so the job cannot step on: the error is for stopping it."""
    model = TinyLM()
    model.head.weight.requires_grad_(False)
    compression = gift.GIFT(model, format="nvfp4", nonfinite="raise", verbose=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    model.head.weight.requires_grad_(True)
    if hvd.rank() == hvd.size() - 1:
        model.head.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    x, y = batch(0, hvd.rank())
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    with pytest.raises(FloatingPointError, match="gradient of head.weight is not finite"):
        opt.synchronize()
    assert compression.step == 1 and not compression.current.in_step
    assert compression.current.outstanding == 0


def test_plain_optimizer_on_a_gift_model_raises_on_every_rank():
    model = TinyLM()
    compression = gift.GIFT(
        model, format="nvfp4", verbose=False
    )  # made, then not passed to Horovod
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, hvd.rank())
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    with pytest.raises(
        RuntimeError,
        match=r"SGD.step\(\) updates the parameters of a model given to GIFT\(model\) "
        "with no Horovod wrapper",
    ):
        opt.step()
    assert compression.step == 0, "GIFT ran although no optimizer used it"


def test_horovod_optimizer_with_other_compression_warns_once():
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert len([w for w in caught if "GIFT does not compress them" in str(w.message)]) == (
            1 if step == 0 else 0
        )
    assert compression.step == 0
    assert_identical_on_all_ranks(list(model.parameters()), "parameters averaged by Horovod")


def test_models_that_differ_between_ranks_raise_everywhere():
    model = TinyLM(hidden=128 if hvd.rank() == 0 else 96)
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    x, y = batch(0, hvd.rank())
    with pytest.raises(
        ValueError, match="differs across ranks in model: .*parameter names or shapes"
    ):
        torch.nn.functional.cross_entropy(
            model(x).flatten(0, 1), y.flatten()
        ).backward()  # raised in Horovod's hook
        opt.synchronize()


def test_compressor_state_loaded_on_one_rank_only_raises_everywhere():
    model = TinyLM()
    compression = gift.GIFT(model, format="fp8_e4m3", verbose=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    saved = dict(compression.state_dict(), step=7)  # every rank saves, rank 0 alone loads
    if hvd.rank() == 0:
        compression.load_state_dict(saved)
    x, y = batch(0, hvd.rank())
    with pytest.raises(
        ValueError, match=r"differs across ranks in step: rank 0: step=7.*on every rank"
    ):
        torch.nn.functional.cross_entropy(
            model(x).flatten(0, 1), y.flatten()
        ).backward()  # raised in Horovod's hook
        opt.synchronize()
