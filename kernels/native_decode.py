"""The native decoders (numba): the fp32 sum, in order, of k FP8 or NVFP4 payloads (k = 1:
decoding), tile by tile, bit for bit as fused.accumulate_torch and fused.decode_torch."""
import numpy as np
from numba import njit

from .native_scalars import (E4M3, F0, FP8_FORMATS, KERNEL, NVFP4_BLOCK, decode_float,
                             magnitude_bits)


# The value of each E2M1 code (sign in bit 3). A byte's two codes are looked up in this
# 16-entry table, in fixed loops of 8 bytes: LLVM vectorizes them, while decoding the codes
# arithmetically or looking both up in a 256-entry table of pairs stays far slower (4x, measured).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)
# The decoders take whole (k, ...) payload arrays and a range [first, last) of tiles: a row of
# a C-contiguous 2D array sliced inside the kernel is a contiguous 1D view indexed from 0, which
# LLVM vectorizes; a (k, part) slice taken outside would be a strided 2D view, which it does not.


@njit(inline="always")
def add_payload(total, values, j, from_zero, count):
    """total (+)= values over count elements: payload j of the sum in order, as
    fused.accumulate_stage (from_zero: +0 first, so +0 + -0 is +0) or decode_torch."""
    if j == 0 and not from_zero:
        for i in range(count):
            total[i] = values[i]
    elif j == 0:
        for i in range(count):
            total[i] = F0 + values[i]
    else:
        for i in range(count):
            total[i] += values[i]


@njit(inline="always")
def e4m3_denominators(denoms, scale_codes, tensor_scale):
    """denoms[b] = the value of E4M3 scale code b times the tensor scale: a tile's denominators
    first, in a loop across its blocks (which vectorizes)."""
    for b in range(scale_codes.size):
        denoms[b] = decode_float(np.int32(scale_codes[b]), E4M3[0], E4M3[1],
                                 E4M3[2]) * tensor_scale


@njit(inline="always")
def nvfp4_block(total, codes, denom, j, from_zero):
    """One whole 16-block of payload j into total, with add_payload's rules: its 8 bytes'
    E2M1 values times the block's denominator, in fixed loops (which vectorize)."""
    if j == 0 and not from_zero:
        for i in range(8):
            total[2 * i] = E2M1_VALUES[codes[i] & 15] * denom
            total[2 * i + 1] = E2M1_VALUES[codes[i] >> 4] * denom
    elif j == 0:
        for i in range(8):
            total[2 * i] = F0 + E2M1_VALUES[codes[i] & 15] * denom
            total[2 * i + 1] = F0 + E2M1_VALUES[codes[i] >> 4] * denom
    else:
        for i in range(8):
            total[2 * i] += E2M1_VALUES[codes[i] & 15] * denom
            total[2 * i + 1] += E2M1_VALUES[codes[i] >> 4] * denom


@njit(inline="always")
def owner_epilogue(total, residual, divisor, count, fold):
    """total <- total / divisor (+ residual with fold), as the owner's division and the
    quantizer's y = x + r round them; returns the largest magnitude_bits of the results."""
    top = np.int32(0)
    for i in range(count):
        v = total[i] / divisor
        if fold:
            v = v + residual[i]
        total[i] = v
        top = max(top, magnitude_bits(v))
    return top


# What a decoder does to each tile once its payloads are summed: nothing, the owner's division
# (an average), or the division and the stage-2 residual added (the quantizer's input, y = x + r).
EPILOGUES = (None, "divide", "fold")


