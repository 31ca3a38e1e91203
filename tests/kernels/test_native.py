"""The native CPU kernels (kernels/native.py) give the torch references' bits: every format,
rounding, block size, odd size, with and without error feedback, split across threads or not."""
import pytest
import torch

import horovod_gift as gift
from horovod_gift.codec import formats
from horovod_gift.kernels import native
from horovod_gift.codec.rotation import HadamardRotation

# FP8 blocks under 16 and from 16 up take different decoding loops (native_decode.py)
CODECS = [("nvfp4", None), ("int3", None), ("fp8_e4m3", None), ("fp8_e4m3", 32), ("fp8_e5m2", None),
          ("fp8_e5m2", 1), ("fp8_e4m3", 8), ("fp8_e5m2", 16), ("fp8_e5m2", 4096)]
SIZES = [1, 15, 17, 1000, 1024, 4128, 70_037]
TENSOR_SCALED = ("nvfp4", "int3")   # payloads with an fp32 tensor scale


def bits(t):
    return None if t is None else t.contiguous().view(torch.uint8)


def assert_same(reference, native_result, what):
    for name, a, b in zip(("codes", "scales", "tensor scale"), reference, native_result):
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what}: {name} differ"


def sample(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    specials = torch.tensor([0.0, -0.0, 1e-30, -3e-8, 448.0, 57344.0, 1e4, -6.0, -1e-40])
    x[: min(n, len(specials))] = specials[: min(n, len(specials))]
    if n > 200:
        x[64:128] = 0.0  # whole zero blocks
    return x


def both(fn):
    """fn() under the torch references and under the native kernels."""
    results = []
    for backend in ("torch", "native"):
        with gift.use_kernels(backend):
            results.append(fn())
    return results


@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("feedback", [False, True])
def test_quantize_equals_reference(fmt, block, n, stochastic, feedback):
    x = sample(n)
    residual0 = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2

    x_before = x.clone()

    def run():
        residual = residual0.clone() if feedback else None
        payload = formats.quantize(x, fmt, block, stochastic, seed=11, residual=residual)
        return payload, residual

    (ref, ref_residual), (got, got_residual) = both(run)
    assert torch.equal(bits(x), bits(x_before)), "the input was written"
    assert_same(ref, got, f"{fmt}/{block} n={n}")
    if feedback:
        assert torch.equal(bits(ref_residual), bits(got_residual)), "residuals differ"


@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("n", SIZES)
def test_decode_and_accumulate_equal_reference(fmt, block, n):
    with gift.use_kernels("torch"):
        payloads = [formats.quantize(sample(n, k) * (k + 1), fmt, block) for k in range(3)]
    codes = torch.stack([p[0] for p in payloads])
    scales = torch.stack([p[1] for p in payloads])
    tensor_scales = torch.cat([p[2] for p in payloads]) if fmt in TENSOR_SCALED else None
    sums = both(lambda: formats.accumulate(codes, scales, tensor_scales, n, fmt, block))
    assert torch.equal(bits(sums[0]), bits(sums[1])), "sums differ"
    decoded = both(lambda: formats.dequantize(*payloads[1], n, fmt, block))
    assert torch.equal(bits(decoded[0]), bits(decoded[1])), "decoded values differ"


def assert_native_alone_matches(monkeypatch, run, what):
    """run() -> (payload, residual or None): the same bits under the references and the native
    kernels, then natively with the reference disabled (finite input never falls back to it)."""
    (ref, ref_residual), (got, got_residual) = both(run)
    assert_same(ref, got, what)
    if ref_residual is not None:
        assert torch.equal(bits(ref_residual), bits(got_residual)), f"{what}: residuals differ"
    monkeypatch.setattr(formats.fused, "rotate_feedback_quantize_torch", None)
    with gift.use_kernels("native"):
        assert_same(ref, run()[0], f"{what}, in the native pass alone")


def payloads_of(fmt, block, n, k=3):
    """k payloads of n elements, as rows: codes, scales, tensor scales (None for FP8)."""
    with gift.use_kernels("torch"):
        payloads = [formats.quantize(sample(n, j) * (j + 1), fmt, block) for j in range(k)]
    codes = torch.stack([p[0] for p in payloads])
    scales = torch.stack([p[1] for p in payloads])
    return codes, scales, torch.cat([p[2] for p in payloads]) if fmt in TENSOR_SCALED else None


@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("n", [1, 17, 4128, 70_037])
@pytest.mark.parametrize("divisor,feedback,stochastic",
                         [(1, False, False), (3, True, False), (2, True, True), (4, False, True)])
def test_sum_quantize_equals_reference(monkeypatch, fmt, block, n, divisor, feedback,
                                       stochastic):
    """The owner's stage (sum, division, residual, quantization in the sum's pass natively) gives
    the bits of accumulate, div_ and quantize under the references, residual included."""
    codes, scales, tensor_scales = payloads_of(fmt, block, n)
    residual0 = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.1

    def run():
        residual = residual0.clone() if feedback else None
        out = torch.full((n,), float("nan"))
        payload = formats.sum_quantize(codes, scales, tensor_scales, n, fmt, block, divisor,
                                       stochastic, 5, residual, out)
        return payload, residual

    assert_native_alone_matches(monkeypatch, run, f"{fmt}/{block} n={n}")


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", 32),
                                       ("fp8_e5m2", None)])
