"""The memory traffic of a codec round trip alone: the loads and stores of its passes with no
arithmetic worth the name, against the fp16 round trip that codec.py's targets are ratios to.

    .venv/bin/python benchmarks/traffic_floor.py     # about 10 s; writes traffic_floor.md

Each pass below is a numba loop that reads and writes what the codec's pass of the same name
reads and writes (fp32 x and residual r, 1-byte FP8 codes, packed E2M1 nibbles with a scale byte
per 16 elements, the fp32 result; the nibble passes in tiles of 4096 elements, as the codec's),
one thread, timed back to back with the fp16 round trip (copy into an existing fp16 tensor and
back), medians of the paired ratios as in codec.py. A round trip's row is the sum of its passes'
medians over the fp16 round trip's. No kernel, however fast its arithmetic, makes a round trip of
these passes cheaper than its floor; a target below the floor needs fewer passes, and the
"fewest passes" row says what the fewest the format allows would cost (FP8's per-tensor scale
needs the whole tensor's amax before any code, so its amax pass stays).
"""

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
from numba import njit

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNEL = dict(nogil=True, cache=True, boundscheck=False)
TOP_BYTE = np.uint32(24)


@njit(**KERNEL)
def read2_max(x, r):
    """amax pass: reads x and r."""
    top = np.uint32(0)
    for i in range(x.size):
        top = max(top, np.float32(x[i]).view(np.uint32) | np.float32(r[i]).view(np.uint32))
    return top


@njit(**KERNEL)
def read2_write_sum(x, r, y):
    """rotation with the residual folded in: reads x and r, writes y."""
    for i in range(x.size):
        y[i] = x[i] + r[i]


@njit(**KERNEL)
def read2_write_codes_residual(x, r, codes):
    """FP8 quantize with error feedback: reads x and r, writes a byte per element and r."""
    for i in range(x.size):
        y = x[i] + r[i]
        codes[i] = np.uint8(np.float32(y).view(np.uint32) >> TOP_BYTE)
        r[i] = y


TILE = 4096  # elements; nibble passes pair element i of a tile with element i + TILE / 2


@njit(inline="always")
def nibble(v):
    return np.uint8((np.float32(v).view(np.uint32) >> TOP_BYTE) & np.uint32(15))


def make_nibble_pass(add):
    @njit(**KERNEL)
    def nibble_pass(x, r, packed, scales):
        """NVFP4 quantize: reads x (with add, and r: the rotation's pass and the quantizer's in
        one), writes a nibble per element, a byte per 16 and r."""
        half = TILE // 2
        for t in range(x.size // TILE):
            tile = slice(t * TILE, (t + 1) * TILE)
            xs, rs, ps = x[tile], r[tile], packed[t * half:]
            for i in range(TILE):
                rs[i] = xs[i] + rs[i] if add else xs[i]
            for k in range(half):
                ps[k] = nibble(rs[k]) | (nibble(rs[k + half]) << np.uint8(4))
            for k in range(TILE // 16):
                scales[t * (TILE // 16) + k] = ps[k]

    return nibble_pass


READ1_WRITE_NIBBLES_RESIDUAL, READ2_WRITE_NIBBLES_RESIDUAL = (make_nibble_pass(add)
                                                              for add in (False, True))


@njit(**KERNEL)
def decode_bytes(codes, out):
    """FP8 decode: reads a byte per element, writes fp32."""
    for i in range(out.size):
        out[i] = np.float32(codes[i])


@njit(**KERNEL)
def decode_nibbles(packed, scales, out):
    """NVFP4 decode: reads a nibble per element and a byte per 16, writes fp32."""
    half = TILE // 2
    for t in range(out.size // TILE):
        ps, os = packed[t * half: (t + 1) * half], out[t * TILE: (t + 1) * TILE]
        s = np.float32(scales[t * (TILE // 16)])
        for k in range(half):
            os[k] = np.float32(ps[k] & np.uint8(15)) * s
        for k in range(half):
            os[k + half] = np.float32(ps[k] >> np.uint8(4)) * s


@njit(**KERNEL)
def in_place(out):
    """inverse rotation written over its input: reads and writes fp32."""
    for i in range(out.size):
        out[i] = -out[i]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
    codes, packed = np.zeros(n, np.uint8), np.zeros(n // 2, np.uint8)
    scales = np.ones(n // 16, np.uint8)
    xt = torch.from_numpy(x)
    half, back = torch.empty(n, dtype=torch.float16), torch.empty(n)

    def fp16_round_trip():
        half.copy_(xt)
        back.copy_(half)

    passes = {
        "amax (reads x, r)": lambda: read2_max(x, r),
        "FP8 quantize (reads x, r; writes codes, r)":
            lambda: read2_write_codes_residual(x, r, codes),
        "FP8 decode (reads codes; writes out)": lambda: decode_bytes(codes, out),
        "rotate + residual (reads x, r; writes y)": lambda: read2_write_sum(x, r, y),
        "NVFP4 quantize of y (reads y; writes nibbles, scales, r)":
            lambda: READ1_WRITE_NIBBLES_RESIDUAL(y, r, packed, scales),
        "rotate + NVFP4 quantize (reads x, r; writes nibbles, scales, r)":
            lambda: READ2_WRITE_NIBBLES_RESIDUAL(x, r, packed, scales),
        "NVFP4 decode (reads nibbles, scales; writes out)":
            lambda: decode_nibbles(packed, scales, out),
        "inverse rotation in place (reads, writes out)": lambda: in_place(out),
    }
    measured = {}
    for name, fn in passes.items():
        fn(), fp16_round_trip()  # compiles, and touches every page
        pairs = [(timed(fn), timed(fp16_round_trip)) for _ in range(args.repeats)]
        measured[name] = (statistics.median(t for t, _ in pairs),
                          statistics.median(b for _, b in pairs),
                          statistics.median(t / b for t, b in pairs))
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
        f"{n} fp32 elements, one thread; each pass timed back to back with an fp16 round trip "
        "into preallocated buffers; medians of the paired ratios.",
        "",
        "| pass | ns/element | ratio to fp16 round trip |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {t / n * 1e9:.3f} | {ratio:.2f} |"
              for name, (t, _, ratio) in measured.items()]
    lines += ["", "| round trip | floor ns/element | floor ratio to fp16 round trip |",
              "|---|---|---|"]
    for label, parts in round_trips:
        t = sum(measured[p][0] for p in parts)
        base = sum(measured[p][1] for p in parts) / len(parts)
        lines.append(f"| {label} | {t / n * 1e9:.3f} | {t / base:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
