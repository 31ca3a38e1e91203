"""The memory traffic of a codec round trip alone: the loads and stores of its passes with no
arithmetic worth the name, against the fp16 round trip that codec.py's targets are ratios to.

    .venv/bin/python benchmarks/traffic_floor.py     # about 20 s; writes traffic_floor.md

Each pass below is a numba loop that reads and writes what the codec's pass of the same name
reads and writes (fp32 x and residual r, the rotation's int8 signs, 1-byte FP8 codes, packed
E2M1 nibbles with a scale byte per 16 elements, the fp32 result; the nibble passes in tiles of
4096 elements), one thread. Each pass, and each round trip as all its passes in one call, is
timed back to back with the fp16 round trip (copy into an existing fp16 tensor and back),
medians of the paired ratios as in codec.py. An estimate of the floor, not a proven bound: loops
this simple run near memory speed here, but nothing shows they are the fastest possible. The
"fewest passes" row is what the fewest passes the format allows would cost (FP8's per-tensor
scale needs the whole tensor's amax before any code, so its amax pass stays).
"""

import argparse
import pathlib
import sys
import time

import numpy as np
import torch
from numba import njit

from codec import paired_times

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL = dict(nogil=True, cache=True, boundscheck=False)
TOP_BYTE = np.uint32(24)
TILE = 4096  # elements; nibble passes pair element i of a tile with element i + TILE / 2
TILE_SCALES = TILE // 16


@njit(**KERNEL)
def amax_floor(x, r):
    """amax of x + r: reads x and r."""
    top = np.uint32(0)
    for i in range(x.size):
        top = max(top, np.float32(x[i]).view(np.uint32) | np.float32(r[i]).view(np.uint32))
    return top


@njit(**KERNEL)
def fp8_quantize_floor(x, r, codes):
    """FP8 quantize with error feedback: reads x and r, writes a byte per element and r."""
    for i in range(x.size):
        y = x[i] + r[i]
        codes[i] = np.uint8(np.float32(y).view(np.uint32) >> TOP_BYTE)
        r[i] = y


@njit(**KERNEL)
def fp8_decode_floor(codes, out):
    """FP8 decode: reads a byte per element, writes fp32."""
    for i in range(out.size):
        out[i] = np.float32(codes[i])


@njit(**KERNEL)
def rotate_fold_floor(x, signs, r, y):
    """rotation with the residual folded in: reads x, the signs and r, writes y."""
    for i in range(x.size):
        y[i] = x[i] * np.float32(signs[i]) + r[i]


@njit(inline="always")
def nibble(v):
    return np.uint8((np.float32(v).view(np.uint32) >> TOP_BYTE) & np.uint32(15))


