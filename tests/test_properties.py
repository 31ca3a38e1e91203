"""Property-based tests of encode/decode on every format and rounding (hypothesis)."""
import math

import torch
from hypothesis import given, settings, strategies as st

import horovod_gift as gift

CODECS = st.sampled_from(
    [("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None), ("fp8_e5m2", 16), ("nvfp4", None)]
)
ROUNDING = st.sampled_from(["nearest", "stochastic"])
MANTISSA_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2, "nvfp4": 1}
values = st.lists(
    st.floats(min_value=-(2.0**20), max_value=2.0**20, allow_nan=False, width=32),
    min_size=1,
    max_size=200,
)


def roundtrip(x, codec, rounding, seed=0):
    fmt, block = codec
    return gift.decode(gift.encode(x, fmt, block_size=block, rounding=rounding, seed=seed))


@settings(max_examples=150, deadline=None)
@given(values, CODECS, ROUNDING)
def test_finite_in_finite_out_sign_kept_error_bounded(data, codec, rounding):
    x = torch.tensor(data, dtype=torch.float32)
    y = roundtrip(x, codec, rounding)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert bool((y * x >= 0).all()), "a sign flipped"
    fmt, block = codec
    width = block or (16 if fmt == "nvfp4" else x.numel())
    pad = (-x.numel()) % width
    amax = (
        torch.nn.functional.pad(x.abs(), (0, pad))
        .view(-1, width)
        .amax(1)
        .repeat_interleave(width)[: x.numel()]
    )
    if fmt == "nvfp4":
        amax = torch.maximum(amax, torch.full_like(amax, float(x.abs().max()) * 2.0**-9 / 448))
    # one step of the format at the element's own magnitude, or the smallest step of its block
    step = 2.0 ** -MANTISSA_BITS[fmt] * x.abs() * (2 if rounding == "stochastic" else 1)
    floor = (
        amax
        * {"fp8_e4m3": 2.0**-9 / 448, "fp8_e5m2": 2.0**-16 / 57344, "nvfp4": 0.5 / 6 * 1.07}[fmt]
    )
    assert bool(((y - x).abs() <= torch.maximum(step, floor) * 1.0001 + 1e-30).all())


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(min_value=2.0**-20, max_value=2.0**20, width=32), min_size=1, max_size=100),
    CODECS,
    ROUNDING,
    st.integers(min_value=-30, max_value=30),
    st.booleans(),
)
def test_power_of_two_scaling_commutes(data, codec, rounding, k, negate):
    x = torch.tensor(data, dtype=torch.float32) * (-1 if negate else 1)
    assert torch.equal(
        roundtrip(x * 2.0**k, codec, rounding), roundtrip(x, codec, rounding) * 2.0**k
    )


@settings(max_examples=150, deadline=None)
@given(values, CODECS)
def test_encoding_a_decoded_tensor_changes_nothing(data, codec):
    """Decoded values lie on the grid; only the fp32 rounding of a recomputed scale can move
    them."""
    x = torch.tensor(data, dtype=torch.float32)
    once = roundtrip(x, codec, "nearest")
    twice = roundtrip(once, codec, "nearest")
    assert torch.allclose(twice, once, rtol=2.0**-20, atol=0)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.floats(min_value=-100, max_value=100, width=32), min_size=16, max_size=64), CODECS
)
def test_stochastic_rounding_is_unbiased(data, codec):
    x = torch.tensor(data, dtype=torch.float32)
    draws = torch.stack([roundtrip(x, codec, "stochastic", seed) for seed in range(400)]).double()
    fmt, block = codec
    smallest_step = {
        "fp8_e4m3": 2.0**-9 / 448,
        "fp8_e5m2": 2.0**-16 / 57344,
        "nvfp4": 0.5 / 6 * 1.07,
    }[fmt]
    step = (
        2.0 ** -MANTISSA_BITS[fmt] * x.double().abs() + float(x.abs().max()) * smallest_step
    )  # generous
    # nearest rounding would leave errors up to half a step; the mean of 400 unbiased draws is
    # within a few standard errors (step / 2 / sqrt(400)) plus the scale's own fp32 rounding
    bound = 5 * step / 2 / math.sqrt(400) + 2.0**-20 * x.double().abs() + 1e-12
    assert bool(((draws.mean(0) - x.double()).abs() <= bound).all())
