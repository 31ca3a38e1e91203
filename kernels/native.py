"""Native CPU kernels (numba): the codec's passes over memory, each in one loop over cache-sized
tiles, with the torch references' fp32 arithmetic operation for operation, so the same bits.

    rotate:      y = H_B (D x) / sqrt(B)  or its inverse, in the layout of hadamard.py
    quantize:    y = x + r;  codes, scales = Q(y);  r <- y - dequantize(codes, scales)
    decode:      out = dequantize(codes, scales)
    accumulate:  out = sum over j = 0..k-1 of dequantize(payload j), added in that order

Where a pass makes the quantizer's input, it also adds the residual and finds the amax: the
forward rotation (rotate_fold_native: y = H_B (D x) / sqrt(B) + r, each piece's amax) and the
owner's sum (accumulate_native's epilogue: y = sum / n + r); the quantizer then reads y alone
("folded", native_quantize.FEEDBACK).

The kernels: native_rotate.py, native_quantize.py, native_decode.py, native_int3.py (INT3's
quantizer and decoder), with the scalar arithmetic
they share in native_scalars.py (its docstring gives the exactness rules); this module holds the
wrappers formats.py and rotation.py call on flat CPU tensors.

Why numba and not a C++ extension: it compiles at import (cached on disk, ~1 s a process after
the first), needs no compiler at `pip install` on a GPU cluster where the CPU path is a fallback,
and its LLVM code is IEEE fp32 without fastmath: no contraction of a * b + c into a fused
multiply-add, which would round once where the references round twice.

run_tiles splits a large tensor across threads at tile boundaries (the kernels release the
GIL; each gets its slices, or, for the decoders, a range [first, last) of tiles), and every split
gives the same bits: no reduction crosses a tile except amax (a piece's too), and max is exact.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba.core import event

from .fused import code_bytes
from .hadamard import normalizer
from .native_decode import DECODE_TILE, FP8_ACCUMULATE, FP8_TILE, NVFP4_ACCUMULATE
from .native_int3 import INT3_ACCUMULATE, INT3_BLOCK, INT3_DIVISOR, INT3_QUANTIZE
from .native_quantize import AMAX, AMAX_TILE, CHUNK, FP8_QUANTIZE, NVFP4_QUANTIZE
from .native_rotate import ROTATE
from .native_scalars import E2M1, E4M3, F0, FP8_FORMATS, INF_BITS, NVFP4_BLOCK


class CompileCount(event.Listener):
    """How many functions numba has compiled in this process (`count`). A compilation leaves its
    callers' frames, and the tensors they hold, in a reference cycle (a typing error it caught)
    that only Python's cycle collector frees: GIFT collects after a step that compiled."""

    count = 0

    def on_start(self, event):
        pass

    def on_end(self, event):
        CompileCount.count += 1


event.register("numba:compile", CompileCount())

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
    _rotate(flat, pieces, signs, inverse, out, None, ENDS)
    return out


def rotate_fold_native(flat, pieces, signs, residual, ends, out):
    """out <- the forward rotation of flat + residual, as rotate_native; returns the largest
    magnitude_bits of out over each piece [ends[k - 1], ends[k]) of flat (np.int32; ends
    ascending, the last flat's size): INF_BITS and above for a piece that is not finite."""
    return _rotate(flat, pieces, signs, False, out, residual, np.asarray(ends, np.int64))


ENDS = np.zeros(0, np.int64)  # the ends of no piece: a rotation without a residual


