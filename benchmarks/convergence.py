"""Convergence of the six compression arms: same seed, same data, 2 ranks, examples/train_llama.py.

    .venv/bin/python benchmarks/convergence.py [--steps 400]

Writes benchmarks/results/convergence.md (final loss = mean of the last 10 % of steps, its
difference to `none`, bits per gradient element, wall time) and convergence.png (loss curves).
"""
import argparse
import csv
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARMS = ["none", "fp16", "fp8", "nvfp4", "gift-fp8", "gift-nvfp4"]


def run_arm(arm, args, out_dir):
    csv_path = out_dir / f"{arm}.csv"
    command = ["bash", str(ROOT / "scripts" / "mpirun.sh"), str(args.ranks), str(ROOT / ".venv" / "bin" / "python"),
               str(ROOT / "examples" / "train_llama.py"), "--compression", arm, "--steps", str(args.steps),
               "--seed", str(args.seed), "--dim", str(args.dim), "--layers", str(args.layers), "--quiet",
               "--csv", str(csv_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(out_dir / f"{arm}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.perf_counter() - t0
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    return {"loss": [float(r["loss"]) for r in rows], "bits": float(rows[-1]["bits_per_element"]), "seconds": seconds}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm, r in results.items():
        window = max(1, len(r["loss"]) // 50)
        smooth = [sum(r["loss"][max(0, i - window + 1):i + 1]) / len(r["loss"][max(0, i - window + 1):i + 1])
                  for i in range(len(r["loss"]))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f"{arm} ({r['bits']:.1f} bits)")
    ax.set_xscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {window} steps)")
    ax.set_title("Llama on the Python standard library, 2 ranks")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=ARMS)
    args = p.parse_args()
    out_dir = ROOT / "runs" / "convergence"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in args.arms:
        results[arm] = run_arm(arm, args, out_dir)
        print(f"{arm}: final loss {results[arm]['loss'][-1]:.4f} in {results[arm]['seconds']:.0f}s", flush=True)
    tail = max(1, args.steps // 10)
    final = {arm: sum(r["loss"][-tail:]) / tail for arm, r in results.items()}
    base = final.get("none")
    lines = [f"# Convergence of the compression arms ({time.strftime('%Y-%m-%d')})", "",
             f"examples/train_llama.py, dim {args.dim}, {args.layers} layers, {args.steps} steps, seed {args.seed}, "
             f"{args.ranks} ranks on one 2-core machine (shared memory), batch 16 x 128 bytes per rank, AdamW lr 3e-3. "
             f"Final loss = mean of the last {tail} steps. fp8 / nvfp4 = the GIFT codec and collective with "
             f"transform none; gift-* = transform auto, error feedback on. Command: "
             f"`.venv/bin/python benchmarks/convergence.py --steps {args.steps}`.", "",
             "| arm | final loss | vs none | bits per gradient element | wall time (s) |", "|---|---|---|---|---|"]
    for arm in results:
        diff = f"{100 * (final[arm] / base - 1):+.2f} %" if base else "-"
        lines.append(f"| {arm} | {final[arm]:.4f} | {diff} | {results[arm]['bits']:.2f} | {results[arm]['seconds']:.0f} |")
    lines += ["", "![loss curves](convergence.png)"]
    text = "\n".join(lines) + "\n"
    results_dir = ROOT / "benchmarks" / "results"
    (results_dir / "convergence.md").write_text(text)
    plot(results, results_dir / "convergence.png")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
