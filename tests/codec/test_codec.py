"""The public codec: encode / decode on every format, edge cases, error bounds and sizes."""

import pytest
import torch

import horovod_gift as gift

CODECS = [
    ("fp8_e4m3", None),
    ("fp8_e4m3", 32),
    ("fp8_e5m2", None),
    ("fp8_e5m2", 128),
    ("nvfp4", None),
    ("int3", None),
]
BACKENDS = ["torch", "native", "triton"]


def roundtrip(x, fmt, block, **kw):
    return gift.decode(gift.encode(x, fmt, block_size=block, **kw))


def nmse(y, x):
    return float(((y.double() - x.double()).norm() / x.double().norm()) ** 2)


# Gaussian error floors: NMSE of N(0, 1) samples rounded to each format by numpy + ml_dtypes
# (an independent implementation), +-5 %.
@pytest.mark.parametrize(
    "fmt,block,expected",
    [("nvfp4", None, 9.0e-3), ("fp8_e4m3", 32, 5.8e-4), ("fp8_e5m2", None, 2.8e-3)],
)
def test_gaussian_error_matches_reference_floor(fmt, block, expected):
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    assert abs(nmse(roundtrip(x, fmt, block), x) / expected - 1) < 0.05


@pytest.mark.parametrize(
    "fmt,block,bits",
    [
        ("nvfp4", None, 4.5),
        ("fp8_e4m3", None, 8.0),
        ("fp8_e5m2", None, 8.0),
        ("fp8_e4m3", 32, 9.0),
        ("fp8_e4m3", 128, 8.25),
    ],
)
def test_bits_per_element(fmt, block, bits):
    n = 1 << 16
    enc = gift.encode(torch.randn(n), fmt, block_size=block)
    codes = n // 2 if fmt == "nvfp4" else n
    scales = {"nvfp4": n // 16 + 4, None: 4}.get(
        fmt if fmt == "nvfp4" else block, 4 * n // (block or 1)
    )
    assert enc.nbytes == codes + scales
    assert abs(enc.bits_per_element - bits) < 0.01


