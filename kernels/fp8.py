"""FP8 (E4M3 / E5M2) quantization with an fp32 scale per block or per tensor: kernels and
references.

    scale = amax / MAX  (per block of BLOCK elements, or given per tensor)
    code  = round(x / scale) to the format, saturated at MAX;   x_hat = value(code) * scale
A block or tensor holding a non-finite value gets scale NaN and codes 0, so it decodes to NaN.
An all-zero block gets scale 0 and decodes to exact zeros.
"""
import torch
import triton
import triton.language as tl

from .rounding import (E4M3, E5M2, EXACT_ARITHMETIC, FloatFormat, blocks_torch, decode_float,
                       element_noise_torch, encode_float_seeded, encode_float_torch, is_nonfinite,
                       tensor_scale_torch)

NAN_BITS = tl.constexpr(0x7FC00000)
FORMATS = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


@triton.jit
def fp8_quantize_tile(
    y,                  # (ROWS, BLOCK) fp32 tile, one scale block a row
    offs,               # its element indices (stochastic rounding's noise)
    tensor_scale,       # the tensor's scale (PER_TENSOR)
    seed,               # stochastic rounding's seed
    PER_TENSOR: tl.constexpr,   # one scale for the tensor (else one a row)
    EBITS: tl.constexpr,        # format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
    MAX: tl.constexpr,          #   largest finite value
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    """Quantize a (ROWS, BLOCK) tile: returns codes, per-row scales and the dequantized tile."""
    if PER_TENSOR:
        scale = tl.zeros((y.shape[0],), tl.float32) + tensor_scale
    else:
        amax = tl.max(tl.abs(y), axis=1)
        bad = tl.max(is_nonfinite(y).to(tl.int32), axis=1) > 0
        nan = tl.full(amax.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        scale = tl.where(bad, nan, tl.math.div_rn(amax, tl.zeros_like(amax) + MAX))
    usable = (scale > 0) & (scale < float("inf"))
    safe = tl.where(usable, scale, 1.0)
    v = tl.where(usable[:, None], tl.math.div_rn(y, safe[:, None]), 0.0)
    codes = encode_float_seeded(v, offs, seed, EBITS, MBITS, BIAS, MAX, STOCHASTIC)
    dequantized = decode_float(codes, EBITS, MBITS, BIAS) * scale[:, None]
    return codes, scale, dequantized


@triton.jit
def fp8_store_tile(codes_ptr, scales_ptr, codes, scale, rows, offs, n, BLOCK: tl.constexpr,
                   PER_TENSOR: tl.constexpr):
    """Stores a quantized (ROWS, BLOCK) tile of the blocks rows: its codes, a byte each, into
    codes_ptr and, unless PER_TENSOR, its rows' fp32 scales into scales_ptr."""
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=offs < n)
    if not PER_TENSOR:
        tl.store(scales_ptr + rows, scale, mask=rows * BLOCK < n)


@triton.jit
def fp8_encode_kernel(
    x_ptr,              # flat fp32 input
    codes_ptr,          # out: one uint8 code an element
    scales_ptr,         # out: one fp32 scale a block (not PER_TENSOR)
    tensor_scale_ptr,   # in: the tensor's scale (PER_TENSOR)
    n,                  # elements
    seed,               # stochastic rounding's seed
    BLOCK: tl.constexpr,        # scale block (a row of the tile)
    ROWS: tl.constexpr,         # blocks per program
    PER_TENSOR: tl.constexpr,   # one scale for the tensor
    EBITS: tl.constexpr,        # format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
    MAX: tl.constexpr,          #   largest finite value
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tensor_scale = tl.load(tensor_scale_ptr) if PER_TENSOR else 0.0
    codes, scale, _ = fp8_quantize_tile(x, offs, tensor_scale, seed, PER_TENSOR, EBITS, MBITS, BIAS,
                                        MAX, STOCHASTIC)
    fp8_store_tile(codes_ptr, scales_ptr, codes, scale, rows, offs, n, BLOCK, PER_TENSOR)


@triton.jit
def fp8_decode_tile(
    codes_ptr,          # uint8 codes
    scales_ptr,         # fp32 scales: one a block, or one for the tensor (PER_TENSOR)
    rows,               # the tile's block indices
    offs,               # the tile's element indices
    n,                  # elements
    BLOCK: tl.constexpr,        # scale block
    PER_TENSOR: tl.constexpr,   # one scale for the tensor
    EBITS: tl.constexpr,        # format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
):
    codes = tl.load(codes_ptr + offs, mask=offs < n, other=0)
    if PER_TENSOR:
        scale = tl.load(scales_ptr + rows * 0)
    else:
        scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=0.0)
    return decode_float(codes, EBITS, MBITS, BIAS) * scale[:, None]


@triton.jit
def fp8_decode_kernel(
    codes_ptr,          # uint8 codes
    scales_ptr,         # fp32 scales: one a block, or one for the tensor (PER_TENSOR)
    out_ptr,            # out: fp32 values
    n,                  # elements
    BLOCK: tl.constexpr,        # scale block
    ROWS: tl.constexpr,         # blocks per program
    PER_TENSOR: tl.constexpr,   # one scale for the tensor
    EBITS: tl.constexpr,        # format: exponent bits,
    MBITS: tl.constexpr,        #   mantissa bits,
    BIAS: tl.constexpr,         #   exponent bias,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    values = fp8_decode_tile(codes_ptr, scales_ptr, rows, offs, n, BLOCK, PER_TENSOR, EBITS, MBITS,
                             BIAS)
    tl.store(out_ptr + offs, values, mask=offs < n)


def tile_shape(n, block_size):
    """(BLOCK, ROWS, grid) for a flat tensor of n elements; per-tensor scaling uses 1024-wide
    rows."""
    block = block_size or 1024
    rows = max(1, min(64, 4096 // block))
    return block, rows, (triton.cdiv(triton.cdiv(n, block), rows),)


def fp8_encode_triton(x, fmt: FloatFormat, block_size, tensor_scale=None, seed=0, stochastic=False):
    """x: flat fp32. Per-tensor scaling (block_size None) takes the scale from the caller."""
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    block, rows, grid = tile_shape(n, block_size)
    per_tensor = block_size is None
    scales = (tensor_scale.reshape(1) if per_tensor else
              torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device))
    if n:
        fp8_encode_kernel[grid](x, codes, scales, scales, n, seed, **EXACT_ARITHMETIC, BLOCK=block,
                                ROWS=rows, PER_TENSOR=per_tensor, EBITS=fmt.ebits, MBITS=fmt.mbits,
                                BIAS=fmt.bias, MAX=fmt.max, STOCHASTIC=stochastic)
    return codes, scales


def fp8_decode_triton(codes, scales, fmt: FloatFormat, block_size, out=None):
    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32, device=codes.device) if out is None else out
    block, rows, grid = tile_shape(n, block_size)
    if n:
        fp8_decode_kernel[grid](codes, scales, out, n, **EXACT_ARITHMETIC, BLOCK=block, ROWS=rows,
                                PER_TENSOR=block_size is None, EBITS=fmt.ebits, MBITS=fmt.mbits,
                                BIAS=fmt.bias)
    return out


# ---------------------------------------------------------------- torch references (the CPU path)
def fp8_encode_torch(x, fmt: FloatFormat, block_size, tensor_scale=None, seed=0, stochastic=False):
    n = x.numel()
    if block_size is None:
        scales, blocks = tensor_scale.reshape(1).to(torch.float32), x.view(1, n)
    else:
        blocks = blocks_torch(x, block_size)
        amax = blocks.abs().amax(dim=1)   # NaN or inf exactly where the block is not finite
        scales = tensor_scale_torch(amax, fmt.max)
    s = scales[:, None]
    usable = (s > 0) & (s < float("inf"))
    v = torch.where(usable, blocks / torch.where(usable, s, 1.0), 0.0)
    if stochastic:
        codes = encode_float_torch(v, fmt, element_noise_torch(seed, v))
        return codes.to(torch.uint8).reshape(-1)[:n], scales
    # round-to-nearest-even with saturation is exactly torch's own cast after clamping
    dtype = torch.float8_e4m3fn if fmt is E4M3 else torch.float8_e5m2
    codes = v.clamp(-fmt.max, fmt.max).to(dtype).view(torch.uint8).reshape(-1)[:n]
    return torch.where(codes == 0x80, 0, codes), scales  # no negative zero


def fp8_decode_torch(codes, scales, fmt: FloatFormat, block_size):
    values = codes.view(torch.float8_e4m3fn if fmt is E4M3 else torch.float8_e5m2).to(torch.float32)
    if block_size is None:
        return values * scales
    return (blocks_torch(values, block_size) * scales[:, None]).reshape(-1)[:codes.numel()]
