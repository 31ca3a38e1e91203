"""The two kernels of the quantized collective, with their references.

rotate_feedback_quantize: one pass over memory per rank and stage,
    y = rotate(x) + r;   codes = Q(y);   r <- y - dequantize(codes)
(rotation and error feedback optional). Formats with a tensor scale (NVFP4, INT3, FP8 per tensor)
need
amax(y) first: the same kernel runs once in AMAX_ONLY mode, writing one partial amax per program.

accumulate: sum of k payloads of one format decoded to fp32, added in rank order 0..k-1, so the
owner of a chunk gets the same bits whichever device it runs on.
"""
import torch
import triton
import triton.language as tl

from .fp8 import (FORMATS, fp8_decode_tile, fp8_decode_torch, fp8_encode_torch, fp8_quantize_tile,
                  fp8_store_tile, tile_shape)
from .hadamard import LANES, hadamard_tile, hadamard_torch, normalizer, random_signs
from .int3 import BLOCK as INT3_BLOCK
from .int3 import (int3_decode_tile, int3_decode_torch, int3_quantize_blocks_torch,
                   int3_quantize_tile, int3_store_tile, int3_tensor_scale_torch, int3_values_torch,
                   pack_int3_torch, packed_bytes, unpack_int3_torch)
from .nvfp4 import BLOCK as NVFP4_BLOCK
from .nvfp4 import (nvfp4_decode_tile, nvfp4_decode_torch, nvfp4_quantize_blocks_torch,
                    nvfp4_quantize_tile, nvfp4_store_tile, nvfp4_tensor_scale_torch,
                    nvfp4_values_torch, pack_codes_torch, unpack_codes_torch)
from .rounding import EXACT_ARITHMETIC, blocks_torch, is_nonfinite, tensor_scale_torch


@triton.jit
def amax_or_inf(y):
    """The largest |value| of a 2D tile (an AMAX_ONLY pass's partial amax), inf where a value is
    not finite."""
    amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
    bad = tl.max(tl.max(is_nonfinite(y).to(tl.int32), axis=1), axis=0)
    return tl.where(bad > 0, float("inf"), amax)


