"""Would hand-written SIMD beat the numba kernels? A probe: the NVFP4 quantizer of a folded y
(nearest rounding, error feedback) in AVX2 intrinsics (nvfp4_quantize.c, built here with gcc -O3
-mavx2 -ffp-contract=off into a temporary folder), checked bit for bit against
kernels/native_quantize.py, then both timed in turn, one thread.

    .venv/bin/python benchmarks/simd_probe/simd_probe.py    # about 20 s; needs gcc and AVX2

Rows: the whole quantizer (its bits must equal numba's), and the C element loop alone with each
block's amax and E4M3 scale replaced by constants (ELEMENTS_ONLY: wrong bits; an upper bound on
the speed of a C quantizer that batched the per-block work as the numba kernel does), both
against the whole numba kernel.
Writes benchmarks/results/simd_probe.md.
"""
import ctypes
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

from horovod_gift.kernels.native_quantize import NVFP4_QUANTIZE

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = pathlib.Path(__file__).with_name("nvfp4_quantize.c")


def build(folder, defines):
    library = folder / f"probe{len(defines)}.so"
    subprocess.run(["gcc", "-O3", "-mavx2", "-ffp-contract=off", "-fPIC", "-shared", *defines,
                    "-o", str(library), str(SOURCE)], check=True)
    function = ctypes.CDLL(str(library)).nvfp4_quantize_folded
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_float]
    return function


def outputs(n):
    """The residual, the packed codes and the uint8 scale codes (as quantize_native passes
    them) of n elements."""
    return np.empty(n, np.float32), np.empty(n // 2, np.uint8), np.empty(n // 16, np.uint8)


def main():
    numba_kernel = NVFP4_QUANTIZE["folded", False]
    lines = [f"# Hand-written AVX2 against the numba NVFP4 quantizer ({time.strftime('%Y-%m-%d')})",
             "", "Command: `.venv/bin/python benchmarks/simd_probe/simd_probe.py`", "",
             "Folded y (the path after the Hadamard rotation), nearest rounding, feedback written, "
             "one thread, medians of 9 alternating runs.", "",
             "| variant | elements | bits equal numba's | numba ns/element | C ns/element "
             "| numba / C |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        variants = [("whole quantizer", build(pathlib.Path(folder), [])),
                    ("element loop alone", build(pathlib.Path(folder), ["-DELEMENTS_ONLY"]))]
        for n in (1 << 23, 1 << 16):
            rng = np.random.default_rng(0)
            y = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
            y[:64] = 0.0
            y[100:112] = [0.75, -1.25, 5.0, 3.5, 2.5, 1.75, 0.25, -0.75, 6.0, 7.0, 1e-30, -0.0]
            tensor_scale = np.float32(np.abs(y).max() / (6 * 448))
            r, packed, scales = outputs(n)

            def run_numba():
                numba_kernel(y, r, packed, scales, tensor_scale, np.uint64(0), 0)

            for label, function in variants:
                c_r, c_packed, c_scales = outputs(n)

                def run_c(function=function, c_r=c_r, c_packed=c_packed, c_scales=c_scales):
                    function(y.ctypes.data, c_r.ctypes.data, c_packed.ctypes.data,
                             c_scales.ctypes.data, n, tensor_scale)

                run_numba(), run_c()
                same = (np.array_equal(r.view(np.int32), c_r.view(np.int32))
                        and np.array_equal(packed, c_packed)
                        and np.array_equal(scales, c_scales))
                times = {run_numba: [], run_c: []}
                for _ in range(9):
                    for fn in times:
                        t0 = time.perf_counter()
                        fn()
                        times[fn].append(time.perf_counter() - t0)
                a, b = (statistics.median(times[fn]) / n * 1e9 for fn in (run_numba, run_c))
                lines.append(f"| {label} | {n} | {'yes' if same else 'no'} | {a:.3f} | {b:.3f} "
                             f"| {a / b:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / "results" / "simd_probe.md").write_text(text)


if __name__ == "__main__":
    main()
