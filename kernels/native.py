"""Native CPU kernels (numba): the codec's passes over memory, each in one loop over cache-sized
tiles, with the torch references' fp32 arithmetic operation for operation, so the same bits.

    rotate:      y = H_B (D x) / sqrt(B)  or its inverse, in the layout of hadamard.py
    quantize:    y = x + r;  codes, scales = Q(y);  r <- y - dequantize(codes, scales)
    decode:      out = dequantize(codes, scales)
    accumulate:  out = sum over j = 0..k-1 of dequantize(payload j), added in that order

Why numba and not a C++ extension: it compiles at import (cached on disk, ~1 s a process after
the first), needs no compiler at `pip install` on a GPU cluster where the CPU path is a fallback,
and its LLVM code is IEEE fp32 without fastmath: no contraction of a * b + c into a fused
multiply-add, which would round once where the references round twice.

Exactness rules the code follows: every constant is an np.float32 (a Python float would turn
the arithmetic into fp64), bit casts are scalar `.view`s, decoding reads tables made by torch's
own fp8 casts, and rounding to nearest even adds and subtracts 1.5 * 2**23 in fp32 as the
references do. The loops are branchless where they touch every element (selects, not ifs), so
LLVM vectorizes them; a non-finite tensor never reaches them (formats.py sends it to the torch
reference, whose NaN conventions it keeps).

Each kernel takes a range [first, last) of its tiles: formats.py splits a large tensor across
threads (the kernels release the GIL), and every split gives the same bits (no reduction crosses
a tile except amax, and max is exact).
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from .hadamard import LANES, normalizer

F0 = np.float32(0.0)
F1 = np.float32(1.0)
HALF = np.float32(0.5)
TWO = np.float32(2.0)
FOUR = np.float32(4.0)
SIX = np.float32(6.0)
EIGHT = np.float32(8.0)
INF = np.float32(np.inf)
RNE_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds 0 <= v < 2**22 to even
HASH_UNIT = np.float32(5.9604644775390625e-08)  # 2**-24
NVFP4_BLOCK = 16
E4M3 = (4, 3, 7, np.float32(448.0))  # (exponent bits, mantissa bits, bias, largest value)
E5M2 = (5, 2, 15, np.float32(57344.0))
E2M1 = (2, 1, 1, np.float32(6.0))
KERNEL = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)


# ---------------------------------------------------------------- scalar helpers
@njit(inline="always")
def pow2(e):
    """2**e as fp32 for an integer e in [-126, 127], built from its bits."""
    return np.int32((e + 127) << 23).view(np.float32)


@njit(inline="always")
def uniform_hash(seed_term, index):
    """rounding.uniform_hash: a uniform fp32 in [0, 1) for an element index. seed_term is
    (seed * 0x9E3779B9) mod 2**32, computed once by the caller."""
    m = np.uint64(0xFFFFFFFF)
    h = (np.uint64(index) & m) ^ seed_term
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & m
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & m
    h = h ^ (h >> np.uint64(15))
    return np.float32(h >> np.uint64(8)) * HASH_UNIT


@njit(inline="always")
def encode_float(v, noise, ebits, mbits, bias, largest, stochastic):
    """rounding.encode_float: (code, value) of a finite fp32 value, the code's sign in bit
    ebits + mbits, value what decode_float gives for that code (+0 for code 0). The rounded
    magnitude is already that value, so the quantizers' residuals need no decoding."""
    sign = (np.float32(v).view(np.int32) >> 31) & 1
    a = abs(v)
    e = max(((np.float32(a).view(np.int32) >> 23) & 0xFF) - 127, 1 - bias)
    units = a * pow2(mbits - e)  # exact: a power-of-two scaling
    if stochastic:
        whole = np.float32(np.floor(units))
        rounded = whole + (F1 if noise < units - whole else F0)
    else:
        rounded = (units + RNE_MAGIC) - RNE_MAGIC
    q = min(rounded * pow2(e - mbits), largest)
    qbits = np.float32(q).view(np.int32)
    qe = (qbits >> 23) - 127
    normal = ((qe + bias) << mbits) | ((qbits >> (23 - mbits)) & ((1 << mbits) - 1))
    subnormal = np.int32(q * pow2(mbits - 1 + bias))
    code = normal if qe >= 1 - bias else subnormal
    nonzero = code != 0
    signed_code = np.int32(code | (sign << (ebits + mbits)) if nonzero else 0)
    value = np.int32(qbits | (sign << 31) if nonzero else 0).view(np.float32)
    return signed_code, value