@pytest.mark.parametrize("m", [1, 7, 8, 9, 32, 33, 4096, 1 << 16])
def test_int3_payload_is_3_25_bits_an_element_and_32_a_tensor(m):
    """3 bytes a group of 8 codes (the last one zero-padded), an E4M3 byte a 32-block and the
    fp32 tensor scale: 3.25 + 32 / m bits an element when m is a multiple of 32."""
    from horovod_gift.codec.formats import payload_layout

    assert payload_layout("int3", None, m) == (3 * -(-m // 8), -(-m // 32), 4)
    enc = gift.encode(torch.randn(m), "int3")
    assert enc.nbytes == 3 * -(-m // 8) + -(-m // 32) + 4
    if m % 32 == 0:
        assert enc.bits_per_element == 3.25 + 32 / m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
def test_shapes_dtypes_and_layouts(backend, fmt, block):
    # seeded: a 33-element Gaussian sample's INT3 error (7 levels) scatters around 0.06, and an
    # unseeded one crossed 0.1 in CI
    torch.manual_seed(0)
    bound = 0.2 if fmt == "int3" else 0.1
    with gift.use_kernels(backend):
        for x in [
            torch.randn(3, 5, 7),
            torch.randn(()),
            torch.randn(0, 4),
            torch.randn(8, 6).t(),
            torch.randn(33, dtype=torch.float16),
            torch.randn(33, dtype=torch.bfloat16),
            torch.randn(33, dtype=torch.float64),
        ]:
            y = roundtrip(x, fmt, block)
            assert y.shape == x.shape and y.dtype == x.dtype
            if x.numel():
                assert nmse(y, x) < bound
        nc = torch.randn(40, 64)[:, ::2]
        assert torch.equal(roundtrip(nc, fmt, block), roundtrip(nc.contiguous(), fmt, block))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
def test_zeros_decode_to_exact_zeros(backend, fmt, block):
    with gift.use_kernels(backend):
        assert torch.equal(roundtrip(torch.zeros(100), fmt, block), torch.zeros(100))
        x = torch.randn(256)
        x[:128] = 0.0  # all-zero blocks beside non-zero ones
        y = roundtrip(x, fmt, block)
        assert torch.equal(y[:128], torch.zeros(128)) and not torch.isnan(y).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
def test_extreme_magnitudes(backend, fmt, block):
    # INT3's 7 levels a block leave an NMSE of about 0.05 on Gaussian data at any magnitude
    limit = 0.07 if fmt == "int3" else 0.05
    with gift.use_kernels(backend):
        for magnitude in (3e38, 1e20, 1.0, 1e-20, 1e-37):
            x = torch.randn(512, generator=torch.Generator().manual_seed(1)) * (magnitude / 5)
            y = roundtrip(x, fmt, block)
            assert torch.isfinite(y).all(), f"magnitude {magnitude}"
            assert nmse(y, x) < limit, f"magnitude {magnitude}: nmse {nmse(y, x)}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_decodes_to_nan_or_raises(backend, fmt, block, bad):
    x = torch.randn(300)
    x[257] = bad
    with gift.use_kernels(backend):
        assert torch.isnan(roundtrip(x, fmt, block)).all()
        with pytest.raises(ValueError, match=r"grad\.w: 1 of 300 elements are NaN or infinite"):
            gift.encode(x, fmt, block_size=block, nonfinite="raise", name="grad.w")


@pytest.mark.parametrize("fmt,block", CODECS)
def test_stochastic_rounding_is_seeded_and_unbiased(fmt, block):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    a = gift.encode(x, fmt, block_size=block, rounding="stochastic", seed=7)
    b = gift.encode(x, fmt, block_size=block, rounding="stochastic", seed=7)
    assert torch.equal(a.codes, b.codes)
    mean = (
        torch.stack([roundtrip(x, fmt, block, rounding="stochastic", seed=s) for s in range(200)])
        .double()
        .mean(0)
    )
    nearest_bias = (roundtrip(x, fmt, block).double() - x.double()).norm()
    # averaging 200 draws shrinks the error about sqrt(200)-fold; a biased rounding would not
    assert (mean - x.double()).norm() < nearest_bias / 4


@pytest.mark.parametrize("fmt,block", CODECS)
def test_nearest_error_bounded_by_half_a_step(fmt, block):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 10
    enc = gift.encode(x, fmt, block_size=block)
    err = (gift.decode(enc) - x).abs()
    width = block or {"nvfp4": 16, "int3": 32}.get(fmt, 4096)
    blocks = x.abs().view(-1, width).amax(1, keepdim=True)
    if fmt == "int3":
        # half a step of the grid, amax / 3, times E4M3's rounding of the block scale (2**-4)
        bound = (blocks / 6 * (1 + 2.0**-4)).expand(-1, width)
    else:
        mbits = {"fp8_e4m3": 3, "fp8_e5m2": 2, "nvfp4": 1}[fmt]
        # relative error of a normal value is at most 2**-(mbits+1); subnormals are bounded by
        # the smallest step relative to the block's largest value
        floor = {"fp8_e4m3": 2.0**-10 / 448, "fp8_e5m2": 2.0**-17 / 57344, "nvfp4": 0.25 / 6}[fmt]
        bound = torch.maximum(
            x.abs().view_as(blocks.expand(-1, width)) * 2.0 ** -(mbits + 1), blocks * floor
        )
        if fmt == "nvfp4":
            bound = bound * (1 + 2.0**-4)  # the E4M3 block scale itself is rounded
    assert bool((err.view_as(bound) <= bound * (1 + 1e-6)).all())
    assert bool((torch.sign(gift.decode(enc)) * torch.sign(x) >= 0).all()), "a sign flipped"


def test_errors_name_the_problem():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="unknown format 'fp6'"):
        gift.encode(x, "fp6")
    with pytest.raises(ValueError, match="unknown rounding 'up'"):
        gift.encode(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="nvfp4 has fixed 16-element blocks"):
        gift.encode(x, "nvfp4", block_size=32)
    with pytest.raises(ValueError, match="int3 has fixed 32-element blocks"):
        gift.encode(x, "int3", block_size=16)
    with pytest.raises(ValueError, match="power of two"):
        gift.encode(x, "fp8_e4m3", block_size=24)
    with pytest.raises(TypeError, match="grad.x: expected a floating-point tensor"):
        gift.encode(torch.arange(4), "nvfp4", name="grad.x")
    with pytest.raises(ValueError, match="use_kernels"):
        with gift.use_kernels("cuda"):
            pass


def test_backends_agree_through_the_public_api():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    for fmt, block in CODECS:
        with gift.use_kernels("torch"):
            a = gift.encode(x, fmt, block_size=block, rounding="stochastic", seed=1)
        with gift.use_kernels("triton"):
            b = gift.encode(x, fmt, block_size=block, rounding="stochastic", seed=1)
            assert torch.equal(gift.decode(a), gift.decode(b))
        assert torch.equal(a.codes, b.codes) and torch.equal(
            a.scales.view(torch.uint8), b.scales.view(torch.uint8)
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_amax_bound_covers_the_piece_and_flags_nonfinite(backend, fmt, block, bad):
    """Codec.amax_bound, read from a payload's scales, is at least the largest magnitude the
    piece held (the error feedback trusts it to skip reading the residuals), and not finite
    when the piece was not."""
    from horovod_gift.codec.tensor_codec import Codec

    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 3e4
    if bad is not None:
        x[517] = bad
    codec = Codec(fmt, block)
    with gift.use_kernels(backend):
        bound = codec.amax_bound(codec.encode(x, torch.zeros(1000)), 1000)
    assert bound.shape == (1,) and bound.dtype == torch.float32
    if bad is None:
        assert float(bound) >= float(x.abs().max()) * (1 - 2 ** -20)
    else:
        assert not torch.isfinite(bound).all()


def test_scrub_reads_no_residual_under_a_finite_bound_and_clears_the_others():
    from horovod_gift.reduce.feedback import FINITE_AMAX, scrub

    residual = torch.tensor([1.0, float("nan"), 2.0])
    scrub([residual], [torch.tensor([FINITE_AMAX / 2])])
    assert torch.isnan(residual[1]), "a bound under FINITE_AMAX means the sum is skipped"
    scrub([residual], [torch.tensor([float("inf")])])
    assert torch.equal(residual, torch.tensor([1.0, 0.0, 2.0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt,block", CODECS)
def test_encode_into_a_slice_of_a_send_buffer(backend, fmt, block):
    """Codec.encode(out=...) writes the payload's bytes into that slice of a larger buffer and
    nowhere else (the native kernels write codes and scales straight into it), the same bytes
    as a payload of its own; reduce_encode likewise for the owner's stage."""
    from horovod_gift.codec.tensor_codec import Codec

    m = 4133
    x = torch.randn(m, generator=torch.Generator().manual_seed(5))
    codec = Codec(fmt, block)
    size = codec.payload_bytes(m)
    with gift.use_kernels(backend):
        alone = codec.encode(x, torch.zeros(m))
        buffer = torch.full((size + 11,), 0xA5, dtype=torch.uint8)
        written = codec.encode(x, torch.zeros(m), out=buffer[5 : 5 + size])
        assert written.data_ptr() == buffer[5:].data_ptr()
        summed = codec.reduce_encode(torch.stack([alone, alone]), m, 2, torch.zeros(m))
        buffer2 = torch.full((size + 11,), 0xA5, dtype=torch.uint8)
        codec.reduce_encode(torch.stack([alone, alone]), m, 2, torch.zeros(m),
                            out=buffer2[3 : 3 + size])
        with pytest.raises(ValueError, match=f"out must be {size} contiguous uint8"):
            codec.encode(x, out=buffer[:size - 1])
    assert torch.equal(buffer[5 : 5 + size], alone)
    assert torch.equal(buffer2[3 : 3 + size], summed)
    for untouched in (buffer[:5], buffer[5 + size:], buffer2[:3], buffer2[3 + size:]):
        assert bool((untouched == 0xA5).all()), "bytes outside the slice were written"
