"""NVFP4 quantization: kernels and references.

    s_t  = amax(tensor) / (6 * 448)                       one fp32 per tensor (given by the caller)
    s_b  = E4M3(amax(block) / (6 * s_t))                  one E4M3 code per 16-element block
    code = E2M1(x / (s_b * s_t)), saturated at 6;         x_hat = value(code) * (s_b * s_t)
Two codes a byte, the even element in the low nibble: 4.5 bits per element with the block scales.
A non-finite tensor scale gives codes 0 and decodes to NaN; a zero block decodes to exact zeros.
"""
import torch
import triton
import triton.language as tl

from .rounding import (
    E2M1,
    E4M3,
    decode_e2m1_torch,
    decode_float,
    element_noise_torch,
    encode_float_seeded,
    encode_float_torch,
    round_e2m1_nearest_torch,
    tensor_scale_torch,
)
from .two_level import (two_level_decode_torch, two_level_decode_triton, two_level_denominators,
                        two_level_encode_torch, two_level_encode_triton, two_level_scale,
                        two_level_scale_torch, two_level_values_torch)

BLOCK = 16
# The kernels spell the two formats out as (ebits, mbits, bias, max) literals: E4M3 = (4, 3, 7,
# 448.0) for the block scales (in two_level.py), E2M1 = (2, 1, 1, 6.0) for the elements.
# Module-level tl.constexpr globals compile, but the interpreter (how CI runs the kernels) passes
# them to helpers as constexpr objects that int32 arithmetic rejects.
TENSOR_SCALE_DIVISOR = E2M1.max * E4M3.max   # 2688


@triton.jit
def nvfp4_quantize_tile(y, offs, tensor_scale, seed, STOCHASTIC: tl.constexpr):
    """Quantize a (ROWS, 16) tile: returns E2M1 codes, E4M3 scale codes and the dequantized tile."""
    scale_codes, denom, v = two_level_scale(y, tensor_scale, 6.0)
    codes = encode_float_seeded(v, offs, seed, 2, 1, 1, 6.0, STOCHASTIC)   # E2M1
    dequantized = decode_float(codes, 2, 1, 1) * denom[:, None]   # E2M1
    return codes, scale_codes, dequantized


@triton.jit
def pack_nibbles(codes, ROWS: tl.constexpr):
    even, odd = tl.split(tl.reshape(codes, (ROWS, 8, 2)))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def nvfp4_store_tile(packed_ptr, scale_codes_ptr, codes, scale_codes, rows, n, ROWS: tl.constexpr):
    """Stores a quantized (ROWS, 16) tile of the blocks rows: its E2M1 codes two a byte into
    packed_ptr, its E4M3 scale codes into scale_codes_ptr."""
    byte_offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + byte_offs, pack_nibbles(codes, ROWS), mask=byte_offs * 2 < n)
    tl.store(scale_codes_ptr + rows, scale_codes.to(tl.uint8), mask=rows * 16 < n)


@triton.jit
def unpack_nibbles(packed, ROWS: tl.constexpr):
    packed = packed.to(tl.int32)
    return tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, 16))


