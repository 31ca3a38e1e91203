"""INT3 quantization: 7 integer levels a 32-element block, NVFP4's two-level scaling.

    s_t   = amax(tensor) / (3 * 448)                      one fp32 per tensor (given by the caller)
    s_b   = E4M3(amax(block) / (3 * s_t))                 one E4M3 code per 32-element block
    level = round(x / (s_b * s_t)) in {-3..3}, saturated at 3;   x_hat = level * (s_b * s_t)
A code is |level| with the sign in bit 2 (no negative zero, so code 0 pads a partial group);
8 codes fill 3 bytes, code i of a group at bits 3i..3i+2 of the little-endian 24-bit word:
3.25 bits an element with the block scales. A non-finite tensor scale gives codes 0 and decodes
to NaN; a zero block decodes to exact zeros.
"""
import torch
import triton
import triton.language as tl

from .rounding import (
    E4M3,
    RNE_MAGIC,
    element_noise_torch,
    tensor_scale_torch,
    uniform_hash,
)
from .two_level import (two_level_decode_torch, two_level_decode_triton, two_level_denominators,
                        two_level_encode_torch, two_level_encode_triton, two_level_scale,
                        two_level_scale_torch, two_level_values_torch)

BLOCK = 32
LEVELS = 3
TENSOR_SCALE_DIVISOR = LEVELS * E4M3.max   # 1344


