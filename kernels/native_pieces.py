"""Many pieces of one tensor in one native call (numba): a bucket's pieces are (chunk, tensor)
parts, P of them per tensor at P ranks, and a call per piece costs ~100 us of Python; these
drivers loop over a tensor's pieces inside one compiled function, running on each the same
kernels as native.quantize_native / native.accumulate_native on that piece alone, so the same
bits. Each piece has its own scales and payload, at its own offset of a byte buffer:

    encode:  payload of piece p = Q(x[starts[p]:ends[p]] (+ r)) at out[offsets[p]:]
    decode:  out[starts[p]:ends[p]] = D(payload at buf[offsets[p]:])

Payload layout as formats.payload_layout: NVFP4 or INT3 codes, E4M3 scale codes, fp32 tensor
scale; FP8 codes, fp32 scales. A piece whose input is not finite is left alone and reported (its
largest magnitude_bits >= INF_BITS): the caller runs the reference on it, as quantize_native's
callers do.
"""
import numpy as np
from numba import njit

from .native import SCALED
from .native_decode import DECODE_TILE, FP8_ACCUMULATE, FP8_TILE, NVFP4_ACCUMULATE
from .native_int3 import INT3_ACCUMULATE
from .native_quantize import AMAX, FP8_QUANTIZE
from .native_scalars import F0, F1, FP8_FORMATS, INF_BITS, KERNEL

# The drivers call kernels held in closure cells, and numba's on-disk cache keys a function by its
# pickled closure, which holds those dispatchers' per-process ids: every process missed the cache
# and wrote a new entry (hundreds of MB over many runs). They are loops around the cached
# kernels, compiled in each process instead.
DRIVER = dict(KERNEL, cache=False)


def make_encode_pieces(fmt_name, per_tensor, feedback_mode, stochastic):
    """encode(x, r, starts, ends, out, offsets, terms, maxima, found, block): terms, each piece's
    rounding-hash term; maxima, with feedback "folded", each piece's largest magnitude_bits of
    x (x already is y = x + r); found <- each piece's largest magnitude_bits."""
    add, folded = feedback_mode == "add", feedback_mode == "folded"
    amax = AMAX[add]
    # NVFP4 and INT3: E4M3 block scales of a fixed block, codes packed two a byte or 8 in 3
    scaled, int3 = fmt_name in SCALED, fmt_name == "int3"
    if scaled:
        block_elements, largest, quantizers, _ = SCALED[fmt_name]
        quantize = quantizers[feedback_mode, stochastic]
    else:
        quantize = FP8_QUANTIZE[feedback_mode, stochastic, per_tensor, fmt_name]
        largest = FP8_FORMATS[fmt_name][3]
        block_elements = 1      # unused, but numba freezes every free name

    @njit(**DRIVER)
    def encode(x, r, starts, ends, out, offsets, terms, maxima, found, block):
        box = np.empty(1, np.int32)         # bit casts of one value through an array
        for p in range(starts.size):
            lo, hi = starts[p], ends[p]
            xs, rs = x[lo:hi], r[lo:hi]
            top = maxima[p] if folded else amax(xs, rs)
            found[p] = top
            if top >= INF_BITS:
                continue
            box[0] = top
            m, o = hi - lo, offsets[p]
            if scaled:
                tensor_scale = box.view(np.float32)[0] / largest
                c = 3 * -(-m // 8) if int3 else (m + 1) // 2
                blocks = -(-m // block_elements)
                quantize(xs, rs, out[o: o + c], out[o + c: o + c + blocks], tensor_scale,
                         terms[p], 0)
                box.view(np.float32)[0] = tensor_scale
                out[o + c + blocks: o + c + blocks + 4] = box.view(np.uint8)
            else:
                if per_tensor:
                    tensor_scale, tile = box.view(np.float32)[0] / largest, FP8_TILE
                    scales = np.full(1, tensor_scale, np.float32)
                else:
                    tensor_scale, tile = F0, block
                    scales = np.zeros(-(-m // block), np.float32)
                quantize(xs, rs, out[o: o + m], scales, tensor_scale, tile, terms[p], 0)
                out[o + m: o + m + 4 * scales.size] = scales.view(np.uint8)

    return encode


def make_decode_pieces(fmt_name, per_tensor):
    """decode(buf, offsets, starts, ends, out, block): every piece's payload decoded into out."""
    scaled, int3 = fmt_name in SCALED, fmt_name == "int3"
    block_elements = SCALED[fmt_name][0] if scaled else 1   # numba freezes every free name
    if scaled:
        kernel = (INT3_ACCUMULATE if int3 else NVFP4_ACCUMULATE)[False, None]
    else:
        kernel = FP8_ACCUMULATE[False, None, per_tensor, fmt_name]

    @njit(**DRIVER)
    def decode(buf, offsets, starts, ends, out, block):
        tensor_scale = np.empty(1, np.float32)
        for p in range(starts.size):
            lo, hi = starts[p], ends[p]
            m, o = hi - lo, offsets[p]
            y = out[lo:hi]
            if scaled:
                c = 3 * -(-m // 8) if int3 else (m + 1) // 2
                blocks = -(-m // block_elements)
                tensor_scale.view(np.uint8)[:] = buf[o + c + blocks: o + c + blocks + 4]
                kernel(buf[o: o + c].reshape(1, c), buf[o + c: o + c + blocks].reshape(1, blocks),
                       tensor_scale, y, y, F1, 0, -(-m // DECODE_TILE))
            else:
                count = 1 if per_tensor else -(-m // block)
                scales = np.empty(count, np.float32)
                scales.view(np.uint8)[:] = buf[o + m: o + m + 4 * count]
                tile = FP8_TILE if per_tensor else block * max(1, FP8_TILE // block)
                kernel(buf[o: o + m].reshape(1, m), scales.reshape(1, count), block, y, y, F1,
                       0, -(-m // tile))

    return decode


_ENCODERS, _DECODERS = {}, {}


def encode_pieces(x, r, starts, ends, out, offsets, seeds, maxima, fmt_name, block_size,
                  stochastic):
    """The drivers' entry point on numpy arrays: x fp32; r fp32 or None (no feedback); starts,
    ends, offsets, seeds int64; maxima int32 or None (else feedback is "folded"). Returns
    found."""
    per_tensor = block_size is None
    feedback = None if r is None else ("add" if maxima is None else "folded")
    key = (fmt_name, per_tensor, feedback, stochastic)
    if key not in _ENCODERS:
        _ENCODERS[key] = make_encode_pieces(*key)
    pieces = starts.size
    # quantize_native's term of each seed (a multiple of the golden ratio, mod 2**32)
    terms = (seeds.astype(np.uint64) * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    found = np.zeros(pieces, np.int32)
    _ENCODERS[key](x, x if r is None else r, starts, ends, out, offsets, terms,
                   np.zeros(pieces, np.int32) if maxima is None else maxima, found,
                   block_size or 1)
    return found


def decode_pieces(buf, offsets, starts, ends, out, fmt_name, block_size):
    """decode's entry point: buf uint8, out fp32 (numpy arrays)."""
    key = (fmt_name, block_size is None)
    if key not in _DECODERS:
        _DECODERS[key] = make_decode_pieces(*key)
    _DECODERS[key](buf, offsets, starts, ends, out, block_size or 1)