@njit(inline="always")
def decode_float(code, ebits, mbits, bias):
    """rounding.decode_float: the fp32 value of a code."""
    sign = (code >> (ebits + mbits)) & 1
    ef = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    normal = np.int32(((ef - bias + 127) << 23) | (m << (23 - mbits))).view(np.float32)
    value = normal if ef > 0 else np.float32(m) * pow2(1 - bias - mbits)
    return np.int32(np.float32(value).view(np.int32) | (sign << 31)).view(np.float32)


# ---------------------------------------------------------------- rotation
def make_rotate(lanes, inverse):
    """A kernel rotating x (a whole number of spans) into out: spans of block * lanes elements,
    entry i of block c at i * lanes + c. The butterflies are hadamard_rows_torch's, strides 1, 2,
    4, ... in that order, two at a time (radix 4: the same additions in the same order, half
    the passes over the span). Each stage reads one buffer and writes the other, through views
    indexed from 0: in place, LLVM cannot rule out that a store feeds a later load at a
    distance it does not know, and leaves the butterflies scalar (1.6x slower). out may be x."""

    @njit(**KERNEL)
    def rotate_spans(x, signs, out, block, norm):
        span = block * lanes
        source = np.empty(span, np.float32)
        target = np.empty(span, np.float32)
        for s in range(x.size // span):
            xs = x[s * span: (s + 1) * span]
            ds = signs[s * span: (s + 1) * span]
            ys = out[s * span: (s + 1) * span]
            for j in range(span):
                source[j] = xs[j] if inverse else xs[j] * np.float32(ds[j])
            w = lanes  # the distance between the two entries of a butterfly, in elements
            while 4 * w <= span:
                for g in range(0, span, 4 * w):
                    a, b = source[g: g + w], source[g + w: g + 2 * w]
                    c, d = source[g + 2 * w: g + 3 * w], source[g + 3 * w: g + 4 * w]
                    ta, tb = target[g: g + w], target[g + w: g + 2 * w]
                    tc, td = target[g + 2 * w: g + 3 * w], target[g + 3 * w: g + 4 * w]
                    for j in range(w):
                        ab, a_b = a[j] + b[j], a[j] - b[j]
                        cd, c_d = c[j] + d[j], c[j] - d[j]
                        ta[j], tb[j] = ab + cd, a_b + c_d
                        tc[j], td[j] = ab - cd, a_b - c_d
                source, target = target, source
                w *= 4
            if w < span:  # an odd number of stages: the last alone
                a, b, ta, tb = source[:w], source[w: 2 * w], target[:w], target[w: 2 * w]
                for j in range(w):
                    ta[j], tb[j] = a[j] + b[j], a[j] - b[j]
                source, target = target, source
            for j in range(span):
                ys[j] = (source[j] * norm) * np.float32(ds[j]) if inverse else source[j] * norm

    return rotate_spans


ROTATE = {(lanes, inverse): make_rotate(lanes, inverse) for lanes in (1, LANES)
          for inverse in (False, True)}


# ---------------------------------------------------------------- quantization
MAGNITUDE_BITS = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)


@njit(inline="always")
def magnitude_bits(v):
    """The bits of |v| as an int32: ordered as |v| is for every non-NaN v, and a NaN or inf is
    >= INF_BITS. A max over them is an integer reduction, which LLVM vectorizes; a float max,
    with its NaN rules, stays scalar."""
    return np.float32(v).view(np.int32) & MAGNITUDE_BITS


def make_amax(feedback):
    @njit(**KERNEL)
    def feedback_amax(x, residual):
        """max |x + r|, and whether any element is not finite."""
        top = np.int32(0)
        for j in range(x.size):
            top = max(top, magnitude_bits(x[j] + residual[j] if feedback else x[j]))
        return np.int32(top).view(np.float32), top >= INF_BITS

    return feedback_amax


AMAX_TILE = 4096
AMAX = {feedback: make_amax(feedback) for feedback in (False, True)}


# NVFP4 runs in chunks of CHUNK_BLOCKS blocks: the per-block work (amax, scale code, divisor)
# then runs as loops across the chunk's blocks, which LLVM vectorizes, instead of a serial
# chain of scalar operations every 16 elements (1.5-2x faster on the whole kernel).
CHUNK_BLOCKS = 16
CHUNK = CHUNK_BLOCKS * NVFP4_BLOCK


