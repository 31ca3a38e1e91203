"""encode / decode: one tensor to FP8 or NVFP4 and back.

    enc = encode(x, format="nvfp4")      # or "fp8_e4m3" / "fp8_e5m2", block_size=None | 2**k
    y = decode(enc)                      # x's shape and dtype; enc.nbytes is its size on the wire

Values are computed in fp32. Non-finite input never becomes finite output: the whole tensor
decodes to NaN (so loss scalers see it), or encode raises with nonfinite="raise".
"""

import functools
import os
import threading
import types
from dataclasses import dataclass
from typing import Optional

import torch

from horovod_gift.kernels import fp8, fused, nvfp4
from horovod_gift.kernels.hadamard import (
    LANES,
    hadamard_blocks_torch,
    hadamard_torch,
    hadamard_triton,
    random_signs_torch,
)
from horovod_gift.kernels.rounding import eager

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


# On CPU tensors of at least this many elements the torch path runs under torch.compile, whose
# Inductor backend fuses it into vectorized C++ (5-10x faster than eager). The first call of each
# variant compiles (seconds; cached on disk); HOROVOD_GIFT_COMPILE=0 turns it off.
COMPILE_MIN_ELEMENTS = 1 << 16
COMPILE = os.environ.get("HOROVOD_GIFT_COMPILE", "1") != "0"


