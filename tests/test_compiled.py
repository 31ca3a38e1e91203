"""The CPU fast path (torch.compile of the torch references) gives the same bits as eager torch."""
import pytest
import torch

import horovod_gift as gift
from horovod_gift import formats


@pytest.fixture
def compiled_path(monkeypatch):
    monkeypatch.setattr(formats, "COMPILE", True)
    monkeypatch.setattr(formats, "COMPILE_MIN_ELEMENTS", 1 << 12)


@pytest.mark.parametrize("fmt,block,rotation,n", [("nvfp4", None, (128, 5), 70_037), ("fp8_e4m3", None, None, 70_037),
                                                  ("fp8_e5m2", 32, (16, 1), 70_037), ("nvfp4", None, (1024, 2), 70_037),
                                                  ("nvfp4", None, None, 70_016), ("nvfp4", None, (128, 5), 1 << 16)])
def test_compiled_equals_eager(compiled_path, fmt, block, rotation, n):
    """n = 70_037: a rotation tail and a partial block; whole NVFP4 blocks take the (blocks, 16) path."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[:3] = torch.tensor([0.0, 1e-30, -5e3])
    x[64:96] = 0.0                                       # all-zero blocks
    results = []
    for use_compiled in (False, True):
        formats.COMPILE = use_compiled
        residual = torch.full((n,), 1e-3)
        codes, scales, tensor_scale = formats.quantize(x, fmt, block, residual=residual, rotation=rotation)
        decoded = formats.dequantize(codes, scales, tensor_scale, n, fmt, block)
        results.append([codes, scales.view(torch.uint8), residual, decoded])
    for name, eager, compiled in zip(("codes", "scales", "residual", "decoded"), *results):
        assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8)), f"{name} differ"


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("fp8_e4m3", 32), ("fp8_e5m2", None)])
@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 17])
def test_compiled_accumulate_and_nonfinite_equal_eager(compiled_path, fmt, block, n):
    payloads = []
    for k in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(k))
        if k == 1:
            x[100] = float("nan")                        # a non-finite block (FP8 per block) or tensor
        payloads.append(formats.quantize(x, fmt, block))
    codes = torch.stack([p[0] for p in payloads])
    scales = torch.stack([p[1] for p in payloads])
    tensor_scales = torch.cat([p[2] for p in payloads]) if fmt == "nvfp4" else None
    results = []
    for use_compiled in (False, True):
        formats.COMPILE = use_compiled
        results.append(formats.accumulate(codes, scales, tensor_scales, n, fmt, block))
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    assert torch.isnan(results[1]).any() and torch.isfinite(results[1]).any() == (block is not None)


@pytest.mark.parametrize("path", ["eager", "compiled", "triton"])
@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("fp8_e4m3", 32), ("fp8_e5m2", None)])
def test_accumulate_into_a_buffer_gives_the_same_sum(compiled_path, path, fmt, block):
    """The collective sums each piece's payloads into a reused buffer: the same bits as into a new tensor."""
    n = (1 << 13) + 37 if path == "triton" else (1 << 16) + 37
    formats.COMPILE = path == "compiled"
    with gift.use_kernels("triton" if path == "triton" else "torch"):
        payloads = [formats.quantize(torch.randn(n, generator=torch.Generator().manual_seed(k)), fmt, block)
                    for k in range(3)]
        args = (torch.stack([p[0] for p in payloads]), torch.stack([p[1] for p in payloads]),
                torch.cat([p[2] for p in payloads]) if fmt == "nvfp4" else None, n, fmt, block)
        expected = formats.accumulate(*args)
        buffer = torch.full((n + 100,), float("nan"))
        assert formats.accumulate(*args, out=buffer[:n]).data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:n].view(torch.int32), expected.view(torch.int32))
        assert torch.isnan(buffer[n:]).all(), "wrote past its buffer"
        with pytest.raises(ValueError, match=f"accumulate: out must be a contiguous float32 tensor of {n} elements"):
            formats.accumulate(*args, out=buffer[:n - 1])


