"""encode / decode: one tensor to FP8, NVFP4 or INT3 and back.

    enc = encode(x, format="nvfp4")      # "int3"; "fp8_e4m3" / "fp8_e5m2", block_size=None | 2**k
    y = decode(enc)                      # x's shape and dtype; enc.nbytes is its size on the wire

Values are computed in fp32. Non-finite input never becomes finite output: the whole tensor
decodes to NaN (so loss scalers see it), or encode raises with nonfinite="raise".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from horovod_gift.kernels import fp8, fused, int3, native, nvfp4
from horovod_gift.kernels.hadamard import LANES

from .backend import check_codec, runs_native, runs_triton
from .rotation import HadamardRotation
from .workspaces import workspace


@dataclass(frozen=True)
class Encoded:
    """A quantized tensor. codes: uint8 (two NVFP4 codes a byte, 8 INT3 codes in 3); scales: fp32
    per block or per tensor for FP8, E4M3 codes per 16-block for NVFP4 and per 32-block for INT3;
    tensor_scale: NVFP4's and INT3's fp32 tensor scale."""

    format: str
    shape: torch.Size
    dtype: torch.dtype
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: Optional[torch.Tensor]
    block_size: Optional[int]

    @property
    def numel(self):
        return self.shape.numel()

    @property
    def nbytes(self):
        """Bytes on the wire: codes and every scale."""
        return sum(payload_layout(self.format, self.block_size, self.numel))

    @property
    def bits_per_element(self):
        return 8.0 * self.nbytes / max(1, self.numel)


def payload_layout(format, block_size, m):
    """Byte sizes (codes, scales, tensor scale) of m elements quantized to format: NVFP4 packs two
    codes a byte with one E4M3 scale byte per 16 elements and an fp32 tensor scale (4.5 bits an
    element and 32 a tensor); INT3 packs 8 3-bit codes in 3 bytes (3 * ceil(m / 8), the last group
    zero-padded) with one E4M3 scale byte per 32 elements and an fp32 tensor scale (3.25 bits an
    element and 32 a tensor); FP8 has a code byte an element and an fp32 scale per block (one per
    tensor when block_size is None)."""
    if format == "nvfp4":
        return (m + 1) // 2, -(-m // 16), 4
    if format == "int3":
        return int3.packed_bytes(m), -(-m // int3.BLOCK), 4
    return m, 4 * (1 if block_size is None else -(-m // block_size)), 0


def _flat_fp32(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


# The fused kernel holds a rotation's span in one tile; past this size it rotates in a pass of its
# own.
FUSED_SPAN_MAX = 1 << 15


def quantize(flat, format, block_size=None, stochastic=False, seed=0, residual=None, rotation=None,
             payload=None):
    """The codec's one entry point on flat fp32 data: optional rotation (a HadamardRotation),
    optional error-feedback residual (fp32, updated in place), then quantization. Returns (codes,
    scales, tensor_scale). payload: a uint8 tensor of payload_layout's bytes where the native
    kernels write the codes (and NVFP4's or INT3's scale codes), returned as views of it; the other
    scales, and every part on the other paths, are separate tensors (Codec copies them in)."""
    if rotation is not None and not isinstance(rotation, HadamardRotation):
        raise TypeError(f"quantize: rotation must be a HadamardRotation or None, "
                        f"got {type(rotation).__name__}")
    if runs_triton(flat):
        span = LANES * rotation.block_size if rotation is not None else 1
        if flat.numel() % span or span > FUSED_SPAN_MAX:
            flat, rotation = rotation.apply(flat), None
        fused_rotation = None if rotation is None else (rotation.block_size, rotation.seed)
        return fused.rotate_feedback_quantize_triton(
            flat, residual, format, block_size, fused_rotation, seed, stochastic
        )
    if rotation is not None:
        # quantization only reads the rotated copy: a per-thread buffer spares the page faults
        rotated = workspace(flat.numel(), flat.device, "rotated")
        if runs_native(flat) and residual is not None and flat.numel():
            bits = rotation.apply_folded(flat, residual, [flat.numel()], rotated)
            return quantize_folded(rotated, int(bits[0]), residual, format, block_size,
                                   stochastic, seed, payload)
        flat = rotation.apply(flat, out=rotated)
    if runs_native(flat):
        result = native.quantize_native(flat, residual, format, block_size, seed, stochastic,
                                        payload=payload)
        if result is not None:
            return result
    # the reference: the torch path, and the native path's non-finite input (the NaN rules)
    return fused.rotate_feedback_quantize_torch(flat, residual, format, block_size, None, seed,
                                                stochastic)


def dequantize(codes, scales, tensor_scale, n, format, block_size=None, out=None):
    """Flat fp32 values of n quantized elements, written into out (a contiguous fp32 tensor of n
    elements, e.g. a slice of the result) if given: a fresh tensor of over 32 MB costs a page fault
    per 4 KB on CPU, and a copy out of it another pass over memory."""
    _check_out(out, n, codes.device, "dequantize")
    if runs_triton(codes):
        if format == "nvfp4":
            return nvfp4.nvfp4_decode_triton(codes, scales, tensor_scale, n, out)
        if format == "int3":
            return int3.int3_decode_triton(codes, scales, tensor_scale, n, out)
        return fp8.fp8_decode_triton(codes, scales, fp8.FORMATS[format], block_size, out)
    if runs_native(codes):
        out = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out
        native.accumulate_native(codes[None], scales.reshape(1, -1), _row(tensor_scale), n,
                                 format, block_size, out, from_zero=False)
        return out
    return fused.decode_torch(codes, scales, tensor_scale, n, format, block_size, out=out)


def _row(tensor_scale):
    return None if tensor_scale is None else tensor_scale.reshape(-1)


def _check_out(out, n, device, what):
    if out is not None and (
        out.dtype != torch.float32
        or out.numel() != n
        or not out.is_contiguous()
        or out.device != device
    ):
        raise ValueError(
            f"{what}: out must be a contiguous float32 tensor of {n} elements on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def encode(x: torch.Tensor, format: str = "nvfp4", block_size: Optional[int] = None,
           rounding: str = "nearest", seed: int = 0, nonfinite: str = "nan",
           name: str = "tensor") -> Encoded:
    """Quantize x. rounding: "nearest" (to even) or "stochastic" (seeded, unbiased).
    nonfinite: "nan" (the tensor decodes to NaN) or "raise"."""
    check_codec(format, block_size, rounding)
    if nonfinite not in ("nan", "raise"):
        raise ValueError(f"encode: nonfinite must be 'nan' or 'raise', got {nonfinite!r}")
    flat = _flat_fp32(x, name)
    if nonfinite == "raise" and flat.numel() and not torch.isfinite(flat).all():
        bad = int((~torch.isfinite(flat)).sum())
        raise ValueError(f"{name}: {bad} of {flat.numel()} elements are NaN or infinite")
    codes, scales, tensor_scale = quantize(flat, format, block_size, rounding == "stochastic", seed)
    if (
        format in fp8.FORMATS
        and block_size is not None
        and scales.numel()
        and not torch.isfinite(scales).all()
    ):
        scales = torch.full_like(
            scales, float("nan")
        )  # one non-finite block poisons the whole tensor
    return Encoded(format, x.shape, x.dtype, codes, scales, tensor_scale, block_size)


def decode(enc: Encoded) -> torch.Tensor:
    """The tensor enc stands for, in its original shape and dtype."""
    values = dequantize(
        enc.codes, enc.scales, enc.tensor_scale, enc.numel, enc.format, enc.block_size
    )
    return values.view(enc.shape).to(enc.dtype)


def accumulate(codes, scales, tensor_scales, n, format, block_size=None, out=None):
    """fp32 sum, in order, of k payloads of n elements each: codes (k, bytes), scales (k, ...);
    into out if given, as in dequantize."""
    _check_out(out, n, codes.device, "accumulate")
    if runs_triton(codes):
        return fused.accumulate_triton(codes, scales, tensor_scales, n, format, block_size, out)
    if runs_native(codes):
        out = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out
        native.accumulate_native(codes, scales, tensor_scales, n, format, block_size, out,
                                 from_zero=True)
        return out
    return fused.accumulate_torch(codes, scales, tensor_scales, n, format, block_size, out=out)


def sum_quantize(codes, scales, tensor_scales, n, format, block_size, divisor, stochastic, seed,
                 residual, out, payload=None):
    """quantize(accumulate(payloads) / divisor, ..., residual (fp32), payload=payload): the owner's
    stage of the reduction, with out (n fp32 elements, or None) as the sum's workspace; divisor 1
    for a sum. On CPU the division, the residual's addition and the amax run in the sum's pass (two
    passes over memory fewer, and the quantizer reads one array instead of two)."""
    _check_out(out, n, codes.device, "sum_quantize")
    if runs_native(codes) and n:
        out = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out
        bits = native.accumulate_native(codes, scales, tensor_scales, n, format, block_size, out,
                                        True, "divide" if residual is None else "fold",
                                        residual, divisor)
        return quantize_folded(out, bits, residual, format, block_size, stochastic, seed,
                               payload)
    total = accumulate(codes, scales, tensor_scales, n, format, block_size, out)
    if divisor != 1:
        total.div_(divisor)
    return quantize(total, format, block_size, stochastic, seed, residual, payload=payload)


def quantize_folded(y, bits, residual, format, block_size=None, stochastic=False, seed=0,
                    payload=None):
    """quantize(x, ..., residual (fp32)) where y = x + residual (y = x without a residual) was
    summed by the native pass that made y, which also found bits, y's largest magnitude_bits;
    the residual is only written. Non-finite y (bits >= INF_BITS) goes to the reference with a
    residual of -0.0 (x + -0.0 is x, bit for bit), whose update becomes the residual: the same
    bits as quantize (payload as in quantize)."""
    if bits < native.INF_BITS:
        return native.quantize_native(y, residual, format, block_size, seed, stochastic,
                                      native.magnitude_float(bits), payload)
    negative_zero = None if residual is None else torch.full_like(y, -0.0)
    result = fused.rotate_feedback_quantize_torch(y, negative_zero, format, block_size, None,
                                                  seed, stochastic)
    if residual is not None:
        residual.copy_(negative_zero)
    return result