def test_sum_quantize_of_nonfinite_follows_the_reference(fmt, block):
    """A residual holding inf makes the owner's input non-finite: the native pass leaves the
    residual as it was and the reference's rules decide, as under the torch backend."""
    n = 5000
    codes, scales, tensor_scales = payloads_of(fmt, block, n, k=2)

    def run():
        residual = torch.full((n,), 1e-3)
        residual[4321] = float("inf")
        payload = formats.sum_quantize(codes, scales, tensor_scales, n, fmt, block, 2, False, 0,
                                       residual, torch.empty(n))
        return payload, residual, formats.dequantize(*payload, n, fmt, block)

    (ref, ref_residual, ref_decoded), (got, got_residual, got_decoded) = both(run)
    assert_same(ref, got, fmt)
    assert torch.equal(bits(ref_residual), bits(got_residual)), "residuals differ"
    assert torch.equal(bits(ref_decoded), bits(got_decoded)), "decoded values differ"
    assert not torch.isfinite(got_decoded).all()


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", 32),
                                       ("fp8_e5m2", None)])
@pytest.mark.parametrize("rotation", [None, HadamardRotation(16, 1)])
def test_nonfinite_input_follows_the_reference(fmt, block, rotation):
    """A NaN reaches the torch reference untouched (the residual is not half-updated): the
    payload decodes to NaN as the reference's does, and so does the residual; with a rotation
    too (natively the residual is then added in the rotation's pass)."""
    n = 5000
    x = sample(n)
    x[777] = float("nan")

    def run():
        residual = torch.full((n,), 1e-3)
        payload = formats.quantize(x, fmt, block, residual=residual, rotation=rotation)
        return payload, residual, formats.dequantize(*payload, n, fmt, block)

    (ref, ref_residual, ref_decoded), (got, got_residual, got_decoded) = both(run)
    assert_same(ref, got, fmt)
    assert torch.equal(torch.isnan(ref_residual), torch.isnan(got_residual))
    assert torch.equal(torch.isnan(ref_decoded), torch.isnan(got_decoded))
    assert torch.isnan(got_decoded).any()


@pytest.mark.parametrize("block", [1, 2, 8, 16, 32, 64, 128, 2048, 4096])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotation_equals_reference_into_any_output(block, inverse):
    """Whole spans, contiguous blocks and a tail of every power of two below the block
    (n = 70_079); into a new tensor, a given one and in place."""
    n = 70_079
    x = sample(n, 3)
    with gift.use_kernels("torch"):
        expected = HadamardRotation(block, 9).apply(x, inverse)
    with gift.use_kernels("native"):
        into = torch.full((n,), float("nan"))
        in_place = x.clone()
        rotation = HadamardRotation(block, 9)
        results = {"new": rotation.apply(x, inverse),
                   "into": rotation.apply(x, inverse, out=into),
                   "in place": rotation.apply(in_place, inverse, out=in_place)}
    assert results["into"] is into and results["in place"] is in_place
    for name, result in results.items():
        assert torch.equal(bits(result), bits(expected)), f"{name}: differs from the reference"
    assert not torch.equal(expected, x)


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", None),
                                       ("fp8_e5m2", 32)])
