"""The native quantizers (numba): amax, then FP8 or NVFP4 codes, scales and the new error-feedback
residual in one pass over cache-sized tiles, bit for bit as fused.rotate_feedback_quantize_torch.
The loops are branchless where they touch every element (selects, not ifs), so LLVM vectorizes
them; a non-finite tensor never reaches them (formats.py sends it to the torch reference).

FEEDBACK, what a quantizer does with the error-feedback residual r: None, none; "add": it
quantizes y = x + r and leaves r <- y - values; "folded": x already is y (the pass that made x
added r, rounded as here) and r is only written."""
import numpy as np
from numba import njit

from .native_scalars import (E2M1, F0, F1, FOUR, FP8_FORMATS, HALF, INF, KERNEL, NVFP4_BLOCK,
                             RNE_MAGIC, SIX, TWO, block_divisor, e4m3_block_scale, encode_float,
                             magnitude_bits, uniform_hash)


def make_amax(add):
    @njit(**KERNEL)
    def feedback_amax(x, residual):
        """The largest magnitude_bits of x (+ r with add): >= INF_BITS where one is not
        finite."""
        top = np.int32(0)
        for j in range(x.size):
            top = max(top, magnitude_bits(x[j] + residual[j] if add else x[j]))
        return top

    return feedback_amax


AMAX_TILE = 4096
AMAX = {add: make_amax(add) for add in (False, True)}


# NVFP4 runs in chunks of CHUNK_BLOCKS blocks: the per-block work (amax, scale code, divisor)
# then runs as loops across the chunk's blocks, which LLVM vectorizes, instead of a serial
# chain of scalar operations every 16 elements (1.5-2x faster on the whole kernel).
CHUNK_BLOCKS = 32
CHUNK = CHUNK_BLOCKS * NVFP4_BLOCK


