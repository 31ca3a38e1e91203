"""A step's codec seconds against the memory-bound cost of touching the same gradients once.

    .venv/bin/python benchmarks/codec_step.py        # about 1 minute; 2 ranks under mpirun

Each configuration trains a stack of nn.Linear(width, width) layers (no bias) for --steps steps
under hvd.DistributedOptimizer with GIFT on 2 ranks, one thread each. The codec seconds of a
step are rank 0's GIFT.stats() codec_seconds (time inside compress/decompress less the time
waiting on the network: transforms, encode, decode, sums). After every step rank 0 times the
baseline: an fp16 round trip of as many elements as the model's gradients, into preallocated
buffers (copy into an existing fp16 tensor and back). The ratio is the median over steps 2..N
of the paired per-step ratios. Writes benchmarks/results/codec_step.md.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (label, GIFT arguments, target ratio or None)
CONFIGS = [
    ("nvfp4 + hadamard", dict(format="nvfp4", transform="hadamard"), 8),
    ("nvfp4 + whiten (default)", dict(format="nvfp4", transform="whiten"), None),
    ("fp8_e4m3 per tensor, none", dict(format="fp8_e4m3", transform="none"), None),
]


def worker(args):
    import torch
    import horovod.torch as hvd

    import horovod_gift as gift

    torch.set_num_threads(1)
    hvd.init()
    rows = []
    for label, options, target in CONFIGS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
        )
        compression = gift.GIFT(model, verbose=False, **options)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3),
            named_parameters=model.named_parameters(), compression=compression,
        )
        elements = sum(p.numel() for p in model.parameters())
        flat = torch.randn(elements)
        half, back = torch.empty(elements, dtype=torch.float16), torch.empty(elements)
        data = torch.Generator().manual_seed(1 + hvd.rank())
        codec, baseline = [], []
        last = 0.0
        for _ in range(args.steps):
            x = torch.randn(args.batch, args.width, generator=data)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            total = compression.stats()["codec_seconds"]
            codec.append(total - last)
            last = total
            t0 = time.perf_counter()
            half.copy_(flat)
            back.copy_(half)
            baseline.append(time.perf_counter() - t0)
        steady = list(zip(codec, baseline))[1:]
        rows.append((label, elements, statistics.median(c for c, _ in steady),
                     statistics.median(b for _, b in steady),
                     statistics.median(c / b for c, b in steady), target))
    if hvd.rank() == 0:
        lines = [
            f"# A step's codec seconds against an fp16 round trip ({time.strftime('%Y-%m-%d')})",
            "",
            "Command: `" + " ".join([".venv/bin/python benchmarks/codec_step.py", *args.passed])
            + "`",
            "",
            f"{args.layers} x nn.Linear({args.width}, {args.width}), 2 ranks, one thread each, "
            f"SGD, batch {args.batch}, {args.steps} steps, error feedback on; medians over "
            "steps 2..N. Baseline: an fp16 round trip of all the model's gradient elements into "
            "preallocated buffers, timed on rank 0 after each step.",
            "",
            "| configuration | gradient elements | codec (ms/step) | baseline (ms) "
            "| ratio (paired) | target |",
            "|---|---|---|---|---|---|",
        ]
        for label, elements, c, b, ratio, target in rows:
            lines.append(f"| {label} | {elements} | {c * 1e3:.1f} | {b * 1e3:.2f} | {ratio:.1f}x "
                         f"| {'<= %dx' % target if target else ''} |")
        text = "\n".join(lines) + "\n"
        print(text)
        pathlib.Path(args.out).write_text(text)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "codec_step.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.passed = [a for a in sys.argv[1:] if a != "--worker"]
    if args.worker:
        return worker(args)
    command = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to",
               "none", "-x", "OMP_NUM_THREADS=1", sys.executable, __file__, "--worker",
               *args.passed]
    subprocess.run(command, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


if __name__ == "__main__":
    main()
