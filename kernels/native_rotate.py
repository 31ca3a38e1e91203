"""The native randomized Hadamard rotation (numba): each span of block * lanes elements rotated
in two span-sized buffers (in L1 or L2 for the usual blocks), in the layout and addition order of
hadamard.py.

The butterflies run up to RADIX_STAGES stages a pass (radix 8): a pass reads 8 entries, does the
3 stages' additions in registers, and writes them back, so a 128-block takes 3 passes over the
span instead of 7. The same additions in the same order as hadamard_rows_torch (strides 1, 2,
4, ...), so the same bits. The pass bodies are generated as source: 8 named values per entry.
Indices are unsigned: numba then emits no negative-index wraparound, and LLVM vectorizes the
inner loop across the span's lanes (with signed indices, or 16 entries a pass, it stays scalar).

The odd 1 or 2 stages of a block go in the last pass (a 128-block: radix 8, 8, 2). For blocks over
8, the inverse's first pass reads x itself; its last applies D on the way out when it is a
radix-2 or radix-4 pass (inverse 1.3-1.7x faster with the data in L2, ~1x from memory,
measured). D stays in a loop of its own elsewhere: a radix-8 pass with the signs reads and
writes 24 arrays, too many for LLVM's runtime alias checks, and runs scalar; so does a forward
radix-2 first pass with them.
"""
import numpy as np
from numba import njit

from .hadamard import LANES
from .native_scalars import KERNEL, magnitude_bits

RADIX_STAGES = 3


def butterfly_pass_source(name, stages, last, signs_out):
    """Source of a pass doing butterfly stages s0 .. s0 + stages - 1 from src into dst: w is the
    distance of stage s0's two entries, in elements (lanes << s0). last multiplies the results
    by norm, and signs_out then by their signs (the inverse's D)."""
    n = 1 << stages
    lines = [f"def {name}(src, signs, dst, w, span, norm):",
             "    u = np.uint64(w)",
             f"    for g in range(0, span, {n} * w):",
             "        for t in range(w):",
             "            i = np.uint64(g + t)"]
    for k in range(n):
        lines.append(f"            v0_{k} = src[i + np.uint64({k}) * u]")
    for stage in range(stages):
        h = 1 << stage
        for k in range(n):
            if not k & h:
                lines.append(f"            v{stage + 1}_{k} = v{stage}_{k} + v{stage}_{k + h}")
                lines.append(f"            v{stage + 1}_{k + h} = v{stage}_{k} - v{stage}_{k + h}")
    for k in range(n):
        value = f"v{stages}_{k}" + (" * norm" if last else "")
        if signs_out:
            value += f" * np.float32(signs[i + np.uint64({k}) * u])"
        lines.append(f"            dst[i + np.uint64({k}) * u] = {value}")
    return "\n".join(lines) + "\n"


def _compile_pass(name, stages, last, signs_out):
    scope = {"np": np}
    source = butterfly_pass_source(name, stages, last, signs_out)
    exec(compile(source, f"<native_rotate {name}>", "exec"), scope)
    return njit(inline="always")(scope[name])


RADIX8 = _compile_pass("radix8", 3, False, False)
RADIX8_LAST = _compile_pass("radix8_last", 3, True, False)
LAST_1, LAST_2 = (_compile_pass(f"last_{m}", m, True, False) for m in (1, 2))
SIGNED_LAST_1, SIGNED_LAST_2 = (_compile_pass(f"signed_last_{m}", m, True, True) for m in (1, 2))


@njit(inline="always")
def last_pass(src, signs, dst, stages, w, span, norm, signed):
    """The last pass, of 1 to RADIX_STAGES stages: normalizes; signed: applies D (radix 2, 4)."""
    if stages == RADIX_STAGES:
        RADIX8_LAST(src, signs, dst, w, span, norm)
    elif signed and stages == 1:
        SIGNED_LAST_1(src, signs, dst, w, span, norm)
    elif signed:
        SIGNED_LAST_2(src, signs, dst, w, span, norm)
    elif stages == 1:
        LAST_1(src, signs, dst, w, span, norm)
    else:
        LAST_2(src, signs, dst, w, span, norm)


