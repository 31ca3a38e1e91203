"""gift.allreduce: the quantized reduce-scatter + allgather against Horovod's fp32 allreduce."""
import pytest
import torch
import horovod.torch as hvd

import horovod_gift as gift
from helpers import assert_identical_on_all_ranks

CODECS = [("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None), ("nvfp4", None)]
SINGLE_STAGE_NMSE = {"fp8_e4m3": 7.0e-4, "fp8_e5m2": 2.8e-3, "nvfp4": 9.0e-3}


def local_tensor(n, seed):
    g = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    return torch.randn(n, generator=g) + 0.5 * torch.randn(1, generator=g)


@pytest.mark.parametrize("fmt,block", CODECS)
def test_matches_fp32_allreduce_within_codec_error(fmt, block):
    x = local_tensor(50_000, seed=1)
    sent = x.clone()
    exact = hvd.allreduce(x, op=hvd.Average, name=f"exact.{fmt}.{block}")
    approx = gift.allreduce(x, name=f"ar.{fmt}.{block}", format=fmt, block_size=block)
    assert torch.equal(x, sent), "gift.allreduce wrote over its input"
    assert approx.shape == x.shape and approx.dtype == x.dtype
    nmse = float(((approx - exact).norm() / exact.norm()) ** 2)
    # two quantization stages, each about the codec's single-stage error relative to its input;
    # averaging independent rank errors shrinks stage 1, so 3x the single-stage floor is generous
    assert nmse < 3 * SINGLE_STAGE_NMSE[fmt], nmse
    assert nmse > 0.05 * SINGLE_STAGE_NMSE[fmt], "suspiciously exact: is anything quantized?"
    assert_identical_on_all_ranks([approx], "gift.allreduce output")


@pytest.mark.parametrize("n", [1, 15, 17, 100, 4097])
def test_small_and_odd_sizes(n):
    x = local_tensor(n, seed=2)
    exact = hvd.allreduce(x, op=hvd.Sum, name=f"exact.sum.{n}")
    approx = gift.allreduce(x, name=f"sum.{n}", format="fp8_e4m3", op=hvd.Sum)
    assert torch.allclose(approx, exact, rtol=0.15, atol=0.15 * float(exact.abs().max()))
    assert_identical_on_all_ranks([approx], f"sum of {n} elements")


def test_dtypes_and_shapes_preserved():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = local_tensor(64, seed=3).view(8, 8).to(dtype)
        y = gift.allreduce(x, name=f"dtype.{dtype}", format="nvfp4")
        assert y.shape == (8, 8) and y.dtype == dtype
        assert_identical_on_all_ranks([y], str(dtype))


def test_rejects_other_ops():
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        gift.allreduce(torch.ones(4), name="bad.op", op=hvd.Adasum)