@triton.jit
def rotate_feedback_quantize_kernel(
    x_ptr,              # flat fp32 input, n elements
    residual_ptr,       # flat fp32 error-feedback residual, read and rewritten (FEEDBACK)
    codes_ptr,          # out: uint8 codes (FP8: one a byte; NVFP4: two a byte; INT3: 8 in 3)
    scales_ptr,         # out: per-block scales (FP8 fp32, else E4M3 codes), unless PER_TENSOR FP8
    tensor_scale_ptr,   # in: the tensor's scale (PER_TENSOR, NVFP4, INT3), from AMAX_ONLY
    amax_ptr,           # out (AMAX_ONLY): one amax per program, inf where a value is not finite
    n,                  # elements
    seed,               # stochastic rounding's seed
    rotation_seed,      # the rotation's sign seed (ROTATE)
    norm,               # 1 / sqrt(HB): the rotation's scale
    AMAX_ONLY: tl.constexpr,    # first pass: only the amax of rotate(x) + r
    ROTATE: tl.constexpr,       # apply the randomized Hadamard rotation first
    FEEDBACK: tl.constexpr,     # add the residual, store the new error
    NVFP4: tl.constexpr,        # NVFP4
    INT3: tl.constexpr,         # INT3 (neither: FP8)
    PER_TENSOR: tl.constexpr,   # FP8 with one scale for the tensor
    ROWS: tl.constexpr,         # spans per program
    HB: tl.constexpr,           # rotation block (elements one Hadamard transform mixes)
    LOG2_HB: tl.constexpr,      # log2(HB): butterfly stages
    LANES: tl.constexpr,        # rotation blocks interleaved in a span (1 without rotation)
    QBLOCK: tl.constexpr,       # scale block (16 for NVFP4, 32 for INT3)
    EBITS: tl.constexpr,        # FP8 format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
    MAX: tl.constexpr,          #   largest finite value
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    pid = tl.program_id(0)
    span = tl.arange(0, HB * LANES)
    offs = (pid * ROWS + tl.arange(0, ROWS))[:, None] * (HB * LANES) + span[None, :]
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ROTATE:
        y = hadamard_tile(y * random_signs(rotation_seed, offs), ROWS, HB, LOG2_HB, LANES) * norm
    if FEEDBACK:
        y = y + tl.load(residual_ptr + offs, mask=mask, other=0.0)
    if AMAX_ONLY:
        tl.store(amax_ptr + pid, amax_or_inf(y))
    else:
        QROWS: tl.constexpr = ROWS * HB * LANES // QBLOCK
        qrows = pid * QROWS + tl.arange(0, QROWS)
        qoffs = tl.reshape(offs, (QROWS, QBLOCK))
        if NVFP4:
            codes, scale_codes, dequantized = nvfp4_quantize_tile(
                tl.reshape(y, (QROWS, QBLOCK)), qoffs, tl.load(tensor_scale_ptr), seed, STOCHASTIC)
            nvfp4_store_tile(codes_ptr, scales_ptr, codes, scale_codes, qrows, n, QROWS)
        elif INT3:
            codes, scale_codes, dequantized = int3_quantize_tile(
                tl.reshape(y, (QROWS, QBLOCK)), qoffs, tl.load(tensor_scale_ptr), seed, STOCHASTIC)
            int3_store_tile(codes_ptr, scales_ptr, codes, scale_codes, qrows, n, QROWS)
        else:
            tensor_scale = tl.load(tensor_scale_ptr) if PER_TENSOR else 0.0
            codes, scale, dequantized = fp8_quantize_tile(
                tl.reshape(y, (QROWS, QBLOCK)), qoffs, tensor_scale, seed, PER_TENSOR, EBITS, MBITS,
                BIAS, MAX, STOCHASTIC)
            fp8_store_tile(codes_ptr, scales_ptr, codes, scale, qrows, qoffs, n, QBLOCK, PER_TENSOR)
        if FEEDBACK:
            dequantized = tl.reshape(dequantized, (ROWS, HB * LANES))
            tl.store(residual_ptr + offs, y - dequantized, mask=mask)


# The formats of E4M3 block scales under an fp32 tensor scale: (their fixed scale block, the
# tensor scale of an amax, the torch quantizer of (blocks, block) rows, the values of unpacked
# codes, packing, unpacking)
SCALED = {
    "nvfp4": (NVFP4_BLOCK, nvfp4_tensor_scale_torch, nvfp4_quantize_blocks_torch,
              nvfp4_values_torch, pack_codes_torch, unpack_codes_torch),
    "int3": (INT3_BLOCK, int3_tensor_scale_torch, int3_quantize_blocks_torch, int3_values_torch,
             pack_int3_torch, unpack_int3_torch),
}


def quant_block(fmt_name, block_size):
    """The scale block: fixed for NVFP4 and INT3; FP8's, or 1024-element tiles per tensor."""
    return SCALED[fmt_name][0] if fmt_name in SCALED else (block_size or 1024)


def code_bytes(fmt_name, n):
    """Bytes of n packed codes: two a byte for NVFP4, 8 in 3 for INT3, one each for FP8."""
    return {"nvfp4": (n + 1) // 2, "int3": packed_bytes(n)}.get(fmt_name, n)


def rotate_feedback_quantize_triton(x, residual, fmt_name, block_size, rotation=None, seed=0,
                                    stochastic=False):
    """x: flat fp32; residual: flat fp32 updated in place, or None. rotation: (block, seed) or None;
    the caller has checked that x.numel() is a multiple of the rotation's span (LANES blocks).
    Returns (codes, scales, tensor_scale)."""
    n, device = x.numel(), x.device
    scaled = fmt_name in SCALED
    per_tensor = scaled or block_size is None
    qblock = quant_block(fmt_name, block_size)
    hb, lanes = (rotation[0], LANES) if rotation else (qblock, 1)
    span = hb * lanes
    rows = max(1, 4096 // max(span, qblock)) * max(1, qblock // span)
    grid = (triton.cdiv(n, rows * span),)
    fmt = FORMATS.get(fmt_name, FORMATS["fp8_e4m3"])
    codes = torch.empty(code_bytes(fmt_name, n), dtype=torch.uint8, device=device)
    nblocks = triton.cdiv(n, qblock)
    scales = torch.empty(nblocks, dtype=torch.uint8, device=device) if scaled else torch.empty(
        1 if block_size is None else nblocks, dtype=torch.float32, device=device)
    tensor_scale = torch.zeros(1, dtype=torch.float32, device=device)
    dummy = codes if residual is None else residual
    common = dict(EXACT_ARITHMETIC, ROTATE=rotation is not None, FEEDBACK=residual is not None,
                  NVFP4=fmt_name == "nvfp4", INT3=fmt_name == "int3", PER_TENSOR=per_tensor,
                  ROWS=rows, HB=hb, LOG2_HB=hb.bit_length() - 1,
                  LANES=lanes, QBLOCK=qblock, EBITS=fmt.ebits, MBITS=fmt.mbits, BIAS=fmt.bias,
                  MAX=fmt.max, STOCHASTIC=stochastic)
    rotation_seed, norm = (rotation[1], normalizer(hb)) if rotation else (0, 1.0)
    if n == 0:
        return codes, scales, tensor_scale if scaled else (scales if per_tensor else None)
    if per_tensor:
        partial = torch.empty(grid[0], dtype=torch.float32, device=device)
        rotate_feedback_quantize_kernel[grid](x, dummy, codes, scales, tensor_scale, partial, n,
                                              seed, rotation_seed, norm, AMAX_ONLY=True, **common)
        scale_of = (SCALED[fmt_name][1] if scaled else
                    (lambda a: tensor_scale_torch(a, fmt.max)))
        tensor_scale = scale_of(partial.max()).reshape(1)
        if not scaled:
            scales = tensor_scale
    rotate_feedback_quantize_kernel[grid](x, dummy, codes, scales, tensor_scale, tensor_scale, n,
                                          seed, rotation_seed, norm, AMAX_ONLY=False, **common)
    return codes, scales, tensor_scale if scaled else None


@triton.jit
def accumulate_kernel(
    codes_ptr,          # k payloads' codes, one row each
    scales_ptr,         # k payloads' block scales (or per-tensor scales for FP8), one row each
    tensor_scales_ptr,  # NVFP4, INT3: k tensor scales
    out_ptr,            # out: the fp32 sum, n elements
    n,                  # elements
    k,                  # payloads, summed in row order
    codes_stride,       # elements between two payloads' codes
    scales_stride,      # elements between two payloads' scales
    NVFP4: tl.constexpr,        # NVFP4
    INT3: tl.constexpr,         # INT3 (neither: FP8)
    PER_TENSOR: tl.constexpr,   # FP8 with one scale for the tensor
    ROWS: tl.constexpr,         # scale blocks per program
    QBLOCK: tl.constexpr,       # scale block
    EBITS: tl.constexpr,        # FP8 format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    total = tl.zeros((ROWS, QBLOCK), tl.float32)
    for j in range(k):
        if NVFP4:
            total += nvfp4_decode_tile(codes_ptr + j * codes_stride, scales_ptr + j * scales_stride,
                                       tl.load(tensor_scales_ptr + j), rows, n, ROWS)
        elif INT3:
            total += int3_decode_tile(codes_ptr + j * codes_stride, scales_ptr + j * scales_stride,
                                      tl.load(tensor_scales_ptr + j), rows, n, ROWS)
        else:
            total += fp8_decode_tile(codes_ptr + j * codes_stride, scales_ptr + j * scales_stride,
                                     rows, offs, n, QBLOCK, PER_TENSOR, EBITS, MBITS, BIAS)
    tl.store(out_ptr + offs, total, mask=offs < n)


def accumulate_triton(codes, scales, tensor_scales, n, fmt_name, block_size, out=None):
    """codes (k, bytes), scales (k, nscales), tensor_scales (k,) or None: the fp32 sum of k
    payloads, into out (n contiguous fp32 elements) if given."""
    qblock = quant_block(fmt_name, block_size)
    fmt = FORMATS.get(fmt_name, FORMATS["fp8_e4m3"])
    out = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out
    if n:
        block, rows, grid = tile_shape(n, qblock)
        tensor_scales = scales if tensor_scales is None else tensor_scales
        accumulate_kernel[grid](codes, scales, tensor_scales, out, n, codes.shape[0],
                                codes.stride(0), scales.stride(0), **EXACT_ARITHMETIC,
                                NVFP4=fmt_name == "nvfp4", INT3=fmt_name == "int3",
                                PER_TENSOR=block_size is None, ROWS=rows,
                                QBLOCK=qblock, EBITS=fmt.ebits, MBITS=fmt.mbits, BIAS=fmt.bias)
    return out


# ---------------------------------------------------------------- torch references (the CPU path)
def quantize_stage(y, residual, fmt_name, block_size, seed=0, stochastic=False):
    """y (+ residual) -> unpacked codes, scales, tensor scale; the residual becomes the new
    error."""
    if residual is not None:
        y = y + residual
    if fmt_name in SCALED:
        block, scale_of, quantize_blocks, values_of = SCALED[fmt_name][:4]
        # the tensor's amax is the largest block amax: one reduction pass, not two
        blocks = blocks_torch(y, block)
        block_amax = blocks.abs().amax(dim=1)
        amax = block_amax.amax() if y.numel() else torch.zeros((), device=y.device)
        tensor_scale = scale_of(_finite_or_inf(amax)).reshape(1)
        codes, scales, values = quantize_blocks(blocks, block_amax, tensor_scale, seed, stochastic)
        if residual is not None and residual.dim() == 2:         # (blocks, block) rows, as y
            residual.copy_(blocks - values)
        elif residual is not None:
            # a padded last block: values from the codes (recomputing them needs a temporary)
            residual.copy_(y - values_of(codes, scales, tensor_scale)[:y.numel()])
        return codes, scales, tensor_scale
    amax = None
    if block_size is None:
        amax = _finite_or_inf(y.abs().amax() if y.numel() else torch.zeros((), device=y.device))
    fmt = FORMATS[fmt_name]
    tensor_scale = tensor_scale_torch(amax, fmt.max) if block_size is None else None
    codes, scales = fp8_encode_torch(y, fmt, block_size, tensor_scale, seed, stochastic)
    if residual is not None:
        residual.copy_(y - fp8_decode_torch(codes, scales, fmt, block_size))
    return codes, scales, None


def _finite_or_inf(amax):
    return torch.where(torch.isfinite(amax), amax, float("inf"))


def rotate_feedback_quantize_torch(x, residual, fmt_name, block_size, rotation=None, seed=0,
                                   stochastic=False):
    """The reference of rotate_feedback_quantize_triton: (codes, scales, tensor_scale); the
    residual, if given, becomes the new error."""
    y = hadamard_torch(x, rotation[0], rotation[1]) if rotation else x
    block = SCALED[fmt_name][0] if fmt_name in SCALED else None
    if block and y.numel() and y.numel() % block == 0:
        # as (blocks, block) rows: the residual is indexed as the blocks are, and updated in place
        y = y.view(-1, block)
        residual = None if residual is None else residual.view(-1, block)
    codes, scales, tensor_scale = quantize_stage(y, residual, fmt_name, block_size, seed,
                                                 stochastic)
    if block:
        codes = SCALED[fmt_name][4](codes, y.numel())
    return codes, scales, tensor_scale


def decode_torch(codes, scales, tensor_scale, n, fmt_name, block_size, out=None):
    """n decoded fp32 values, into out (n elements) if given."""
    if fmt_name == "nvfp4":
        return nvfp4_decode_torch(codes, scales, tensor_scale, n, out)
    if fmt_name == "int3":
        return int3_decode_torch(codes, scales, tensor_scale, n, out)
    values = fp8_decode_torch(codes[:n], scales, FORMATS[fmt_name], block_size)
    return values if out is None else out.copy_(values)


def accumulate_stage(codes, scales, tensor_scales, n, fmt_name, block_size):
    """Sum in rank order of k payloads; NVFP4 and INT3 codes arrive unpacked, a byte each."""
    total = torch.zeros(n, dtype=torch.float32, device=codes.device)
    for j in range(codes.shape[0]):
        if fmt_name in SCALED:
            total += SCALED[fmt_name][3](codes[j], scales[j], tensor_scales[j])[:n]
        else:
            total += fp8_decode_torch(codes[j, :n], scales[j], FORMATS[fmt_name], block_size)
    return total


def accumulate_torch(codes, scales, tensor_scales, n, fmt_name, block_size, out=None):
    """The fp32 sum in rank order of k payloads (codes, scales, tensor_scales: k rows), into out
    (n elements) if given."""
    if fmt_name in SCALED:
        codes = SCALED[fmt_name][5](codes)
    total = accumulate_stage(codes, scales, tensor_scales, n, fmt_name, block_size)
    return total if out is None else out.copy_(total)
