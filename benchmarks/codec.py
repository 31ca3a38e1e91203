"""The codec on synthetic data: Gaussian error floors, bits per element, CPU speed, whitening cost.

    .venv/bin/python benchmarks/codec.py      # about 30 s; writes benchmarks/results/codec.md

Speed (one thread, the CPU's native kernels) is a ratio to an fp16 round trip of as many elements
into preallocated buffers (copy into an existing fp16 tensor and back: the memory-bound cost, no
page faults), each stage timed back to back with that baseline, medians of the paired ratios. A
plain fp32 copy is printed beside it. Stages: rotate, quantize (with error feedback: + residual,
residual updated), decode into a preallocated result, accumulate 2 payloads, inverse rotation;
the round trip is all of them in one call but accumulate.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

import horovod_gift as gift
from dense_whitening import whitening
from horovod_gift.codec import formats

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE_NMSE = {
    ("nvfp4", None): 9.0e-3,
    ("fp8_e4m3", 32): 5.8e-4,
    ("fp8_e5m2", None): 2.8e-3,
    ("fp8_e4m3", None): 7.0e-4,
    ("fp8_e4m3", 16): 5.0e-4,
    ("fp8_e4m3", 128): 6.6e-4,
}


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn, repeats):
    fn()
    return statistics.median(timed(fn) for _ in range(repeats))


def paired_times(fn, baseline, repeats):
    """Median times of fn and baseline and the median of their ratios, each pair timed back to back:
    this machine's speed drifts by 30 % between runs seconds apart, a ratio of pairs much less."""
    fn(), baseline()
    pairs = [(timed(fn), timed(baseline)) for _ in range(repeats)]
    return (
        statistics.median(t for t, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(t / b for t, b in pairs),
    )


def fidelity_table(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    rows = [
        "| codec | rounding | NMSE | reference | ratio | bits/elem | target bits |",
        "|---|---|---|---|---|---|---|",
    ]
    for (fmt, block), ref in REFERENCE_NMSE.items():
        for rounding in ("nearest", "stochastic"):
            enc = gift.encode(x, fmt, block_size=block, rounding=rounding)
            nmse = float(((gift.decode(enc) - x).double().norm() / x.double().norm()) ** 2)
            target = 4.6 if fmt == "nvfp4" else (8.01 if block is None else 8 + 32 / block + 0.01)
            reference = (
                f"{ref:.1e}" if rounding == "nearest" else ("1.9e-02" if fmt == "nvfp4" else "-")
            )
            ratio = f"{nmse / ref:.3f}" if rounding == "nearest" else "-"
            rows.append(
                f"| {fmt} {'per ' + str(block) if block else 'per tensor'} | {rounding} "
                f"| {nmse:.3e} | "
                f"{reference} | {ratio} | {enc.bits_per_element:.4f} | <= {target:.4f} |"
            )
    return rows


def speed_table(n, repeats):
    torch.set_num_threads(1)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    half, out = torch.empty(n, dtype=torch.float16), torch.empty(n)

    def fp16_round_trip():
        half.copy_(x)
        out.copy_(half)

    _, base, copy_ratio = paired_times(lambda: out.copy_(x), fp16_round_trip, repeats)
    rows = [
        f"Baseline: fp16 round trip {base / n * 1e9:.3f} ns/element; a plain fp32 copy is "
        f"{copy_ratio:.2f}x of it.",
        "",
        "| codec | rotation | error feedback | stage | ns/element | ratio to fp16 round trip |"
        " target |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, block, rotation, target in (
        ("fp8_e4m3", None, None, 2),
        ("fp8_e5m2", None, None, 2),
        ("fp8_e4m3", 32, None, None),
        ("nvfp4", None, None, None),
        ("nvfp4", None, gift.HadamardRotation(128, 0), 4),
        ("nvfp4", None, gift.HadamardRotation(16, 0), 4),
    ):
        residual = torch.zeros(n)
        codes, scales, tensor_scale = formats.quantize(x, fmt, block, residual=residual)
        codes2, scales2 = torch.stack([codes, codes]), torch.stack([scales, scales])
        scales2d = None if tensor_scale is None else torch.cat([tensor_scale, tensor_scale])

        def round_trip():
            c, s, t = formats.quantize(x, fmt, block, residual=residual, rotation=rotation)
            y = formats.dequantize(c, s, t, n, fmt, block, out=out)
            return rotation.apply(y, inverse=True, out=y) if rotation else y

        stages = {
            "quantize": lambda: formats.quantize(x, fmt, block, residual=residual),
            "decode": lambda: formats.dequantize(
                codes, scales, tensor_scale, n, fmt, block, out=out
            ),
            "accumulate 2": lambda: formats.accumulate(
                codes2, scales2, scales2d, n, fmt, block, out=out
            ),
        }
        if rotation:
            stages["rotate"] = lambda: rotation.apply(x, out=out)
            stages["inverse rotate"] = lambda: rotation.apply(x, inverse=True, out=out)
        stages["round trip"] = round_trip
        label = f"{fmt} {'per ' + str(block) if block else 'per tensor'}"
        for stage, fn in stages.items():
            t, _, ratio = paired_times(fn, fp16_round_trip, repeats)
            goal = f"<= {target}" if stage == "round trip" and target else ""
            rows.append(
                f"| {label} | {f'hadamard {rotation.block_size}' if rotation else 'none'} | yes | "
                f"{stage} | {t / n * 1e9:.2f} | {ratio:.2f} | {goal} |"
            )
    return rows


def whitening_table(repeats):
    torch.set_num_threads(1)
    rows = [
        "| in_features | out | rank | low rank (isotropic) forward+inverse ms "
        "| per in_features (us) | dense (cholesky) ms |",
        "|---|---|---|---|---|---|",
    ]
    for n_in in (256, 512, 1024, 2048, 4096):
        x = torch.randn(4 * n_in, n_in)
        g = torch.randn(1024, n_in)
        cells = []
        for sqrt in ("isotropic", "cholesky"):
            w = whitening(n_in, rank=32, sqrt=sqrt)
            w.update(x)
            cells.append(median_time(lambda: w.inverse(w.forward(g)), repeats))
        rows.append(
            f"| {n_in} | 1024 | 32 | {cells[0] * 1e3:.2f} | {cells[0] / n_in * 1e6:.2f} "
            f"| {cells[1] * 1e3:.2f} |"
        )
    return rows


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--elements", type=int, default=10_000_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "codec.md"))
    args = p.parse_args()
    text = [
        f"# Codec benchmark ({time.strftime('%Y-%m-%d')}, CPU, torch {torch.__version__})",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/codec.py', *sys.argv[1:]])}`.",
        "",
        f"## Error on i.i.d. Gaussian data ({2 ** 20} elements) against the reference floors "
        "(NMSE of the same samples rounded by numpy + ml_dtypes)",
        "",
    ] + fidelity_table(1 << 20)
    text += ["", f"## CPU speed of each stage, {args.elements:.0e} fp32 elements, one thread", ""]
    text += speed_table(args.elements, args.repeats)
    text += [
        "",
        "## Whitening cost at fixed rank: O(out * in * r) for the low-rank form, "
        "O(out * in^2) dense",
        "",
    ]
    text += whitening_table(args.repeats)
    out = "\n".join(text) + "\n"
    print(out)
    pathlib.Path(args.out).write_text(out)


if __name__ == "__main__":
    main()