def make_nvfp4_quantize_floor(rotated_here):
    @njit(**KERNEL)
    def nvfp4_quantize_floor(x, signs, r, packed, scales):
        """NVFP4 quantize of a folded y = x: reads x, writes a nibble per element, a byte per 16
        and r; rotated_here (the rotation's pass and the quantizer's in one): reads the signs
        and r too."""
        half = TILE // 2
        for t in range(x.size // TILE):
            tile = slice(t * TILE, (t + 1) * TILE)
            xs, ds, rs, ps = x[tile], signs[tile], r[tile], packed[t * half:]
            for i in range(TILE):
                rs[i] = xs[i] * np.float32(ds[i]) + rs[i] if rotated_here else xs[i]
            for k in range(half):
                ps[k] = nibble(rs[k]) | (nibble(rs[k + half]) << np.uint8(4))
            for k in range(TILE_SCALES):
                scales[t * TILE_SCALES + k] = ps[k]

    return nvfp4_quantize_floor


NVFP4_QUANTIZE_FLOOR, ROTATE_NVFP4_QUANTIZE_FLOOR = (make_nvfp4_quantize_floor(rotated_here)
                                                     for rotated_here in (False, True))


@njit(**KERNEL)
def nvfp4_decode_floor(packed, scales, out):
    """NVFP4 decode: reads a nibble per element and a byte per 16, writes fp32. The scale bytes
    are read in a loop of their own (a scale per 16 elements inside the element loops kept LLVM
    from vectorizing them, slower than the codec's decoder)."""
    half = TILE // 2
    for t in range(out.size // TILE):
        ps, os = packed[t * half: (t + 1) * half], out[t * TILE: (t + 1) * TILE]
        ss = scales[t * TILE_SCALES: (t + 1) * TILE_SCALES]
        s = np.uint8(0)
        for g in range(TILE_SCALES):
            s |= ss[g]
        for k in range(half):
            os[k] = np.float32(ps[k] & np.uint8(15))
        for k in range(half):
            os[k + half] = np.float32(ps[k] >> np.uint8(4))
        os[0] = np.float32(s)


@njit(**KERNEL)
def inverse_rotation_floor(out, signs):
    """inverse rotation written over its input: reads fp32 and the signs, writes fp32."""
    for i in range(out.size):
        out[i] = out[i] * np.float32(signs[i])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "traffic_floor.md"))
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.elements - args.elements % TILE
    x, r, y, out = (torch.randn(n).numpy() for _ in range(4))
    signs = np.where(np.arange(n) % 3 == 0, -1, 1).astype(np.int8)
    codes, packed = np.zeros(n, np.uint8), np.zeros(n // 2, np.uint8)
    scales = np.ones(n // 16, np.uint8)
    xt = torch.from_numpy(x)
    half, back = torch.empty(n, dtype=torch.float16), torch.empty(n)

    def fp16_round_trip():
        half.copy_(xt)
        back.copy_(half)

    passes = {
        "amax (reads x, r)": lambda: amax_floor(x, r),
        "FP8 quantize (reads x, r; writes codes, r)": lambda: fp8_quantize_floor(x, r, codes),
        "FP8 decode (reads codes; writes out)": lambda: fp8_decode_floor(codes, out),
        "rotate + residual (reads x, signs, r; writes y)":
            lambda: rotate_fold_floor(x, signs, r, y),
        "NVFP4 quantize of y (reads y; writes nibbles, scales, r)":
            lambda: NVFP4_QUANTIZE_FLOOR(y, signs, r, packed, scales),
        "rotate + NVFP4 quantize (reads x, signs, r; writes nibbles, scales, r)":
            lambda: ROTATE_NVFP4_QUANTIZE_FLOOR(x, signs, r, packed, scales),
        "NVFP4 decode (reads nibbles, scales; writes out)":
            lambda: nvfp4_decode_floor(packed, scales, out),
        "inverse rotation in place (reads out, signs; writes out)":
            lambda: inverse_rotation_floor(out, signs),
    }
    names = list(passes)
    round_trips = [
        ("FP8 per tensor, error feedback: the codec's passes (target <= 2x)", names[0:3]),
        ("NVFP4 + Hadamard, error feedback: the codec's passes (target <= 4x)",
         [names[3], names[4], names[6], names[7]]),
        ("NVFP4 + Hadamard: fewest passes (rotate + quantize, decode + inverse rotation)",
         [names[5], names[6]]),
    ]
    lines = [
        f"# The memory traffic of a round trip alone ({time.strftime('%Y-%m-%d')})",
        "",
        "Command: `" + " ".join([".venv/bin/python benchmarks/traffic_floor.py", *sys.argv[1:]])
        + "`",
        "",
        f"{n} fp32 elements, one thread; each pass, and each round trip's passes in one call, "
        "timed back to back with an fp16 round trip into preallocated buffers; medians of the "
        "paired ratios. An estimate of the floor (see the script's docstring).",
        "",
        "| pass | ns/element | ratio to fp16 round trip |",
        "|---|---|---|",
    ]
    for name, fn in passes.items():
        t, _, ratio = paired_times(fn, fp16_round_trip, args.repeats)
        lines.append(f"| {name} | {t / n * 1e9:.3f} | {ratio:.2f} |")
    lines += ["", "| round trip | floor ns/element | floor ratio to fp16 round trip |",
              "|---|---|---|"]
    for label, parts in round_trips:
        def round_trip(parts=parts):
            for part in parts:
                passes[part]()

        t, _, ratio = paired_times(round_trip, fp16_round_trip, args.repeats)
        lines.append(f"| {label} | {t / n * 1e9:.3f} | {ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