@functools.cache
def compiled(fn, *constants):
    """fn(*tensors, *constants) under torch.compile, one graph per set of constants. The constants
    are closed over and the tensors' sizes marked dynamic: Inductor then sees block sizes as fixed
    and vectorizes over them (with dynamic=True they become symbolic and the code runs 7x
    slower)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)

    def run(*tensors):
        return fn(*tensors, *constants)

    # A code object of its own per graph: Dynamo keeps what it learned about dynamic values per code
    # object (and name), and a block size seen to change across graphs would turn symbolic.
    name = f"{fn.__name__}_{'_'.join(map(str, constants))}".replace(".", "_").replace(" ", "")
    run = types.FunctionType(
        run.__code__.replace(co_name=name, co_qualname=name),
        run.__globals__,
        name,
        None,
        run.__closure__,
    )
    graph = torch.compile(run)

    def call(*tensors):
        for t in (
            tensors
        ):  # sizes vary by tensor and bucket; small dims (ranks, scales, a block's 16) stay fixed
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] > 64:
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)
            elif (
                isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] > 64
            ):  # (blocks, 16) rows
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return graph(*tensors)

    return call


def run_compiled(fn, tensors, constants=()):
    """The stage runner of the torch references (kernels/*: `run`) for large CPU tensors."""
    return compiled(fn, *constants)(*tensors)


def _runner(n, stochastic):
    # stochastic rounding needs bit casts that Inductor's CPU vectorizer gets wrong: it stays eager
    return run_compiled if COMPILE and n >= COMPILE_MIN_ELEMENTS and not stochastic else eager


@functools.lru_cache(maxsize=64)
def random_signs(seed, n, device):
    """The rotation's signs, kept per size (every step rotates the same tensors): the integer hash
    is slow in eager torch, and Inductor's CPU vectorizer mistypes its shifts, so compiled code
    takes them as an input."""
    return random_signs_torch(seed, 0, n, device)


# The compiled rotation runs on chunks of this many elements (a multiple of every span): the
# intermediates of one chunk stay in cache and come from the heap, where glibc maps and unmaps a
# buffer the size of a large tensor on every call and faults in each of its pages (1e7 elements,
# block 128: 44-60 ms a rotation whole, 20-27 ms in chunks of 2**20 into an existing tensor).
ROTATE_CHUNK = 1 << 20


def rotate(flat, rotation, inverse=False, out=None):
    """The randomized Hadamard rotation (block, seed) of flat fp32 data, into out (a new tensor if
    None; flat itself rotates it in place)."""
    block, seed = rotation
    if runs_triton(flat):
        return hadamard_triton(flat, block, seed, inverse, out)
    signs = random_signs(seed, flat.numel(), flat.device)
    if not (COMPILE and flat.numel() >= COMPILE_MIN_ELEMENTS):
        result = hadamard_torch(flat, block, seed, inverse, signs)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(flat) if out is None else out
    spans = flat.numel() // (LANES * block) * (LANES * block)
    chunk = max(ROTATE_CHUNK, LANES * block)
    for start in range(0, spans, chunk):
        part = slice(start, min(spans, start + chunk))
        if out is flat:
            compiled(_rotate_in_place, block, inverse)(*_spans((flat, signs), part, block))
        else:
            compiled(_rotate_into, block, inverse)(*_spans((flat, signs, out), part, block))
    if spans < flat.numel():  # the remainder, shorter than a span: a few small ops
        out[spans:] = hadamard_torch(flat[spans:], block, seed, inverse, signs[spans:])
    return out


def _spans(tensors, part, block):
    """(spans, block, LANES) views of part of each tensor, only the number of spans dynamic: given
    flat tensors, Inductor cannot prove that the lanes of a span number LANES and loops over
    them."""
    views = [t[part].view(-1, block, LANES) for t in tensors]
    for view in views:
        torch._dynamo.maybe_mark_dynamic(view, 0)
    return views


def _rotate_into(x, signs, out, block, inverse):
    out.copy_(hadamard_blocks_torch(x, signs, block, inverse))


def _rotate_in_place(x, signs, block, inverse):
    # its own graph rather than _rotate_into with out=x: graph inputs that alias each other make
    # Dynamo guard on, and compile for, that aliasing
    x.copy_(hadamard_blocks_torch(x, signs, block, inverse))


_workspaces = threading.local()


def workspace(n, device, purpose):
    """A buffer of n fp32 elements for a temporary, kept per thread, device and purpose (one user
    at a time each) at the largest size asked for: a fresh buffer of over 32 MB is mapped anew by
    glibc on every call and costs a page fault per 4 KB (a rotated 1e7-element tensor: 45-50 ms
    into a new tensor, 20-22 ms into this one)."""
    buffers = _workspaces.__dict__.setdefault("buffers", {})
    buffer = buffers.get((device, purpose))
    if buffer is None or buffer.numel() < n:
        buffer = buffers[device, purpose] = torch.empty(n, dtype=torch.float32, device=device)
    return buffer[:n]


# The fused kernel holds a rotation's span in one tile; past this size it rotates in a pass of its
# own.
FUSED_SPAN_MAX = 1 << 15


def quantize(flat, format, block_size=None, stochastic=False, seed=0, residual=None, rotation=None):
    """The codec's one entry point on flat fp32 data: optional rotation (block, seed), optional
    error-feedback residual (updated in place), then quantization. Returns (codes, scales,
    tensor_scale)."""
    if runs_triton(flat):
        span = LANES * rotation[0] if rotation is not None else 1
        if flat.numel() % span or span > FUSED_SPAN_MAX:
            flat, rotation = rotate(flat, rotation), None
        return fused.rotate_feedback_quantize_triton(
            flat, residual, format, block_size, rotation, seed, stochastic
        )
    if rotation is not None:
        flat = rotate(flat, rotation, out=workspace(flat.numel(), flat.device, "rotation"))
    seed = seed if stochastic else 0  # unused by nearest rounding: one compiled graph for all seeds
    return fused.rotate_feedback_quantize_torch(
        flat,
        residual,
        format,
        block_size,
        None,
        seed,
        stochastic,
        run=_runner(flat.numel(), stochastic),
    )


def dequantize(codes, scales, tensor_scale, n, format, block_size=None, out=None):
    """Flat fp32 values of n quantized elements, written into out (a contiguous fp32 tensor of n
    elements, e.g. a slice of the result) if given: a fresh tensor of over 32 MB costs a page fault
    per 4 KB on CPU, and a copy out of it another pass over memory."""
    _check_out(out, n, codes.device, "dequantize")
    if not runs_triton(codes):
        return fused.decode_torch(
            codes, scales, tensor_scale, n, format, block_size, run=_runner(n, False), out=out
        )
    if format == "nvfp4":
        return nvfp4.nvfp4_decode_triton(codes, scales, tensor_scale, n, out)
    return fp8.fp8_decode_triton(codes, scales, fp8.FORMATS[format], block_size, out)


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


def encode(
    x, format="nvfp4", block_size=None, rounding="nearest", seed=0, nonfinite="nan", name="tensor"
):
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
        format != "nvfp4"
        and block_size is not None
        and scales.numel()
        and not torch.isfinite(scales).all()
    ):
        scales = torch.full_like(
            scales, float("nan")
        )  # one non-finite block poisons the whole tensor
    return Encoded(format, x.shape, x.dtype, codes, scales, tensor_scale, block_size)


def decode(enc: Encoded):
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
    return fused.accumulate_torch(
        codes, scales, tensor_scales, n, format, block_size, run=_runner(n, False), out=out
    )
