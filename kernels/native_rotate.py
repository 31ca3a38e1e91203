"""The native randomized Hadamard rotation (numba): each span of block * lanes elements rotated
in two span-sized buffers (in L1 or L2 for the usual blocks), in the layout and addition order of
hadamard.py.

The butterflies run RADIX_STAGES stages a pass (radix 8): a pass reads 8 entries, does the
3 stages' additions in registers, and writes them back, so a 128-block takes 3 passes over the
span instead of 7. The same additions in the same order as hadamard_rows_torch (strides 1, 2,
4, ...), so the same bits. The pass bodies are generated as source: 8 named values per entry.
Indices are unsigned: numba then emits no negative-index wraparound, and LLVM vectorizes the
inner loop across the span's lanes (with signed indices, or 16 entries a pass, it stays scalar).
"""
import numpy as np
from numba import njit

from .hadamard import LANES
from .native_scalars import KERNEL

RADIX_STAGES = 3


def butterfly_pass_source(stages, normalize):
    """Source of a pass doing butterfly stages s0 .. s0 + stages - 1 from src into dst: w is the
    distance of stage s0's two entries, in elements (lanes << s0); normalize multiplies the
    results by norm (the last pass)."""
    n = 1 << stages
    name = f"radix{n}{'_normalized' if normalize else ''}"
    lines = [f"def {name}(src, dst, w, span, norm):",
             "    u = np.uint64(w)",
             f"    for g in range(0, span, {n} * w):",
             "        for t in range(w):",
             "            i = np.uint64(g + t)"]
    lines += [f"            v0_{k} = src[i + np.uint64({k}) * u]" for k in range(n)]
    for stage in range(stages):
        h = 1 << stage
        for k in range(n):
            if not k & h:
                lines.append(f"            v{stage + 1}_{k} = v{stage}_{k} + v{stage}_{k + h}")
                lines.append(f"            v{stage + 1}_{k + h} = v{stage}_{k} - v{stage}_{k + h}")
    for k in range(n):
        value = f"v{stages}_{k} * norm" if normalize else f"v{stages}_{k}"
        lines.append(f"            dst[i + np.uint64({k}) * u] = {value}")
    return name, "\n".join(lines) + "\n"


def _compile_pass(stages, normalize):
    name, source = butterfly_pass_source(stages, normalize)
    scope = {"np": np}
    exec(compile(source, f"<native_rotate {name}>", "exec"), scope)
    return njit(inline="always")(scope[name])


PASS_1, PASS_2, PASS_3 = (_compile_pass(m, False) for m in (1, 2, 3))
LAST_1, LAST_2, LAST_3 = (_compile_pass(m, True) for m in (1, 2, 3))


@njit(inline="always")
def butterflies(src, dst, stages, w, span, norm, last):
    """One pass of 1 to RADIX_STAGES stages; the last pass normalizes."""
    if last:
        if stages == 1:
            LAST_1(src, dst, w, span, norm)
        elif stages == 2:
            LAST_2(src, dst, w, span, norm)
        else:
            LAST_3(src, dst, w, span, norm)
    elif stages == 1:
        PASS_1(src, dst, w, span, norm)
    elif stages == 2:
        PASS_2(src, dst, w, span, norm)
    else:
        PASS_3(src, dst, w, span, norm)


def make_rotate(lanes, inverse):
    """A kernel rotating x (a whole number of spans) into out: spans of block * lanes elements,
    entry i of block c at i * lanes + c. forward: y = H (D x) * norm; inverse: x = (H y * norm)
    * D, each product rounded as hadamard_rows_torch rounds it. out may be x: a span is read
    into a buffer before it is written."""

    @njit(**KERNEL)
    def rotate_spans(x, signs, out, block, norm):
        span = block * lanes
        stages = 0
        while (1 << stages) < block:
            stages += 1
        first = np.empty(span, np.float32)
        second = np.empty(span, np.float32)
        for s in range(x.size // span):
            xs = x[s * span: (s + 1) * span]
            ds = signs[s * span: (s + 1) * span]
            ys = out[s * span: (s + 1) * span]
            for j in range(span):
                first[j] = xs[j] if inverse else xs[j] * np.float32(ds[j])
            if stages == 0:
                for j in range(span):
                    ys[j] = first[j] * norm
            src, dst = first, second
            done = 0
            while done < stages:
                m = min(RADIX_STAGES, stages - done)
                if done + m == stages:
                    butterflies(src, ys, m, lanes << done, span, norm, True)
                else:
                    butterflies(src, dst, m, lanes << done, span, norm, False)
                    src, dst = dst, src
                done += m
            if inverse:
                for j in range(span):
                    ys[j] = ys[j] * np.float32(ds[j])

    return rotate_spans


ROTATE = {(lanes, inverse): make_rotate(lanes, inverse) for lanes in (1, LANES)
          for inverse in (False, True)}
