"""The native INT3 kernels (numba): the quantizer (amax, E4M3 block scales, codes packed 8 in 3
bytes, the new error-feedback residual) and the decoder (the fp32 sum, in order, of k payloads),
bit for bit as int3.py's torch references, with native_quantize's FEEDBACK modes and
native_decode's variants and epilogues. A non-finite tensor never reaches the quantizer
(formats.py sends it to the torch reference)."""
import numpy as np
from numba import njit

from .native_decode import DECODE_TILE, VARIANTS, add_payload, e4m3_denominators, owner_epilogue
from .native_quantize import FEEDBACK
from .native_scalars import (
    F0,
    F1,
    KERNEL,
    RNE_MAGIC,
    block_divisor,
    e4m3_block_scale,
    magnitude_bits,
    uniform_hash,
)

INT3_BLOCK = 32
THREE = np.float32(3.0)
INT3_DIVISOR = np.float32(3.0 * 448.0)  # a tensor scale is amax / (3 * 448)
# The value of each code (sign in bit 2; code 4, never written, is -0 as E2M1's negative zero)
INT3_VALUES = np.array([0, 1, 2, 3, -0.0, -1, -2, -3], np.float32)


def make_int3_quantize(feedback_mode, stochastic):
    add, feedback = feedback_mode == "add", feedback_mode is not None

    @njit(**KERNEL)
    def int3_quantize(x, residual, packed, scale_codes, tensor_scale, seed_term, offset):
        """Finite x (+ r, FEEDBACK), element 0 at index offset of the tensor (a multiple of 32):
        codes packed 8 in 3 bytes, E4M3 scale codes, r <- y - values
        (int3_quantize_blocks_torch). The last block runs zero-padded, as blocks_torch pads
        it, so a partial last group packs zero codes."""
        n = x.size
        y = np.empty(INT3_BLOCK, np.float32)
        codes = np.empty(INT3_BLOCK, np.int32)
        for b in range(-(-n // INT3_BLOCK)):
            base = b * INT3_BLOCK
            count = min(INT3_BLOCK, n - base)
            # views indexed from 0: LLVM vectorizes them, not an index plus an offset
            xs, rs = x[base: base + count], residual[base: base + count]
            top = np.int32(0)
            for i in range(INT3_BLOCK):
                v = F0
                if i < count:
                    v = xs[i] + rs[i] if add else xs[i]
                y[i] = v
                top = max(top, magnitude_bits(v))
            amax = np.int32(top).view(np.float32)
            scale_codes[b], denom = e4m3_block_scale(amax, tensor_scale, THREE)
            divisor = block_divisor(denom)
            for i in range(INT3_BLOCK):
                v = y[i] / divisor
                a = min(abs(v), THREE)
                if stochastic:
                    whole = np.float32(np.floor(a))
                    up = uniform_hash(seed_term, offset + base + i) < a - whole
                    level = whole + (F1 if up else F0)
                else:
                    level = (a + RNE_MAGIC) - RNE_MAGIC
                negative = v < F0 and level > F0
                codes[i] = np.int32(level) + (np.int32(4) if negative else np.int32(0))
                if feedback and i < count:
                    rs[i] = y[i] - (-level if negative else level) * denom
            out = packed[b * 12: b * 12 + 3 * -(-count // 8)]
            for g in range(-(-count // 8)):
                word = np.int32(0)
                for k in range(8):
                    word |= codes[8 * g + k] << (3 * k)
                for k in range(3):
                    out[3 * g + k] = np.uint8((word >> (8 * k)) & 0xFF)

    return int3_quantize


@njit(inline="always")
def int3_word(codes, start):
    """The little-endian 24-bit word of the 8-code group whose 3 bytes begin at codes[start]."""
    return (np.int32(codes[start]) | (np.int32(codes[start + 1]) << 8)
            | (np.int32(codes[start + 2]) << 16))


@njit(inline="always")
def int3_block(total, codes, denom, j, from_zero):
    """One whole 32-block of payload j (its 12 bytes) into total, with add_payload's rules: each
    group's 24-bit word, then its 8 values times the block's denominator, in fixed loops."""
    for g in range(4):
        word = int3_word(codes, 3 * g)
        out = total[8 * g: 8 * g + 8]
        if j == 0 and not from_zero:
            for k in range(8):
                out[k] = INT3_VALUES[(word >> (3 * k)) & 7] * denom
        elif j == 0:
            for k in range(8):
                out[k] = F0 + INT3_VALUES[(word >> (3 * k)) & 7] * denom
        else:
            for k in range(8):
                out[k] += INT3_VALUES[(word >> (3 * k)) & 7] * denom


def make_int3_accumulate(from_zero, epilogue):
    finish, fold = epilogue is not None, epilogue == "fold"

    @njit(**KERNEL)
    def int3_accumulate(packed, scale_codes, tensor_scales, out, residual, divisor, first, last):
        """out[tiles first..last-1] = the fp32 sum in order of k INT3 payloads: packed
        (k, bytes), scale_codes (k, blocks), tensor_scales (k,); from_zero, the epilogue and
        the result as in native_decode.nvfp4_accumulate. Whole blocks go straight into out; a
        last, partial block through a block of scratch."""
        n = out.size
        top = np.int32(0)
        tail = np.empty(INT3_BLOCK, np.float32)
        denoms = np.empty(DECODE_TILE // INT3_BLOCK, np.float32)
        for c in range(first, last):
            base = c * DECODE_TILE
            count = min(DECODE_TILE, n - base)
            whole = count // INT3_BLOCK
            total = out[base: base + count]
            for j in range(packed.shape[0]):
                codes = packed[j, base // 8 * 3: base // 8 * 3 + 3 * -(-count // 8)]
                scales = scale_codes[j, base // INT3_BLOCK: base // INT3_BLOCK + -(-count // 32)]
                e4m3_denominators(denoms, scales, tensor_scales[j])
                for b in range(whole):
                    int3_block(total[b * INT3_BLOCK: (b + 1) * INT3_BLOCK],
                               codes[b * 12: b * 12 + 12], denoms[b], j, from_zero)
                rest = count - whole * INT3_BLOCK
                for g in range(-(-rest // 8)):
                    word = int3_word(codes, whole * 12 + 3 * g)
                    for k in range(8):
                        tail[8 * g + k] = INT3_VALUES[(word >> (3 * k)) & 7] * denoms[whole]
                if rest:
                    add_payload(total[whole * INT3_BLOCK:], tail, j, from_zero, rest)
            if finish:
                top = max(top, owner_epilogue(total, residual[base: base + count], divisor,
                                              count, fold))
        return top

    return int3_accumulate


INT3_QUANTIZE = {(f, s): make_int3_quantize(f, s) for f in FEEDBACK for s in (False, True)}
INT3_ACCUMULATE = {(z, e): make_int3_accumulate(z, e) for z, e in VARIANTS}
