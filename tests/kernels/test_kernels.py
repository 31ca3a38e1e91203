"""Every kernel against its plain-torch reference, bit for bit, in the Triton interpreter."""
import pytest
import torch

from horovod_gift.kernels import fp8, fused, hadamard, int3, nvfp4

SIZES = [1, 15, 17, 1000, 100_003]
FP8_CASES = [("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None), ("fp8_e5m2", 16)]


def bits(t):
    return None if t is None else t.contiguous().view(torch.uint8)


def assert_same_bits(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert (
            a.shape == b.shape and a.dtype == b.dtype
        ), f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        mismatches = int((bits(a) != bits(b)).sum())
        assert mismatches == 0, f"{what}: {mismatches} bytes differ"


def sample(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(
        2 * torch.randn(n, generator=g)
    )  # heavy-tailed magnitudes
    specials = torch.tensor([0.0, -0.0, 1e-30, -3e-8, 448.0, 57344.0, 1e4, -6.0])
    x[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return x


@pytest.mark.parametrize("fmt,block", FP8_CASES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp8_encode_decode(fmt, block, n, stochastic):
    x, spec = sample(n), fp8.FORMATS[fmt]
    scale = fp8.tensor_scale_torch(x.abs().amax(), spec.max) if block is None else None
    ref = fp8.fp8_encode_torch(x, spec, block, scale, seed=5, stochastic=stochastic)
    out = fp8.fp8_encode_triton(x, spec, block, scale, seed=5, stochastic=stochastic)
    assert_same_bits(ref[0], out[0], "codes")
    assert_same_bits(ref[1], out[1], "scales")
    assert_same_bits(
        fp8.fp8_decode_torch(*ref, spec, block), fp8.fp8_decode_triton(*ref, spec, block), "decoded"
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "int3"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_block_scaled_encode_decode(fmt, n, stochastic):
    """NVFP4 and INT3: E4M3 block scales under an fp32 tensor scale, packed codes."""
    module = {"nvfp4": nvfp4, "int3": int3}[fmt]

    def kernel(name):
        return getattr(module, f"{fmt}_{name}")

    x = sample(n, seed=1)
    scale = kernel("tensor_scale_torch")(x.abs().amax()).reshape(1)
    ref = kernel("encode_torch")(x, scale, seed=3, stochastic=stochastic)
    out = kernel("encode_triton")(x, scale, seed=3, stochastic=stochastic)
    assert_same_bits(ref[0], out[0], "packed codes")
    assert_same_bits(ref[1], out[1], "block scales")
    assert_same_bits(
        kernel("decode_torch")(*ref, scale, n), kernel("decode_triton")(*ref, scale, n), "decoded"
    )


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_int3_grid_and_packing_by_hand(backend):
    """Known inputs -> known bytes. The tensor's amax 3 gives the tensor scale s = 3 / 1344.
    Block 1 (amax 3): ratio 3 / (3 s) = 448, E4M3 code 0x7E, so the step is 448 s (1 within
    rounding); nearest even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2, -0.4 -> 0 (no negative
    zero). Block 2 (amax 2): ratio 298.7 -> E4M3 288 (0x79), step 288 s = 0.643: 1 -> 2,
    -1 -> -2, 2 -> 3.11, saturated at 3. A code is |level| with the sign in bit 2; code i of a
    group of 8 sits at bits 3i..3i+2 of its 24-bit word, bytes little-endian; the partial last
    group of 3 elements is zero-padded."""
    import horovod_gift as gift

    head = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 0.5, 1.5, 2.5, -2.5, -0.4, 1.4, -1.6, 3.0, -3.0]
    x = torch.tensor(head + [0.0] * 16 + [1.0, -1.0, 2.0])
    with gift.use_kernels(backend):
        enc = gift.encode(x, "int3")
        decoded = gift.decode(enc)
    # group 1: codes 0 1 2 3 5 6 7 0 -> word 0x1F5688; group 2: 2 2 6 0 1 6 3 7 -> 0xEF1192;
    # groups 3, 4: zeros; group 5: 2 6 3 (and 5 padding zeros) -> 0x0000F2
    assert enc.codes.tolist() == [0x88, 0x56, 0x1F, 0x92, 0x11, 0xEF] + [0] * 6 + [0xF2, 0, 0]
    assert enc.scales.tolist() == [0x7E, 0x79]
    tensor_scale = torch.tensor([3.0]) / 1344
    assert torch.equal(enc.tensor_scale, tensor_scale)
    levels = torch.tensor([0, 1, 2, 3, -1, -2, -3, 0, 2, 2, -2, 0, 1, -2, 3, -3] + [0] * 16
                          + [2, -2, 3], dtype=torch.float32)
    steps = torch.cat([torch.full((32,), 448.0), torch.full((3,), 288.0)]) * tensor_scale
    assert torch.equal(decoded, levels * steps)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [16, 128, 1024])
def test_hadamard_forward_and_inverse(n, block):
    x = sample(n, seed=2)
    y = hadamard.hadamard_torch(x, block, seed=11)
    assert_same_bits(y, hadamard.hadamard_triton(x, block, seed=11), "rotated")
    back = hadamard.hadamard_torch(y, block, seed=11, inverse=True)
    in_place = y.clone()
    assert (
        hadamard.hadamard_triton(in_place, block, seed=11, inverse=True, out=in_place) is in_place
    )
    assert_same_bits(back, in_place, "rotated back in place")


# The fused kernel rotates whole spans only (formats.quantize rotates a remainder first), so sizes
# with a rotation are multiples of its span: 16 interleaved blocks.
FUSED_SHAPES = [(n, None) for n in (1, 17, 4096 + 128, 100_096)] + [
    (n, rotation) for rotation in ((128, 4), (16, 9)) for n in (4096 + 2048, 100_352)
]


@pytest.mark.parametrize(
    "fmt,block,stochastic",
    [(f, b, True) for f, b in FP8_CASES]
    + [("fp8_e4m3", 32, False), ("nvfp4", None, True), ("nvfp4", None, False),
       ("int3", None, True), ("int3", None, False)],
)
@pytest.mark.parametrize("n,rotation", FUSED_SHAPES)
def test_fused_rotate_feedback_quantize(fmt, block, stochastic, n, rotation):
    x = sample(n, seed=3)
    r_ref = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.01
    r_out = r_ref.clone()
    ref = fused.rotate_feedback_quantize_torch(
        x, r_ref, fmt, block, rotation, seed=6, stochastic=stochastic
    )
    out = fused.rotate_feedback_quantize_triton(
        x, r_out, fmt, block, rotation, seed=6, stochastic=stochastic
    )
    for name, a, b in zip(("codes", "scales", "tensor scale"), ref, out):
        assert_same_bits(a, b, name)
    assert_same_bits(r_ref, r_out, "updated residual")


@pytest.mark.parametrize("fmt,block", FP8_CASES + [("nvfp4", None), ("int3", None)])
@pytest.mark.parametrize("n", [1, 17, 10_000])
def test_accumulate(fmt, block, n):
    payloads = [
        fused.rotate_feedback_quantize_torch(sample(n, seed=10 + k), None, fmt, block)
        for k in range(3)
    ]
    codes = torch.stack([p[0] for p in payloads])
    scales = torch.stack([p[1] for p in payloads])
    tensor_scales = None if payloads[0][2] is None else torch.cat([p[2] for p in payloads])
    ref = fused.accumulate_torch(codes, scales, tensor_scales, n, fmt, block)
    assert_same_bits(
        ref, fused.accumulate_triton(codes, scales, tensor_scales, n, fmt, block), "sum"
    )
    decoded = [fused.decode_torch(p[0], p[1], p[2], n, fmt, block).double() for p in payloads]
    exact, magnitude = sum(decoded), sum(d.abs() for d in decoded)
    assert bool(
        ((ref.double() - exact).abs() <= 2**-22 * magnitude).all()
    ), "not the fp32 sum of the payloads"


def test_e2m1_comparison_rounding_equals_exact_arithmetic():
    from horovod_gift.kernels.rounding import (
        E2M1,
        decode_e2m1_torch,
        encode_float_torch,
        round_e2m1_nearest_torch,
    )

    grid = torch.arange(-7.0, 7.0, 2.0**-6)  # every tie and every step, both signs
    v = torch.cat([grid, torch.tensor([0.0, -0.0, 1e-30, 6.0001, 1e30, -1e30])])
    codes, values = round_e2m1_nearest_torch(v)
    assert torch.equal(codes, encode_float_torch(v, E2M1))
    assert torch.equal(
        values.view(torch.int32), decode_e2m1_torch(codes).view(torch.int32)
    ), "values (or a zero's sign)"