@njit(inline="always")
def nvfp4_quantize_chunk(y, codes, scale_codes, denoms, tensor_scale, seed_term, offset,
                         stochastic):
    """Quantizes the CHUNK values y in place into their residuals y - values; E2M1 codes (sign
    in bit 3) into codes, E4M3 scale codes into scale_codes (nvfp4_quantize_blocks_torch);
    denoms: scratch of CHUNK_BLOCKS."""
    t_usable = tensor_scale > F0 and tensor_scale < INF
    for b in range(CHUNK_BLOCKS):
        top = np.int32(0)
        for i in range(NVFP4_BLOCK):
            top = max(top, magnitude_bits(y[b * NVFP4_BLOCK + i]))
        amax = np.int32(top).view(np.float32)
        ratio = min(amax / (tensor_scale * SIX), E4M3[3]) if t_usable else F0
        scale_codes[b], scale = encode_float(ratio, ratio, E4M3[0], E4M3[1], E4M3[2], E4M3[3],
                                             False)
        denoms[b] = scale * tensor_scale
    for b in range(CHUNK_BLOCKS):
        denom = denoms[b]
        divisor = denom if (denom > F0 and denom < INF) else INF
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
            codes[j] = code
            y[j] = y[j] - value * denom


def make_nvfp4_quantize(feedback, stochastic):
    @njit(**KERNEL)
    def nvfp4_quantize(x, residual, packed, scale_codes, tensor_scale, seed_term, offset):
        """Finite x (+ r), element 0 at index offset of the tensor (a multiple of 16): E2M1
        codes packed two a byte (even element low), E4M3 scale codes, r <- y - values. The last
        chunk runs zero-padded, as blocks_torch pads the last block."""
        n = x.size
        y = np.empty(CHUNK, np.float32)
        codes = np.empty(CHUNK, np.int32)
        chunk_scales = np.empty(CHUNK_BLOCKS, np.int32)
        denoms = np.empty(CHUNK_BLOCKS, np.float32)
        for c in range(-(-n // CHUNK)):
            base = c * CHUNK
            count = min(CHUNK, n - base)
            if count < CHUNK:
                y[:] = F0
            for i in range(count):
                y[i] = x[base + i] + residual[base + i] if feedback else x[base + i]
            nvfp4_quantize_chunk(y, codes, chunk_scales, denoms, tensor_scale, seed_term,
                                 offset + base, stochastic)
            if feedback:
                for i in range(count):
                    residual[base + i] = y[i]
            for i in range((count + 1) // 2):
                packed[base // 2 + i] = codes[2 * i] | (codes[2 * i + 1] << 4)
            for b in range(-(-count // NVFP4_BLOCK)):
                scale_codes[base // NVFP4_BLOCK + b] = chunk_scales[b]

    return nvfp4_quantize


def make_fp8_quantize(feedback, stochastic, per_tensor, fmt):
    ebits, mbits, bias, largest = fmt

    @njit(**KERNEL)
    def fp8_quantize(x, residual, codes, scales, tensor_scale, block, seed_term, offset):
        """Blocks of finite x (+ r), element 0 at index offset of the tensor: fp8 codes, the
        fp32 scale of each block (per tensor: block is only a tile, all share tensor_scale),
        r <- y - values (fp8_encode_torch, fused.quantize_stage). y = x + r is recomputed where
        it is needed rather than kept in a buffer: one load and store fewer per element (1.6x)."""
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
                    top = max(top, magnitude_bits(xs[i] + rs[i] if feedback else xs[i]))
                scale = np.int32(top).view(np.float32) / largest
                scales[blk] = scale
            usable = scale > F0 and scale < INF
            divisor = scale if usable else F1
            for i in range(count):
                y = xs[i] + rs[i] if feedback else xs[i]
                v = y / divisor if usable else F0
                noise = uniform_hash(seed_term, offset + base + i) if stochastic else F0
                code, value = encode_float(v, noise, ebits, mbits, bias, largest, stochastic)
                out[i] = code
                if feedback:
                    rs[i] = y - value * scale

    return fp8_quantize


FP8_FORMATS = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
NVFP4_QUANTIZE = {(f, s): make_nvfp4_quantize(f, s) for f in (False, True) for s in (False, True)}
FP8_QUANTIZE = {(f, s, t, name): make_fp8_quantize(f, s, t, fmt) for f in (False, True)
                for s in (False, True) for t in (False, True)
                for name, fmt in FP8_FORMATS.items()}


# ---------------------------------------------------------------- decoding
# The value of each E2M1 code (sign in bit 3). A byte's two codes are looked up in this
# 16-entry table, which stays in registers: 4x faster than arithmetic decoding or a 256-entry
# table of pairs.
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
def nvfp4_values(codes, denoms, values, count):
    """values[:count] = the E2M1 values of packed codes times their block's denominator: whole
    blocks in fixed loops of 8 bytes (which vectorize), the last partial block element by
    element."""
    whole = count // NVFP4_BLOCK
    for b in range(whole):
        denom = denoms[b]
        block_codes = codes[b * 8: b * 8 + 8]
        block_values = values[b * NVFP4_BLOCK: (b + 1) * NVFP4_BLOCK]
        for i in range(8):
            byte = block_codes[i]
            block_values[2 * i] = E2M1_VALUES[byte & 15] * denom
            block_values[2 * i + 1] = E2M1_VALUES[byte >> 4] * denom
    for i in range(whole * NVFP4_BLOCK, count):
        code = (codes[i >> 1] >> ((i & 1) * 4)) & 15
        values[i] = E2M1_VALUES[code] * denoms[whole]


def make_nvfp4_accumulate(from_zero):
    @njit(**KERNEL)
    def nvfp4_accumulate(packed, scale_codes, tensor_scales, out, first, last):
        """out[chunks first..last-1] = the fp32 sum in order of k NVFP4 payloads: packed
        (k, bytes), scale_codes (k, blocks), tensor_scales (k,). from_zero: the sum starts at +0
        (fused.accumulate_stage); otherwise at the first payload (decode)."""
        n = out.size
        values = np.empty(DECODE_TILE, np.float32)
        denoms = np.empty(DECODE_TILE // NVFP4_BLOCK, np.float32)
        for c in range(first, last):
            base = c * DECODE_TILE
            count = min(DECODE_TILE, n - base)
            blocks = -(-count // NVFP4_BLOCK)
            for j in range(packed.shape[0]):
                codes = packed[j, base // 2: base // 2 + (count + 1) // 2]
                scales = scale_codes[j, base // NVFP4_BLOCK: base // NVFP4_BLOCK + blocks]
                for b in range(blocks):
                    denoms[b] = decode_float(np.int32(scales[b]), E4M3[0], E4M3[1],
                                             E4M3[2]) * tensor_scales[j]
                nvfp4_values(codes, denoms, values, count)
                add_payload(out[base: base + count], values, j, from_zero, count)

    return nvfp4_accumulate


def make_fp8_accumulate(from_zero, per_tensor, fmt):
    ebits, mbits, bias, _ = fmt

    @njit(**KERNEL)
    def fp8_accumulate(codes, scales, block, out, first, last):
        """out[tiles first..last-1] = the fp32 sum in order of k FP8 payloads: codes (k, >= n),
        scales (k, blocks), or (k, 1) per tensor; a tile is whole blocks (per tensor: any
        4096 elements); from_zero as in nvfp4_accumulate."""
        n = out.size
        tile = FP8_TILE if per_tensor else block * max(1, FP8_TILE // block)
        values = np.empty(tile, np.float32)
        for t in range(first, last):
            base = t * tile
            count = min(tile, n - base)
            for j in range(codes.shape[0]):
                row = codes[j, base: base + count]
                for i in range(count):
                    values[i] = decode_float(np.int32(row[i]), ebits, mbits, bias)
                if per_tensor:
                    for i in range(count):
                        values[i] *= scales[j, 0]
                else:  # whole blocks: the tail's extra values are never added to out
                    for b in range(-(-count // block)):
                        scale = scales[j, base // block + b]
                        for i in range(block):
                            values[b * block + i] *= scale
                add_payload(out[base: base + count], values, j, from_zero, count)

    return fp8_accumulate


# Elements of an NVFP4 decoding tile (a multiple of 16)
DECODE_TILE = 4096
# Elements of an FP8 tile: the decoded values of one payload stay in L1 while they are added.
FP8_TILE = 4096
NVFP4_ACCUMULATE = {z: make_nvfp4_accumulate(z) for z in (False, True)}
FP8_ACCUMULATE = {(z, t, name): make_fp8_accumulate(z, t, fmt) for z in (False, True)
                  for t in (False, True) for name, fmt in FP8_FORMATS.items()}


# ---------------------------------------------------------------- wrappers (flat CPU tensors)
# Below this many elements a tensor runs on the calling thread: a thread hand-off costs ~20 us.
THREAD_MIN_ELEMENTS = 1 << 18
_pool = None


def run_tiles(kernel, tiles, tile_elements, arguments):
    """kernel(*arguments(first, last)) for tiles first..last-1 of 0..tiles-1, split across
    torch.get_num_threads() threads for a large tensor; the results of the pieces in order.
    arguments slices the arrays to the tiles: the kernels index from 0, which lets LLVM prove
    their indices non-negative and vectorize (an offset added to the index halves the speed)."""
    threads = min(torch.get_num_threads(), tiles)
    if threads <= 1 or tiles * tile_elements < THREAD_MIN_ELEMENTS:
        return [kernel(*arguments(0, tiles))]
    global _pool
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="horovod_gift")
    bounds = [tiles * t // threads for t in range(threads + 1)]
    futures = [_pool.submit(kernel, *arguments(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    return [f.result() for f in futures]


def rotate_native(flat, pieces, signs, inverse, out):
    """The rotation of flat fp32 data into out (may be flat): pieces are hadamard.segments'
    (start, length, block, lanes); signs int8, one per element of flat."""
    x, y, d = flat.numpy(), out.numpy(), signs.numpy()
    for start, length, block, lanes in pieces:
        span, norm = block * lanes, np.float32(normalizer(block))

        def arguments(first, last, start=start, span=span, block=block, norm=norm):
            part = slice(start + first * span, start + last * span)
            return x[part], d[part], y[part], block, norm

        run_tiles(ROTATE[lanes, inverse], length // span, span, arguments)
    return out


def quantize_native(flat, residual, fmt_name, block_size, seed, stochastic):
    """(codes, scales, tensor_scale) of flat fp32 (+ residual, updated in place), as
    fused.rotate_feedback_quantize_torch without rotation; None, touching nothing, when
    flat (+ residual) holds a non-finite value (the caller then runs the reference)."""
    n, device = flat.numel(), flat.device
    x = flat.numpy()
    feedback = residual is not None
    r = residual.numpy() if feedback else x

    def amax_arguments(first, last):
        part = slice(first * AMAX_TILE, last * AMAX_TILE)
        return x[part], r[part]

    amax, bad = F0, False
    for part_amax, part_bad in run_tiles(AMAX[feedback], -(-n // AMAX_TILE), AMAX_TILE,
                                         amax_arguments):
        amax, bad = max(amax, part_amax), bad or part_bad
    if bad:
        return None
    term = np.uint64((int(seed) * 0x9E3779B9) & 0xFFFFFFFF)
    if fmt_name == "nvfp4":
        tensor_scale = np.float32(amax) / np.float32(E2M1[3] * E4M3[3])
        blocks = -(-n // NVFP4_BLOCK)
        packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=device)
        scale_codes = torch.empty(blocks, dtype=torch.uint8, device=device)
        c, sc = packed.numpy(), scale_codes.numpy()

        def arguments(first, last):
            part = slice(first * CHUNK, last * CHUNK)
            return (x[part], r[part], c[first * CHUNK // 2: last * CHUNK // 2],
                    sc[first * CHUNK_BLOCKS: last * CHUNK_BLOCKS], tensor_scale, term,
                    first * CHUNK)

        run_tiles(NVFP4_QUANTIZE[feedback, stochastic], -(-n // CHUNK), CHUNK, arguments)
        return packed, scale_codes, torch.tensor([tensor_scale], device=device)
    per_tensor = block_size is None
    tensor_scale = np.float32(amax) / FP8_FORMATS[fmt_name][3] if per_tensor else F0
    block = FP8_TILE if per_tensor else block_size
    blocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.uint8, device=device)
    scales = torch.full((1 if per_tensor else blocks,), float(tensor_scale), device=device)
    c, sc = codes.numpy(), scales.numpy()

    def fp8_arguments(first, last):
        part = slice(first * block, last * block)
        return (x[part], r[part], c[part], sc if per_tensor else sc[first:last], tensor_scale,
                block, term, first * block)

    run_tiles(FP8_QUANTIZE[feedback, stochastic, per_tensor, fmt_name], blocks, block,
              fp8_arguments)
    return codes, scales, None


def accumulate_native(codes, scales, tensor_scales, n, fmt_name, block_size, out, from_zero):
    """The fp32 sum in order of k payloads (codes (k, bytes), scales (k, ...), tensor_scales (k,)
    or None) into out (n contiguous fp32 elements); from_zero as in nvfp4_accumulate."""
    c, sc, y = codes.contiguous().numpy(), scales.contiguous().numpy(), out.numpy()
    if fmt_name == "nvfp4":
        kernel, tile, extra = NVFP4_ACCUMULATE[from_zero], DECODE_TILE, (tensor_scales.numpy(),)
    else:
        per_tensor = block_size is None
        kernel = FP8_ACCUMULATE[from_zero, per_tensor, fmt_name]
        tile = FP8_TILE if per_tensor else block_size * max(1, FP8_TILE // block_size)
        extra = (block_size or 1,)
    run_tiles(kernel, -(-n // tile), tile, lambda first, last: (c, sc, *extra, y, first, last))
    return out