@triton.jit
def nvfp4_encode_kernel(
    x_ptr,              # flat fp32 input
    packed_ptr,         # out: E2M1 codes, two a byte (even element in the low nibble)
    scale_codes_ptr,    # out: one E4M3 scale code per 16-element block
    tensor_scale_ptr,   # in: the tensor's fp32 scale
    n,                  # elements
    seed,               # stochastic rounding's seed
    ROWS: tl.constexpr,         # blocks per program
    STOCHASTIC: tl.constexpr,   # stochastic rounding (else to nearest even)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tensor_scale = tl.load(tensor_scale_ptr)
    codes, scale_codes, _ = nvfp4_quantize_tile(x, offs, tensor_scale, seed, STOCHASTIC)
    nvfp4_store_tile(packed_ptr, scale_codes_ptr, codes, scale_codes, rows, n, ROWS)


@triton.jit
def nvfp4_decode_tile(
    packed_ptr,         # E2M1 codes, two a byte
    scale_codes_ptr,    # E4M3 scale codes, one a block
    tensor_scale,       # the tensor's fp32 scale (a value)
    rows,               # the tile's block indices
    n,                  # elements
    ROWS: tl.constexpr,         # blocks in the tile
):
    byte_offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    packed = tl.load(packed_ptr + byte_offs, mask=byte_offs * 2 < n, other=0)
    denom = two_level_denominators(scale_codes_ptr, tensor_scale, rows, n, 16)
    return decode_float(unpack_nibbles(packed, ROWS), 2, 1, 1) * denom[:, None]   # E2M1


@triton.jit
def nvfp4_decode_kernel(
    packed_ptr,         # E2M1 codes, two a byte
    scale_codes_ptr,    # E4M3 scale codes, one a block
    tensor_scale_ptr,   # the tensor's fp32 scale
    out_ptr,            # out: fp32 values
    n,                  # elements
    ROWS: tl.constexpr,         # blocks per program
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
    values = nvfp4_decode_tile(packed_ptr, scale_codes_ptr, tl.load(tensor_scale_ptr), rows, n,
                               ROWS)
    tl.store(out_ptr + offs, values, mask=offs < n)


ROWS_PER_PROGRAM = 256


def nvfp4_encode_triton(x, tensor_scale, seed=0, stochastic=False):
    return two_level_encode_triton(nvfp4_encode_kernel, x, (x.numel() + 1) // 2, BLOCK,
                                   ROWS_PER_PROGRAM, tensor_scale, seed, stochastic)


def nvfp4_decode_triton(packed, scale_codes, tensor_scale, n, out=None):
    return two_level_decode_triton(nvfp4_decode_kernel, packed, scale_codes, tensor_scale, n, out,
                                   BLOCK, ROWS_PER_PROGRAM)


# ---------------------------------------------------------------- torch references (the CPU path)
def nvfp4_tensor_scale_torch(amax):
    return tensor_scale_torch(amax, TENSOR_SCALE_DIVISOR)


def nvfp4_quantize_blocks_torch(blocks, block_amax, tensor_scale, seed=0, stochastic=False):
    """Codes (uint8, flat), scale codes and dequantized values (blocks' shape) of (blocks, 16) rows
    whose amax per row the caller has (it also gives the tensor's amax: one pass over the data for
    both). The values come with the codes, not from them: no second pass over data, codes,
    scales."""
    scale_codes, denom, v = two_level_scale_torch(blocks, block_amax, tensor_scale, E2M1.max)
    if stochastic:
        v = torch.nan_to_num(v, nan=0.0)     # non-finite only where the tensor scale is unusable
        codes = encode_float_torch(v, E2M1, element_noise_torch(seed, v))
        values = decode_e2m1_torch(codes)
    else:
        codes, values = round_e2m1_nearest_torch(v)
    return codes.to(torch.uint8).reshape(-1), scale_codes, values * denom[:, None]


def nvfp4_values_torch(codes, scale_codes, tensor_scale):
    """fp32 values of unpacked codes (uint8; padded or cut to the blocks of scale_codes)."""
    return two_level_values_torch(codes, scale_codes, tensor_scale, BLOCK, decode_e2m1_torch)


# Packing works on 8 codes at once, seen as one little-endian int64 word (x86 and ARM alike):
# contiguous integer ops on whole tensors instead of gathers of even and odd elements.
def pack_words_torch(words):
    """int32 words of packed bytes from int64 words of 8 codes each (even code in the low
    nibble)."""
    pairs = words | (words >> 4)        # byte 2k now holds codes 2k and 2k + 1
    packed = ((pairs & 0xFF) | ((pairs >> 8) & 0xFF00) | ((pairs >> 16) & 0xFF0000)
              | ((pairs >> 24) & 0xFF000000))
    # sign-extended, so the cast is exact
    return ((packed ^ 0x80000000) - 0x80000000).to(torch.int32)


def unpack_words_torch(words):
    """int64 words of 8 codes each from int32 words of packed bytes."""
    spread = words.to(torch.int64) & 0xFFFFFFFF
    spread = ((spread & 0xFF) | ((spread & 0xFF00) << 8) | ((spread & 0xFF0000) << 16)
              | ((spread & 0xFF000000) << 24))
    return (spread & 0x000F000F000F000F) | ((spread << 4) & 0x0F000F000F000F00)


def pack_codes_torch(codes, n):
    """(n + 1) // 2 packed bytes of unpacked codes (uint8, a multiple of 8 of them)."""
    return pack_words_torch(codes.view(torch.int64)).view(torch.uint8)[: (n + 1) // 2]


def unpack_codes_torch(packed):
    """Codes, one a byte, of packed bytes (..., bytes): rows padded to whole words, so a few
    more."""
    pad = -packed.shape[-1] % 4
    if pad or packed.data_ptr() % 4 or not packed.is_contiguous():  # pieces start anywhere
        padded = torch.zeros(*packed.shape[:-1], packed.shape[-1] + pad, dtype=torch.uint8,
                             device=packed.device)
        padded[..., :packed.shape[-1]] = packed
        packed = padded
    return unpack_words_torch(packed.view(torch.int32)).view(torch.uint8)


def nvfp4_encode_torch(x, tensor_scale, seed=0, stochastic=False):
    """The reference of nvfp4_encode_triton: packed codes and one E4M3 scale code per block."""
    return two_level_encode_torch(x, BLOCK, nvfp4_quantize_blocks_torch, pack_codes_torch,
                                  tensor_scale, seed, stochastic)


def nvfp4_decode_torch(packed, scale_codes, tensor_scale, n, out=None):
    """n decoded fp32 values, into out (n elements) if given."""
    return two_level_decode_torch(packed, scale_codes, tensor_scale, n, out, unpack_codes_torch,
                                  nvfp4_values_torch)