@pytest.mark.parametrize("hadamard", [16, 128])
@pytest.mark.parametrize("n", [17, 4128, 70_079])
@pytest.mark.parametrize("feedback", [False, True])
def test_rotated_quantize_equals_reference(monkeypatch, fmt, block, hadamard, n, feedback):
    """quantize with a rotation (natively: the residual added and the amax found in the
    rotation's pass) gives the references' bits, residual included."""
    x = sample(n, 6)
    residual0 = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.1

    def run():
        residual = residual0.clone() if feedback else None
        payload = formats.quantize(x, fmt, block, True, 8, residual, HadamardRotation(hadamard, 4))
        return payload, residual

    assert_native_alone_matches(monkeypatch, run, f"{fmt}/{block} H{hadamard} n={n}")


@pytest.mark.parametrize("block", [1, 16, 128])
@pytest.mark.parametrize("threads", [1, 3])
def test_rotation_with_residual_gives_each_pieces_amax(monkeypatch, block, threads):
    """apply_folded: the rotation plus the residual, bit for bit, and each piece's largest
    magnitude, for pieces ending anywhere (mid-span, in the tail, one element long), across
    threads; a piece holding an inf or NaN reads as not finite, the others as before."""
    monkeypatch.setattr(native, "THREAD_MIN_ELEMENTS", 1 << 10)
    n = 70_079
    x, residual = sample(n, 7), torch.randn(n, generator=torch.Generator().manual_seed(4))
    ends = [1, 2, 32, 2048 * 3 + 5, 40_000, 69_999, 70_000, n]
    rotation = HadamardRotation(block, 5)
    with gift.use_kernels("torch"):
        expected = rotation.apply(x) + residual
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((n,), float("nan"))
        maxima = rotation.apply_folded(x, residual, ends, out)
        residual[40_010] = float("inf")
        poisoned = rotation.apply_folded(x, residual, ends, torch.empty(n))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(bits(out), bits(expected)), "the rotation plus the residual differs"
    starts = [0] + ends[:-1]
    largest = [expected[lo:hi].abs().max() for lo, hi in zip(starts, ends)]
    assert [native.magnitude_float(m) for m in maxima] == [float(v) for v in largest]
    assert poisoned[5] >= native.INF_BITS
    assert list(poisoned[:5]) + list(poisoned[6:]) == list(maxima[:5]) + list(maxima[6:])


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", 64)])
def test_threads_give_the_same_bits(monkeypatch, fmt, block):
    """A large tensor is split across threads at tile boundaries; the bits do not depend on it."""
    monkeypatch.setattr(native, "THREAD_MIN_ELEMENTS", 1 << 10)
    n = (1 << 16) + 37
    x = sample(n, 5)
    results = []
    for threads in (1, 3):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with gift.use_kernels("native"):
                residual = torch.full((n,), 1e-3)
                rotated = HadamardRotation(128, 2).apply(x)
                payload = formats.quantize(rotated, fmt, block, residual=residual)
                total = formats.accumulate(torch.stack([payload[0]] * 2),
                                           torch.stack([payload[1]] * 2),
                                           None if payload[2] is None else payload[2].repeat(2),
                                           n, fmt, block)
                # the rotation adds the residual and the quantizer reads its output alone
                folded_residual = torch.full((n,), 1e-3)
                folded = formats.quantize(x, fmt, block, residual=folded_residual,
                                          rotation=HadamardRotation(128, 2))
        finally:
            torch.set_num_threads(previous)
        results.append([bits(t) for t in (rotated, *payload[:2], residual, total, *folded[:2],
                                          folded_residual)])
    names = ("rotated", "codes", "scales", "residual", "sum", "folded codes", "folded scales",
             "folded residual")
    for name, one, three in zip(names, *results):
        assert torch.equal(one, three), f"{name}: 3 threads differ from 1"


