"""The native randomized Hadamard rotation (numba): each span of block * lanes elements
rotated in two L1-resident buffers, in the layout and addition order of hadamard.py."""
import numpy as np
from numba import njit

from .hadamard import LANES
from .native_scalars import KERNEL


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