@pytest.mark.parametrize("block,inverse", [(128, False), (128, True), (16, True), (1 << 12, False)])
def test_chunked_rotation_equals_eager_into_any_output(compiled_path, monkeypatch, block, inverse):
    monkeypatch.setattr(formats, "ROTATE_CHUNK", 1 << 14)  # several chunks, a short last one and a tail
    n = 70_000 + 37
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    formats.COMPILE = False
    expected = formats.rotate(x, (block, 9), inverse)
    formats.COMPILE = True
    into = torch.full((n,), float("nan"))
    in_place = x.clone()
    results = {"new": formats.rotate(x, (block, 9), inverse), "into": formats.rotate(x, (block, 9), inverse, out=into),
               "in place": formats.rotate(in_place, (block, 9), inverse, out=in_place)}
    assert results["into"] is into and results["in place"] is in_place
    for name, result in results.items():
        assert torch.equal(result.view(torch.int32), expected.view(torch.int32)), f"{name}: differs from eager"
    assert not torch.equal(expected, x)


@pytest.mark.parametrize("use_compiled", [False, True])
@pytest.mark.parametrize("n", [(1 << 16) + 8, (1 << 16) + 1])
def test_nvfp4_decodes_payload_pieces_at_any_byte_offset(compiled_path, use_compiled, n):
    """Packed codes are read as 4-byte words; a piece of a received payload may start at any byte
    (n + 8: whole words, so only the start is misaligned) and end mid-word (n + 1: an odd code count)."""
    formats.COMPILE = use_compiled
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    codes, scales, tensor_scale = formats.quantize(x, "nvfp4")
    expected = formats.dequantize(codes, scales, tensor_scale, n, "nvfp4")
    for offset in (1, 2, 3):
        payload = torch.zeros(codes.numel() + 8, dtype=torch.uint8)
        payload[offset:offset + codes.numel()] = codes
        payload[offset + codes.numel():] = 0xFF            # garbage past the piece must not leak in
        piece = payload[offset:offset + codes.numel()]
        decoded = formats.dequantize(piece, scales, tensor_scale, n, "nvfp4")
        assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32)), f"offset {offset}"


@pytest.mark.parametrize("path", ["eager", "compiled", "triton"])
@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("fp8_e4m3", 32), ("fp8_e5m2", None)])
def test_decode_into_a_slice_writes_only_that_slice(compiled_path, path, fmt, block):
    """The collective decodes each received piece straight into its place in the result."""
    n = (1 << 13) + 37 if path == "triton" else (1 << 16) + 37
    formats.COMPILE = path == "compiled"
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    with gift.use_kernels("triton" if path == "triton" else "torch"):
        payload = formats.quantize(x, fmt, block)
        expected = formats.dequantize(*payload, n, fmt, block)
        result = torch.full((n + 200,), float("nan"))
        returned = formats.dequantize(*payload, n, fmt, block, out=result[100:100 + n])
        assert returned.data_ptr() == result[100:].data_ptr()
        assert torch.equal(result[100:100 + n].view(torch.int32), expected.view(torch.int32))
        assert torch.isnan(result[:100]).all() and torch.isnan(result[100 + n:]).all(), "wrote outside its slice"
        with pytest.raises(ValueError, match=f"contiguous float32 tensor of {n} elements"):
            formats.dequantize(*payload, n, fmt, block, out=result[:n + 1])
        with pytest.raises(ValueError, match="contiguous float32"):
            formats.dequantize(*payload, n, fmt, block, out=torch.empty(n, dtype=torch.float64))


def test_rotation_graphs_are_cached_across_processes(compiled_path):
    """A graph that AOTAutograd refuses to cache on disk is traced again by every process that runs it
    (~3 s a rotation graph on 2 cores): the rotation's normalizer, traced as a numpy call, did that."""
    from torch._dynamo.utils import counters
    counters["aot_autograd"].clear()
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(8))
    formats.rotate(x, (256, 3), out=torch.empty_like(x))          # a block size no other test compiles
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_hit"] + aot["autograd_cache_miss"] == 1, dict(aot)
    assert aot["autograd_cache_bypass"] == 0, dict(aot)