@pytest.mark.parametrize("fmt", TENSOR_SCALED)
@pytest.mark.parametrize("n", [(1 << 12) + 8, (1 << 12) + 1])
def test_packed_codes_decode_from_payload_pieces_at_any_byte_offset(fmt, n):
    """A piece of a received payload starts at any byte and may end mid-byte (n odd) or
    mid-group (INT3)."""
    x = sample(n, 4)
    codes, scales, tensor_scale = formats.quantize(x, fmt)
    expected = formats.dequantize(codes, scales, tensor_scale, n, fmt)
    for offset in (1, 2, 3):
        payload = torch.zeros(codes.numel() + 8, dtype=torch.uint8)
        payload[offset:offset + codes.numel()] = codes
        payload[offset + codes.numel():] = 0xFF  # garbage past the piece must not leak in
        piece = payload[offset:offset + codes.numel()]
        decoded = formats.dequantize(piece, scales, tensor_scale, n, fmt)
        assert torch.equal(bits(decoded), bits(expected)), f"offset {offset}"


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", 32),
                                       ("fp8_e5m2", None)])
def test_decode_and_sum_into_a_slice_write_only_that_slice(backend, fmt, block):
    """The collective decodes each received piece straight into its place in the result, and sums
    into a reused buffer."""
    n = (1 << 13) + 37
    x = sample(n, 6)
    with gift.use_kernels(backend):
        payload = formats.quantize(x, fmt, block)
        expected = formats.dequantize(*payload, n, fmt, block)
        result = torch.full((n + 200,), float("nan"))
        returned = formats.dequantize(*payload, n, fmt, block, out=result[100:100 + n])
        assert returned.data_ptr() == result[100:].data_ptr()
        assert torch.equal(bits(result[100:100 + n]), bits(expected))
        assert torch.isnan(result[:100]).all() and torch.isnan(result[100 + n:]).all()
        args = (payload[0][None], payload[1][None], payload[2], n, fmt, block)
        total = formats.accumulate(*args)
        returned = formats.accumulate(*args, out=result[100:100 + n])
        assert returned.data_ptr() == result[100:].data_ptr()
        assert torch.equal(bits(result[100:100 + n]), bits(total))
        assert torch.isnan(result[:100]).all() and torch.isnan(result[100 + n:]).all()
        with pytest.raises(ValueError, match=f"contiguous float32 tensor of {n} elements"):
            formats.dequantize(*payload, n, fmt, block, out=result[:n + 1])
        with pytest.raises(ValueError, match="accumulate: out must be a contiguous float32"):
            formats.accumulate(*args, out=result[:n - 1])


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", None),
                                       ("fp8_e5m2", 32)])
def test_pieces_encoded_from_the_folded_rotation_equal_the_plain_path(fmt, block):
    """BucketReduction's stage 1 under a folded rotation: each piece of u + r1, encoded with its
    maximum (Codec.encode(folded_bits=...)), gives the payload and new residual of encoding the
    piece of u with its piece of r1; a piece holding a NaN included."""
    from horovod_gift.codec.tensor_codec import Codec

    n = 70_079
    x = sample(n, 8)
    x[50_123] = float("nan")
    residual = torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.1
    ends = [37, 2048 * 3 + 5, 50_000, 69_999, n]
    rotation, codec = HadamardRotation(128, 2), Codec(fmt, block)
    with gift.use_kernels("native"):
        u = rotation.apply(x)
        folded_residual = residual.clone()
        y = torch.empty(n)
        maxima = rotation.apply_folded(x, folded_residual, ends, y)
        for k, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
            plain_residual = residual[lo:hi].clone()
            expected = codec.encode(u[lo:hi], plain_residual, seed=k)
            got = codec.encode(y[lo:hi], folded_residual[lo:hi], seed=k,
                               folded_bits=int(maxima[k]))
            assert torch.equal(got, expected), f"piece {k}: payloads differ"
            assert torch.equal(bits(folded_residual[lo:hi]), bits(plain_residual)), \
                f"piece {k}: residuals differ"
    assert maxima[3] >= native.INF_BITS