def make_nvfp4_accumulate(from_zero, epilogue):
    finish, fold = epilogue is not None, epilogue == "fold"

    @njit(**KERNEL)
    def nvfp4_accumulate(packed, scale_codes, tensor_scales, out, residual, divisor, first,
                         last):
        """out[chunks first..last-1] = the fp32 sum in order of k NVFP4 payloads: packed
        (k, bytes), scale_codes (k, blocks), tensor_scales (k,). from_zero: the sum starts at +0
        (fused.accumulate_stage); otherwise at the first payload (decode). Whole blocks go
        straight into out; a last, partial block through a block of scratch. Then the tile's
        epilogue (EPILOGUES; residual: out's size, read with "fold"); returns the largest
        magnitude_bits of out's tiles after it (0 without one)."""
        n = out.size
        top = np.int32(0)
        tail = np.empty(NVFP4_BLOCK, np.float32)
        denoms = np.empty(DECODE_TILE // NVFP4_BLOCK + 1, np.float32)
        for c in range(first, last):
            base = c * DECODE_TILE
            count = min(DECODE_TILE, n - base)
            whole = count // NVFP4_BLOCK
            total = out[base: base + count]
            for j in range(packed.shape[0]):
                codes = packed[j, base // 2: base // 2 + (count + 1) // 2]
                scales = scale_codes[j, base // NVFP4_BLOCK: base // NVFP4_BLOCK + whole + 1]
                e4m3_denominators(denoms, scales, tensor_scales[j])
                for b in range(whole):
                    nvfp4_block(total[b * NVFP4_BLOCK: (b + 1) * NVFP4_BLOCK],
                                codes[b * 8: b * 8 + 8], denoms[b], j, from_zero)
                rest = count - whole * NVFP4_BLOCK
                if rest:
                    denom = denoms[whole]
                    for i in range(rest):
                        k = whole * NVFP4_BLOCK + i
                        tail[i] = E2M1_VALUES[(codes[k >> 1] >> ((k & 1) * 4)) & 15] * denom
                    add_payload(total[whole * NVFP4_BLOCK:], tail, j, from_zero, rest)
            if finish:
                top = max(top, owner_epilogue(total, residual[base: base + count], divisor,
                                              count, fold))
        return top

    return nvfp4_accumulate


@njit(inline="always")
def add_fp8(total, codes, scale, j, from_zero, count, ebits, mbits, bias):
    """total (+)= decode(codes) * scale over count elements in one pass: payload j of the sum in
    order, with add_payload's rules (the same roundings: the product, then the sum)."""
    if j == 0 and not from_zero:
        for i in range(count):
            total[i] = decode_float(np.int32(codes[i]), ebits, mbits, bias) * scale
    elif j == 0:
        for i in range(count):
            total[i] = F0 + decode_float(np.int32(codes[i]), ebits, mbits, bias) * scale
    else:
        for i in range(count):
            total[i] += decode_float(np.int32(codes[i]), ebits, mbits, bias) * scale


# Blocks of at least this many elements decode, scale and add in one pass block by block; smaller
# ones decode a tile, scale it, then add it (a call per block costs more than the extra passes).
FUSED_BLOCK_MIN = 16


def make_fp8_accumulate(from_zero, per_tensor, fmt, epilogue):
    ebits, mbits, bias, _ = fmt
    finish, fold = epilogue is not None, epilogue == "fold"

    @njit(**KERNEL)
    def fp8_accumulate(codes, scales, block, out, residual, divisor, first, last):
        """out[tiles first..last-1] = the fp32 sum in order of k FP8 payloads: codes (k, >= n),
        scales (k, blocks), or (k, 1) per tensor; a tile is whole blocks (per tensor: any
        4096 elements); from_zero, the epilogue and the result as in nvfp4_accumulate. Payload
        by payload over a tile, so the tile's partial sums stay in L1."""
        n = out.size
        top = np.int32(0)
        tile = FP8_TILE if per_tensor else block * max(1, FP8_TILE // block)
        values = np.empty(tile, np.float32)
        for t in range(first, last):
            base = t * tile
            count = min(tile, n - base)
            total = out[base: base + count]
            for j in range(codes.shape[0]):
                row = codes[j, base: base + count]
                if per_tensor:
                    add_fp8(total, row, scales[j, 0], j, from_zero, count, ebits, mbits, bias)
                elif block >= FUSED_BLOCK_MIN:
                    for b in range(-(-count // block)):
                        lo, hi = b * block, min(count, (b + 1) * block)
                        add_fp8(total[lo:hi], row[lo:hi], scales[j, base // block + b], j,
                                from_zero, hi - lo, ebits, mbits, bias)
                else:  # whole blocks: the tail's extra values are never added to out
                    for i in range(count):
                        values[i] = decode_float(np.int32(row[i]), ebits, mbits, bias)
                    for b in range(-(-count // block)):
                        scale = scales[j, base // block + b]
                        for i in range(block):
                            values[b * block + i] *= scale
                    add_payload(total, values, j, from_zero, count)
            if finish:
                top = max(top, owner_epilogue(total, residual[base: base + count], divisor,
                                              count, fold))
        return top

    return fp8_accumulate


# Elements of an NVFP4 decoding tile (a multiple of 16)
DECODE_TILE = 4096
# Elements of an FP8 tile: the decoded values of one payload stay in L1 while they are added.
FP8_TILE = 4096
# (from_zero, epilogue): a decode starts from its payload and has no epilogue
VARIANTS = [(False, None)] + [(True, e) for e in EPILOGUES]
NVFP4_ACCUMULATE = {(z, e): make_nvfp4_accumulate(z, e) for z, e in VARIANTS}
FP8_ACCUMULATE = {(z, e, t, name): make_fp8_accumulate(z, t, fmt, e) for z, e in VARIANTS
                  for t in (False, True) for name, fmt in FP8_FORMATS.items()}