def packed_bytes(n):
    """Bytes of n packed codes: 3 per group of 8, the last group zero-padded."""
    return 3 * -(-n // 8)


@triton.jit
def int3_quantize_tile(y, offs, tensor_scale, seed, STOCHASTIC: tl.constexpr):
    """Quantize a (ROWS, 32) tile: returns codes, E4M3 scale codes and the dequantized tile."""
    scale_codes, denom, v = two_level_scale(y, tensor_scale, 3.0)
    a = tl.minimum(tl.abs(v), 3.0)     # v is finite: the NaN rules of tl.minimum do not arise
    if STOCHASTIC:
        whole = tl.floor(a)
        level = whole + (uniform_hash(seed, offs) < a - whole).to(tl.float32)
    else:
        level = (a + RNE_MAGIC) - RNE_MAGIC
    negative = (v < 0) & (level > 0)
    codes = level.to(tl.int32) + tl.where(negative, 4, 0)
    return codes, scale_codes, tl.where(negative, -level, level) * denom[:, None]


@triton.jit
def int3_groups(rows, ROWS: tl.constexpr):
    """The indices of the (ROWS * 4) 8-code groups of the 32-blocks rows."""
    return tl.reshape(rows[:, None] * 4 + tl.arange(0, 4)[None, :], (ROWS * 4,))


@triton.jit
def int3_store_tile(packed_ptr, scale_codes_ptr, codes, scale_codes, rows, n, ROWS: tl.constexpr):
    """Stores a quantized (ROWS, 32) tile of the blocks rows: its codes packed 8 into 3 bytes
    into packed_ptr (a group's bytes are whole words: a store per byte of each), its E4M3 scale
    codes into scale_codes_ptr."""
    groups = int3_groups(rows, ROWS)
    # the codes' bits do not overlap: their sum is their bitwise or
    words = tl.sum(tl.reshape(codes, (ROWS * 4, 8)) << (3 * tl.arange(0, 8))[None, :], axis=1)
    for k in tl.static_range(3):
        tl.store(packed_ptr + groups * 3 + k, ((words >> (8 * k)) & 0xFF).to(tl.uint8),
                 mask=groups * 8 < n)
    tl.store(scale_codes_ptr + rows, scale_codes.to(tl.uint8), mask=rows * 32 < n)


@triton.jit
def int3_decode_tile(
    packed_ptr,         # codes, 8 in 3 bytes
    scale_codes_ptr,    # E4M3 scale codes, one a block
    tensor_scale,       # the tensor's fp32 scale (a value)
    rows,               # the tile's block indices
    n,                  # elements
    ROWS: tl.constexpr,         # blocks in the tile
):
    groups = int3_groups(rows, ROWS)
    mask = groups * 8 < n
    words = tl.load(packed_ptr + groups * 3, mask=mask, other=0).to(tl.int32)
    for k in tl.static_range(1, 3):
        words = words | (tl.load(packed_ptr + groups * 3 + k, mask=mask, other=0).to(tl.int32)
                         << (8 * k))
    codes = tl.reshape((words[:, None] >> (3 * tl.arange(0, 8))[None, :]) & 7, (ROWS, 32))
    denom = two_level_denominators(scale_codes_ptr, tensor_scale, rows, n, 32)
    level = (codes & 3).to(tl.float32)
    return tl.where(codes >= 4, -level, level) * denom[:, None]


@triton.jit
def int3_encode_kernel(
    x_ptr,              # flat fp32 input
    packed_ptr,         # out: codes, 8 in 3 bytes
    scale_codes_ptr,    # out: one E4M3 scale code per 32-element block
    tensor_scale_ptr,   # in: the tensor's fp32 scale
    n,                  # elements
    seed,               # stochastic rounding's seed
    ROWS: tl.constexpr,         # blocks per program
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    codes, scale_codes, _ = int3_quantize_tile(x, offs, tl.load(tensor_scale_ptr), seed,
                                               STOCHASTIC)
    int3_store_tile(packed_ptr, scale_codes_ptr, codes, scale_codes, rows, n, ROWS)


@triton.jit
def int3_decode_kernel(
    packed_ptr,         # codes, 8 in 3 bytes
    scale_codes_ptr,    # E4M3 scale codes, one a block
    tensor_scale_ptr,   # the tensor's fp32 scale
    out_ptr,            # out: fp32 values
    n,                  # elements
    ROWS: tl.constexpr,         # blocks per program
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    values = int3_decode_tile(packed_ptr, scale_codes_ptr, tl.load(tensor_scale_ptr), rows, n,
                              ROWS)
    tl.store(out_ptr + offs, values, mask=offs < n)


ROWS_PER_PROGRAM = 128


def int3_encode_triton(x, tensor_scale, seed=0, stochastic=False):
    return two_level_encode_triton(int3_encode_kernel, x, packed_bytes(x.numel()), BLOCK,
                                   ROWS_PER_PROGRAM, tensor_scale, seed, stochastic)


def int3_decode_triton(packed, scale_codes, tensor_scale, n, out=None):
    return two_level_decode_triton(int3_decode_kernel, packed, scale_codes, tensor_scale, n, out,
                                   BLOCK, ROWS_PER_PROGRAM)


# ---------------------------------------------------------------- torch references (the CPU path)
def int3_tensor_scale_torch(amax):
    return tensor_scale_torch(amax, TENSOR_SCALE_DIVISOR)


def int3_quantize_blocks_torch(blocks, block_amax, tensor_scale, seed=0, stochastic=False):
    """Codes (uint8, flat), scale codes and dequantized values (blocks' shape) of (blocks, 32)
    rows whose amax per row the caller has, as nvfp4_quantize_blocks_torch."""
    scale_codes, denom, v = two_level_scale_torch(blocks, block_amax, tensor_scale, float(LEVELS))
    a = v.abs()
    a = torch.where(a < 3.0, a, torch.where(a >= 3.0, 3.0, 0.0))   # NaN compares false both ways
    if stochastic:
        whole = torch.floor(a)
        level = whole + (element_noise_torch(seed, v) < a - whole).to(torch.float32)
    else:
        level = (a + 12582912.0) - 12582912.0      # to nearest even, as RNE_MAGIC
    negative = (v < 0) & (level > 0)
    codes = level.to(torch.int32) + torch.where(negative, 4, 0)
    values = torch.where(negative, -level, level)
    return codes.to(torch.uint8).reshape(-1), scale_codes, values * denom[:, None]


def int3_levels_torch(codes):
    """The signed levels (fp32) of codes (int32): |level| with the sign in bit 2."""
    level = (codes & 3).to(torch.float32)
    return torch.where(codes >= 4, -level, level)


def int3_values_torch(codes, scale_codes, tensor_scale):
    """fp32 values of unpacked codes (uint8; padded or cut to the blocks of scale_codes)."""
    return two_level_values_torch(codes, scale_codes, tensor_scale, BLOCK, int3_levels_torch)


# Packing sees 8 codes as one little-endian int64 word (a code a byte) and moves them together
# in three steps of shifts and masks (pairs, quads, then the two quads), instead of gathers.
def pack_int3_torch(codes, n):
    """packed_bytes(n) bytes of unpacked codes (uint8, a multiple of 8 of them)."""
    w = codes.view(torch.int64)
    w = (w | (w >> 5)) & 0x003F003F003F003F        # code 2j + 1 beside code 2j
    w = (w | (w >> 10)) & 0x00000FFF00000FFF       # 4 codes in 12 bits at each 32
    w = (w | (w >> 20)) & 0xFFFFFF                 # 8 codes in 24 bits
    return w.view(torch.uint8).view(-1, 8)[:, :3].reshape(-1)[:packed_bytes(n)]


def unpack_int3_torch(packed):
    """Codes, one a byte, of packed bytes (..., 3 * groups): 8 codes per group of 3 bytes."""
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, 3)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    w = (w & 0xFFF) | ((w & 0xFFF000) << 20)
    w = (w & 0x0000003F0000003F) | ((w & 0x00000FC000000FC0) << 10)
    w = (w & 0x0007000700070007) | ((w & 0x0038003800380038) << 5)
    return w.view(torch.uint8)


def int3_encode_torch(x, tensor_scale, seed=0, stochastic=False):
    """The reference of int3_encode_triton: packed codes and one E4M3 scale code per block."""
    return two_level_encode_torch(x, BLOCK, int3_quantize_blocks_torch, pack_int3_torch,
                                  tensor_scale, seed, stochastic)


def int3_decode_torch(packed, scale_codes, tensor_scale, n, out=None):
    """n decoded fp32 values, into out (n elements) if given."""
    return two_level_decode_torch(packed, scale_codes, tensor_scale, n, out, unpack_int3_torch,
                                  int3_values_torch)