def _rotate(flat, pieces, signs, inverse, out, residual, ends):
    x, y, d = flat.numpy(), out.numpy(), signs.numpy()
    fold = residual is not None
    r = residual.numpy() if fold else x
    maxima = np.zeros(ends.size, np.int32)
    for start, length, block, lanes in pieces:
        span, norm = block * lanes, np.float32(normalizer(block))

        def arguments(first, last, start=start, span=span, block=block, norm=norm):
            begin = start + first * span
            part = slice(begin, start + last * span)
            return x[part], d[part], y[part], block, norm, r[part], ends - begin

        for part in run_tiles(ROTATE[lanes, inverse, fold], length // span, span, arguments):
            np.maximum(maxima, part, out=maxima)
    return maxima


def quantize_native(flat, residual, fmt_name, block_size, seed, stochastic, folded_amax=None,
                    payload=None):
    """(codes, scales, tensor_scale) of flat fp32 (+ residual, updated in place), as
    fused.rotate_feedback_quantize_torch without rotation; None, touching nothing, when
    flat (+ residual) holds a non-finite value (the caller then runs the reference).
    folded_amax: flat already is y = x + residual (or x, without one), made by a pass that also
    found its largest magnitude, this finite np.float32; the residual is then only written.
    payload: a uint8 tensor whose first bytes take the codes (and NVFP4's or INT3's scale codes
    after them), returned as views of it."""
    n, device = flat.numel(), flat.device
    x = flat.numpy()
    feedback = None if residual is None else ("add" if folded_amax is None else "folded")
    r = residual.numpy() if feedback else x
    if folded_amax is None:
        amax, bad = amax_native(x, r, feedback == "add")
        if bad:
            return None
    else:
        amax = folded_amax
    term = np.uint64((int(seed) * 0x9E3779B9) & 0xFFFFFFFF)
    if fmt_name in SCALED:
        block, largest, quantizers, tile = SCALED[fmt_name]
        tensor_scale = np.float32(amax) / largest
        packed, scale_codes = _byte_parts(payload, (code_bytes(fmt_name, n), -(-n // block)),
                                          device)
        c, sc = packed.numpy(), scale_codes.numpy()

        def arguments(first, last):
            part = slice(first * tile, last * tile)
            return (x[part], r[part],
                    c[code_bytes(fmt_name, first * tile): code_bytes(fmt_name, last * tile)],
                    sc[first * tile // block: last * tile // block], tensor_scale, term,
                    first * tile)

        run_tiles(quantizers[feedback, stochastic], -(-n // tile), tile, arguments)
        return packed, scale_codes, torch.tensor([tensor_scale], device=device)
    per_tensor = block_size is None
    tensor_scale = np.float32(amax) / FP8_FORMATS[fmt_name][3] if per_tensor else F0
    block = FP8_TILE if per_tensor else block_size
    blocks = -(-n // block)
    (codes,) = _byte_parts(payload, (n,), device)
    scales = torch.full((1 if per_tensor else blocks,), float(tensor_scale), device=device)
    c, sc = codes.numpy(), scales.numpy()

    def fp8_arguments(first, last):
        part = slice(first * block, last * block)
        return (x[part], r[part], c[part], sc if per_tensor else sc[first:last], tensor_scale,
                block, term, first * block)

    run_tiles(FP8_QUANTIZE[feedback, stochastic, per_tensor, fmt_name], blocks, block,
              fp8_arguments)
    return codes, scales, None


# The formats of E4M3 block scales under an fp32 tensor scale: (scale block, the tensor scale's
# divisor, quantizers, elements a thread's tile holds: whole blocks and whole bytes of codes)
SCALED = {"nvfp4": (NVFP4_BLOCK, np.float32(E2M1[3] * E4M3[3]), NVFP4_QUANTIZE, CHUNK),
          "int3": (INT3_BLOCK, INT3_DIVISOR, INT3_QUANTIZE, DECODE_TILE)}


def _byte_parts(payload, sizes, device):
    """uint8 tensors of these sizes: consecutive views of payload, or new ones without it."""
    if payload is None:
        return [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    offsets = np.cumsum((0,) + sizes)
    return [payload[lo:hi] for lo, hi in zip(offsets, offsets[1:])]


def amax_native(x, r, add):
    """The largest |x (+ r)| of numpy fp32 arrays, and whether any of them is not finite."""
    def arguments(first, last):
        part = slice(first * AMAX_TILE, last * AMAX_TILE)
        return x[part], r[part]

    top = 0
    for part in run_tiles(AMAX[add], -(-x.size // AMAX_TILE), AMAX_TILE, arguments):
        top = max(top, int(part))
    return magnitude_float(top), top >= INF_BITS


def magnitude_float(bits):
    """The np.float32 whose magnitude_bits these are."""
    return np.array([bits], np.int32).view(np.float32)[0]


def accumulate_native(codes, scales, tensor_scales, n, fmt_name, block_size, out, from_zero,
                      epilogue=None, residual=None, divisor=1):
    """The fp32 sum in order of k payloads (codes (k, bytes), scales (k, ...), tensor_scales (k,)
    or None) into out (n contiguous fp32 elements); from_zero and the epilogue (divisor, and
    residual for "fold") as in nvfp4_accumulate (int3_accumulate for INT3). Returns the
    largest magnitude_bits of out after the epilogue, INF_BITS and above where out is not
    finite (0 without an epilogue)."""
    c, sc, y = codes.contiguous().numpy(), scales.contiguous().numpy(), out.numpy()
    r = y if residual is None else residual.numpy()
    if fmt_name in SCALED:
        accumulators = NVFP4_ACCUMULATE if fmt_name == "nvfp4" else INT3_ACCUMULATE
        kernel, tile = accumulators[from_zero, epilogue], DECODE_TILE
        extra = (tensor_scales.numpy(),)
    else:
        per_tensor = block_size is None
        kernel = FP8_ACCUMULATE[from_zero, epilogue, per_tensor, fmt_name]
        tile = FP8_TILE if per_tensor else block_size * max(1, FP8_TILE // block_size)
        extra = (block_size or 1,)
    d = np.float32(divisor)
    return max(int(t) for t in run_tiles(kernel, -(-n // tile), tile,
                                         lambda first, last: (c, sc, *extra, y, r, d, first, last)))