@njit(inline="always")
def fold_span(ys, residual, ends, maxima, piece, start):
    """ys <- ys + residual (the quantizer's y = x + r) over spans starting at element start,
    and each piece's largest magnitude_bits into maxima (pieces end at ends, ascending);
    returns the piece they end in."""
    done = 0
    while done < ys.size:
        while ends[piece] <= start + done:
            piece += 1
        stop = min(ys.size, ends[piece] - start)
        y, r = ys[done: stop], residual[done: stop]
        top = np.int32(0)
        for j in range(stop - done):
            v = y[j] + r[j]
            y[j] = v
            top = max(top, magnitude_bits(v))
        maxima[piece] = max(maxima[piece], top)
        done = stop
    return piece


FOLD_ELEMENTS = 4096


def make_rotate(lanes, inverse, fold):
    """A kernel rotating x (a whole number of spans) into out: spans of block * lanes elements,
    entry i of block c at i * lanes + c. forward: y = H (D x) * norm; inverse: x = (H y * norm)
    * D, each product rounded as hadamard_rows_torch rounds it. out may be x: a span is read
    whole before it is written. fold (forward): each span gets the residual added while it is
    in cache (fold_span; ends in x's coordinates, the last >= x.size), and the kernel returns
    the pieces' maxima (otherwise an empty array)."""

    @njit(**KERNEL)
    def rotate_spans(x, signs, out, block, norm, residual, ends):
        span = block * lanes
        stages = 0
        while (1 << stages) < block:
            stages += 1
        odd = stages % RADIX_STAGES
        first = np.empty(span, np.float32)
        second = np.empty(span, np.float32)
        maxima = np.zeros(ends.size if fold else 0, np.int32)
        piece = 0
        spans = x.size // span
        # the residual is added over groups of spans of FOLD_ELEMENTS, still in L2 (per span,
        # small spans spend more on the loop than on the additions)
        group = max(1, FOLD_ELEMENTS // span)
        for s in range(spans):
            xs = x[s * span: (s + 1) * span]
            ds = signs[s * span: (s + 1) * span]
            ys = out[s * span: (s + 1) * span]
            if stages == 0:
                for j in range(span):
                    if inverse:
                        ys[j] = xs[j] * norm * np.float32(ds[j])
                    else:
                        ys[j] = xs[j] * np.float32(ds[j]) * norm
            else:
                # the first pass: from x into a buffer
                done = 0
                if inverse and stages > RADIX_STAGES:
                    RADIX8(xs, ds, first, lanes, span, norm)
                    done = RADIX_STAGES
                else:  # D (forward), or a copy: one pass from x to out, which may alias x
                    # (LLVM's alias checks then fail and the pass runs scalar)
                    for j in range(span):
                        first[j] = xs[j] if inverse else xs[j] * np.float32(ds[j])
                src, dst = first, second
                last_stages = odd if odd else RADIX_STAGES
                while stages - done > last_stages:
                    RADIX8(src, ds, dst, lanes << done, span, norm)
                    src, dst = dst, src
                    done += RADIX_STAGES
                last_pass(src, ds, ys, stages - done, lanes << done, span, norm, inverse)
                if inverse and stages - done == RADIX_STAGES:
                    for j in range(span):
                        ys[j] = ys[j] * np.float32(ds[j])
            if fold and ((s + 1) % group == 0 or s == spans - 1):
                lo = s // group * group * span
                piece = fold_span(out[lo: (s + 1) * span], residual[lo: (s + 1) * span], ends,
                                  maxima, piece, lo)
        return maxima

    return rotate_spans


ROTATE = {(lanes, inverse, fold): make_rotate(lanes, inverse, fold) for lanes in (1, LANES)
          for inverse, fold in ((False, False), (True, False), (False, True))}
