"""TransformPlan's "auto" round trips and ErrorFeedback's change of basis, which work over the
tensors they are given instead of allocating tensor-sized temporaries (benchmarks/memory.py)."""
from types import SimpleNamespace

import pytest
import torch

from horovod_gift.codec.tensor_codec import Codec
from horovod_gift.reduce.feedback import ErrorFeedback
from horovod_gift.geometry.whitening import InputWhitening
from horovod_gift.codec.rotation import HadamardRotation
from horovod_gift.geometry.transforms import DISTANCE_BLOCK, TransformPlan, squared_distance

OUT, IN = 48, 64


def make_plan(transform="auto"):
    g = torch.Generator().manual_seed(0)
    whitening = InputWhitening(IN, rank=8, damping=1.0)
    # correlated inputs: the whitening is far from the identity
    whitening.update(torch.randn(512, IN, generator=g) @ torch.randn(IN, IN, generator=g))
    params = {"w": torch.nn.Parameter(torch.zeros(OUT, IN)),
              "b": torch.nn.Parameter(torch.zeros(3000))}
    statistics = SimpleNamespace(whitening={"w": whitening}, transposed=set())
    return TransformPlan(params, transform, statistics, HadamardRotation(128, 0)), params


@pytest.mark.parametrize("name,dtype", [("w", torch.float32), ("b", torch.float32),
                                        ("w", torch.bfloat16)])
def test_auto_records_every_candidates_round_trip_error_and_leaves_the_gradient(name, dtype):
    plan, params = make_plan()
    codec = Codec("nvfp4")
    gradient = torch.randn(params[name].shape, generator=torch.Generator().manual_seed(1))
    gradient = gradient.to(dtype)
    before = gradient.clone()
    plan.begin_step(evaluating=True)
    plan.record(name, gradient, codec)
    assert torch.equal(gradient, before), "a round trip wrote over the gradient"
    flat = before.reshape(-1).float()
    expected = []
    for candidate in plan.candidates(name):
        u = plan.forward(name, before.clone(), candidate)
        back = plan.inverse(name, codec.decode(codec.encode(u), u.numel()), candidate)
        expected.append(float((back - flat).double().pow(2).sum()))
    recorded = plan._errors[name].tolist()
    assert recorded[: len(expected)] == pytest.approx(expected, rel=1e-9)
    assert recorded[len(expected):] == [0.0] * (4 - len(expected))
    assert len(set(expected)) == len(expected), "the candidates should differ"


def test_squared_distance_sums_every_block_in_fp64():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2 * DISTANCE_BLOCK + 12345, generator=g)
    b = torch.randn(a.numel(), generator=g)
    expected = float((a - b).double().pow(2).sum())     # the difference is taken in fp32
    assert float(squared_distance(a.clone(), b)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_change_of_basis_maps_the_residual_over_itself(dtype):
    """r1 <- F_new(F_old^-1(r1)), whitening to hadamard, in the residual's own storage."""
    plan, params = make_plan()
    feedback = ErrorFeedback(params, [["w"]], Codec("nvfp4").align, dtype)
    residual = feedback.first_stage(["w"])[0]
    residual.copy_(torch.randn(OUT * IN, generator=torch.Generator().manual_seed(3)))
    storage = residual.untyped_storage().data_ptr()
    wide = residual.float()
    old = plan.inverse("w", wide.clone(), "whiten").view(OUT, IN)
    expected = plan.forward("w", old, "hadamard").to(dtype)
    calls = []

    def old_inverse(u, **options):
        calls.append(options)
        return plan.inverse("w", u, "whiten", **options)

    def new_forward(g, **options):
        calls.append(options)
        return plan.forward("w", g, "hadamard", **options)

    feedback.convert("w", old_inverse, new_forward)
    assert calls == [{"in_place": True}] * 2, "a map made a temporary the tensor's size"
    assert feedback.stage1["w"].untyped_storage().data_ptr() == storage
    assert torch.equal(feedback.stage1["w"], expected)