@njit(inline="always")
def block_maxima(y, pairs, quads, octets, maxima):
    """maxima[b] = the largest magnitude_bits over 16-block b of the CHUNK values y, as a tree
    of pairwise maxima: each level is a loop LLVM vectorizes, where a max over each block's 16
    lanes is a horizontal reduction per block (the whole kernel 1.1-1.2x slower, measured)."""
    for k in range(CHUNK // 2):
        pairs[k] = max(magnitude_bits(y[2 * k]), magnitude_bits(y[2 * k + 1]))
    for k in range(CHUNK // 4):
        quads[k] = max(pairs[2 * k], pairs[2 * k + 1])
    for k in range(CHUNK // 8):
        octets[k] = max(quads[2 * k], quads[2 * k + 1])
    for k in range(CHUNK_BLOCKS):
        maxima[k] = max(octets[2 * k], octets[2 * k + 1])


@njit(inline="always")
def nvfp4_quantize_chunk(y, codes, new_residual, scale_codes, scratch, tensor_scale, seed_term,
                         offset, feedback, stochastic):
    """Quantizes the CHUNK values y: E2M1 codes (sign in bit 3) into codes, E4M3 scale codes
    into scale_codes (nvfp4_quantize_blocks_torch), and with feedback y - values into
    new_residual (written straight there: a copy back from y costs 1.1x). scratch: the
    (pairs, quads, octets, maxima, denoms) buffers."""
    pairs, quads, octets, maxima, denoms = scratch
    block_maxima(y, pairs, quads, octets, maxima)
    for b in range(CHUNK_BLOCKS):
        amax = np.int32(maxima[b]).view(np.float32)
        scale_codes[b], denoms[b] = e4m3_block_scale(amax, tensor_scale, SIX)
    for b in range(CHUNK_BLOCKS):
        denom = denoms[b]
        divisor = block_divisor(denom)
        for i in range(NVFP4_BLOCK):
            j = b * NVFP4_BLOCK + i
            v = y[j] / divisor
            if stochastic:
                code, value = encode_float(v, uniform_hash(seed_term, offset + j), E2M1[0],
                                           E2M1[1], E2M1[2], E2M1[3], True)
            else:  # rounding.round_e2m1_nearest_torch, the value from the same units
                a = min(abs(v), SIX)
                low = a < TWO
                mid = a < FOUR
                units = (a * (TWO if low else (F1 if mid else HALF)) + RNE_MAGIC) - RNE_MAGIC
                magnitude = np.int32(units + (F0 if low else (TWO if mid else FOUR)))
                negative = (v < F0) & (magnitude > 0)
                code = magnitude + (np.int32(8) if negative else np.int32(0))
                value = units * (HALF if low else (F1 if mid else TWO))
                value = -value if negative else value
            codes[j] = np.uint8(code)
            if feedback:
                new_residual[j] = y[j] - value * denom


FEEDBACK = (None, "add", "folded")


def make_nvfp4_quantize(feedback_mode, stochastic):
    add, feedback = feedback_mode == "add", feedback_mode is not None

    @njit(**KERNEL)
    def nvfp4_quantize(x, residual, packed, scale_codes, tensor_scale, seed_term, offset):
        """Finite x (+ r, FEEDBACK), element 0 at index offset of the tensor (a multiple of
        16): E2M1 codes packed two a byte (even element low), E4M3 scale codes, r <- y - values.
        The last chunk runs zero-padded, as blocks_torch pads the last block."""
        n = x.size
        y = np.empty(CHUNK, np.float32)
        tail_residual = np.empty(CHUNK if feedback else 0, np.float32)
        codes = np.empty(CHUNK, np.uint8)
        # two codes read as one uint16 (little-endian on every numba target) pack with one
        # vector shift and mask
        code_pairs = codes.view(np.uint16)
        chunk_scales = np.empty(CHUNK_BLOCKS, np.int32)
        scratch = (np.empty(CHUNK // 2, np.int32), np.empty(CHUNK // 4, np.int32),
                   np.empty(CHUNK // 8, np.int32), np.empty(CHUNK_BLOCKS, np.int32),
                   np.empty(CHUNK_BLOCKS, np.float32))
        for c in range(-(-n // CHUNK)):
            base = c * CHUNK
            count = min(CHUNK, n - base)
            # views indexed from 0: LLVM vectorizes them, not an index plus an offset
            xs, rs = x[base: base + count], residual[base: base + count]
            if count == CHUNK and not add:  # x already is y: quantized where it lies
                nvfp4_quantize_chunk(xs, codes, rs, chunk_scales, scratch, tensor_scale,
                                     seed_term, offset + base, feedback, stochastic)
            elif count == CHUNK:
                for i in range(CHUNK):
                    y[i] = xs[i] + rs[i]
                nvfp4_quantize_chunk(y, codes, rs, chunk_scales, scratch, tensor_scale,
                                     seed_term, offset + base, feedback, stochastic)
            else:
                y[:] = F0
                for i in range(count):
                    y[i] = xs[i] + rs[i] if add else xs[i]
                nvfp4_quantize_chunk(y, codes, tail_residual, chunk_scales, scratch,
                                     tensor_scale, seed_term, offset + base, feedback, stochastic)
                if feedback:
                    for i in range(count):
                        rs[i] = tail_residual[i]
            out = packed[base // 2: base // 2 + (count + 1) // 2]
            for i in range((count + 1) // 2):
                pair = code_pairs[i]
                low, high = pair & np.uint16(0x0F), (pair >> np.uint16(4)) & np.uint16(0xF0)
                out[i] = np.uint8(low | high)
            for b in range(-(-count // NVFP4_BLOCK)):
                scale_codes[base // NVFP4_BLOCK + b] = chunk_scales[b]

    return nvfp4_quantize


def make_fp8_quantize(feedback_mode, stochastic, per_tensor, fmt):
    ebits, mbits, bias, largest = fmt
    add, feedback = feedback_mode == "add", feedback_mode is not None

    @njit(**KERNEL)
    def fp8_quantize(x, residual, codes, scales, tensor_scale, block, seed_term, offset):
        """Blocks of finite x (+ r, FEEDBACK), element 0 at index offset of the tensor: fp8
        codes, the fp32 scale of each block (per tensor: block is only a tile, all share
        tensor_scale), r <- y - values (fp8_encode_torch, fused.quantize_stage). y = x + r is
        recomputed where it is needed rather than kept in a buffer: one load and store fewer per
        element (1.6x)."""
        n = x.size
        for blk in range(-(-n // block)):
            base = blk * block
            count = min(block, n - base)
            # views indexed from 0: LLVM vectorizes them, not an index plus an offset
            xs, rs = x[base: base + count], residual[base: base + count]
            out = codes[base: base + count]
            if per_tensor:
                scale = tensor_scale
            else:
                top = np.int32(0)
                for i in range(count):
                    top = max(top, magnitude_bits(xs[i] + rs[i] if add else xs[i]))
                scale = np.int32(top).view(np.float32) / largest
                scales[blk] = scale
            usable = scale > F0 and scale < INF
            divisor = scale if usable else F1
            for i in range(count):
                y = xs[i] + rs[i] if add else xs[i]
                v = y / divisor if usable else F0
                noise = uniform_hash(seed_term, offset + base + i) if stochastic else F0
                code, value = encode_float(v, noise, ebits, mbits, bias, largest, stochastic)
                out[i] = code
                if feedback:
                    rs[i] = y - value * scale

    return fp8_quantize


NVFP4_QUANTIZE = {(f, s): make_nvfp4_quantize(f, s) for f in FEEDBACK for s in (False, True)}
FP8_QUANTIZE = {(f, s, t, name): make_fp8_quantize(f, s, t, fmt) for f in FEEDBACK
                for s in (False, True) for t in (False, True)
                for name, fmt in FP8_FORMATS.items()}
