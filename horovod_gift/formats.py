"""encode / decode: one tensor to FP8 or NVFP4 and back.

    enc = encode(x, format="nvfp4")      # or "fp8_e4m3" / "fp8_e5m2", block_size=None | 2**k
    y = decode(enc)                      # x's shape and dtype; enc.nbytes is its size on the wire

Values are computed in fp32. Non-finite input never becomes finite output: the whole tensor
decodes to NaN (so loss scalers see it), or encode raises with nonfinite="raise".
"""
from dataclasses import dataclass
from typing import Optional

import torch

from horovod_gift.kernels import fp8, fused, nvfp4
from horovod_gift.kernels.hadamard import hadamard_torch, hadamard_triton

from .config import check_codec, runs_triton


@dataclass(frozen=True)
class Encoded:
    """A quantized tensor. codes: uint8 (two NVFP4 codes a byte); scales: fp32 per block or per
    tensor for FP8, E4M3 codes per 16-block for NVFP4; tensor_scale: NVFP4's fp32 tensor scale."""
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
        extra = 0 if self.tensor_scale is None else self.tensor_scale.numel() * 4
        return self.codes.numel() + self.scales.numel() * self.scales.element_size() + extra

    @property
    def bits_per_element(self):
        return 8.0 * self.nbytes / max(1, self.numel)


def _flat_fp32(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def quantize(flat, format, block_size=None, stochastic=False, seed=0, residual=None, rotation=None):
    """The codec's one entry point on flat fp32 data: optional rotation (block, seed), optional
    error-feedback residual (updated in place), then quantization. Returns (codes, scales, tensor_scale)."""
    triton_path = runs_triton(flat)
    if rotation is not None and flat.numel() % rotation[0]:
        flat = (hadamard_triton if triton_path else hadamard_torch)(flat, rotation[0], rotation[1])
        rotation = None
    impl = fused.rotate_feedback_quantize_triton if triton_path else fused.rotate_feedback_quantize_torch
    return impl(flat, residual, format, block_size, rotation, seed, stochastic)


def dequantize(codes, scales, tensor_scale, n, format, block_size=None):
    """Flat fp32 values of n quantized elements."""
    if not runs_triton(codes):
        return fused.decode_torch(codes, scales, tensor_scale, n, format, block_size)
    if format == "nvfp4":
        return nvfp4.nvfp4_decode_triton(codes, scales, tensor_scale, n)
    return fp8.fp8_decode_triton(codes, scales, fp8.FORMATS[format], block_size)


def encode(x, format="nvfp4", block_size=None, rounding="nearest", seed=0, nonfinite="nan", name="tensor"):
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
    if format != "nvfp4" and block_size is not None and scales.numel() and not torch.isfinite(scales).all():
        scales = torch.full_like(scales, float("nan"))   # one non-finite block poisons the whole tensor
    return Encoded(format, x.shape, x.dtype, codes, scales, tensor_scale, block_size)


def decode(enc: Encoded):
    """The tensor enc stands for, in its original shape and dtype."""
    values = dequantize(enc.codes, enc.scales, enc.tensor_scale, enc.numel, enc.format, enc.block_size)
    return values.view(enc.shape).to(enc.dtype)
