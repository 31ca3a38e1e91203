"""Convergence of the compression arms, paired over seeds: examples/train_llama.py on 2 ranks, or
examples/train_hf.py's transformers model with --config (gpt2, llama --tie-embeddings yes, ...).

Each seed fixes the initialization and the data order, the same in every arm (paired). Endpoint:
the held-out loss at the last step (fixed held-out batches), as a mean paired difference to fp32
with a 95 % confidence interval (Student's t over seeds); beside it, the RelL2 of each step's
averaged gradient against an exact fp32 average of the same local gradients.

    .venv/bin/python benchmarks/convergence.py --seeds 0 1 2 3 4     # about an hour on 2 cores

Runs whose CSV is already in runs/convergence/ are reused (delete them to rerun). Writes
benchmarks/results/convergence.md and convergence.png (held-out loss and gradient error).
"""
import argparse
import csv
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# arm -> (train_llama --compression, error feedback, GIFT's start_step)
ARMS = {"fp32": ("none", True, 0), "fp16": ("fp16", True, 0),
        "nvfp4 no-EF": ("nvfp4", False, 0), "gift-nvfp4 no-EF": ("gift-nvfp4", False, 0),
        "nvfp4 EF": ("nvfp4", True, 0), "gift-nvfp4 EF": ("gift-nvfp4", True, 0),
        "gift-nvfp4 EF warm-up 50": ("gift-nvfp4", True, 50),
        "fp8 EF": ("fp8", True, 0), "gift-fp8 EF": ("gift-fp8", True, 0),
        "int3 EF": ("int3", True, 0), "gift-int3 EF": ("gift-int3", True, 0)}
DEFAULT_ARMS = ["fp32", "fp16", "nvfp4 no-EF", "gift-nvfp4 no-EF", "nvfp4 EF", "gift-nvfp4 EF"]
# two-sided 95 % quantiles of Student's t by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086}


def run(arm, seed, args, out_dir):
    compression, error_feedback, start_step = ARMS[arm]
    tag = f"{arm.replace(' ', '_')}-s{seed}"
    csv_path = out_dir / f"{tag}.csv"
    if not csv_path.exists():
        command = ["bash", str(ROOT / "scripts" / "mpirun.sh"), str(args.ranks),
                   str(ROOT / ".venv" / "bin" / "python"), str(ROOT / script(args)),
                   *model_flags(args), "--compression", compression,
                   "--steps", str(args.steps), "--seed", str(seed),
                   "--dim", str(args.dim), "--layers", str(args.layers), "--lr", str(args.lr),
                   "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
                   "--gradient-error", "--quiet", "--csv", str(csv_path)]
        if not error_feedback:
            command.append("--no-error-feedback")
        if start_step:
            command += ["--start-step", str(start_step)]
        t0 = time.perf_counter()
        with open(out_dir / f"{tag}.log", "w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        print(f"{tag}: {time.perf_counter() - t0:.0f} s", flush=True)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    heldout = [(int(r["step"]), float(r["heldout_loss"])) for r in rows if r["heldout_loss"]]
    return {"heldout": heldout, "final": heldout[-1][1],
            "gradient": [float(r["gradient_rel_l2"]) for r in rows],
            "bits": float(rows[-1]["bits_per_element"]),
            "seconds": sum(float(r["seconds"]) for r in rows)}


def script(args):
    """The training script: examples/train_llama.py, or train_hf.py for a transformers model."""
    return "examples/train_hf.py" if args.config else "examples/train_llama.py"


def model_flags(args):
    if not args.config:
        return []
    return ["--config", args.config, "--tie-embeddings", args.tie_embeddings]


def interval(values):
    """Mean and half-width of the 95 % confidence interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    df = n - 1
    t = T975.get(df) or T975[max(k for k in T975 if k <= df)]
    return mean, t * sd / math.sqrt(n)


def plot(results, arms, seeds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in arms:
        runs = [results[(arm, s)] for s in seeds]
        steps = [step for step, _ in runs[0]["heldout"]]
        values = [[loss for _, loss in r["heldout"]] for r in runs]
        mean = [sum(v) / len(v) for v in zip(*values)]
        line, = left.plot(steps, mean, label=arm)
        left.fill_between(steps, [min(v) for v in zip(*values)], [max(v) for v in zip(*values)],
                          color=line.get_color(), alpha=0.15)
        if arm != "fp32":
            per_step = [sum(v) / len(v) for v in zip(*[r["gradient"] for r in runs])]
            window = 10
            smooth = []
            for i in range(len(per_step)):
                recent = per_step[max(0, i - window + 1):i + 1]
                smooth.append(sum(recent) / len(recent))
            right.plot(range(1, len(smooth) + 1), smooth, label=arm, color=line.get_color())
    left.set(xlabel="step", ylabel="held-out loss (mean; band: min-max over seeds)")
    right.set(xlabel="step", ylabel="RelL2 of the averaged gradient vs exact fp32", yscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    p.add_argument("--config", default=None,
                   help="a transformers model type (gpt2, llama, ...): examples/train_hf.py")
    p.add_argument("--tie-embeddings", default="config", choices=("config", "yes", "no"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence.md"))
    args = p.parse_args()
    regime = f"d{args.dim}-l{args.layers}-lr{args.lr}-n{args.steps}"
    if args.config:
        regime = f"{args.config}-tie{args.tie_embeddings}-{regime}"
    out_dir = ROOT / "runs" / "convergence" / regime
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:                 # seed-major: an interrupted study has whole pairs
        for arm in args.arms:
            results[(arm, seed)] = run(arm, seed, args, out_dir)
    base = "fp32"
    lines = [
        f"# Convergence, paired over seeds ({time.strftime('%Y-%m-%d')})",
        "",
        "Command: `.venv/bin/python benchmarks/convergence.py " + shlex.join(sys.argv[1:]) + "`",
        "",
        f"{script(args)} {shlex.join(model_flags(args))}, dim {args.dim}, "
        f"{args.layers} layers, {args.steps} "
        f"steps, AdamW lr {args.lr} (20 warm-up steps), {args.ranks} ranks on one 2-core "
        f"machine, batch 16 x 128 bytes per rank; seeds {args.seeds} (each: initialization "
        "and data order, shared by all arms). Held-out loss: mean over "
        f"{args.eval_batches} fixed held-out batches at the last step. Difference: mean "
        "over seeds of (arm - fp32) with a 95 % confidence interval (t over seeds); "
        "negative is better. Gradient RelL2: ||averaged gradient - exact fp32 average|| / "
        "||exact||, mean over all steps and seeds. gift-* = GIFT's defaults (transform "
        "whiten); nvfp4 = the same codec and collective with transform none.",
        "",
        "| arm | held-out loss | vs fp32 (95 % CI) | vs fp32 (%) | gradient RelL2 | "
        "bits/element | step time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in args.arms:
        finals = [results[(arm, s)]["final"] for s in args.seeds]
        mean_final = sum(finals) / len(finals)
        if arm == base or base not in args.arms:
            diff = percent = "-"
        else:
            d, h = interval(
                [results[(arm, s)]["final"] - results[(base, s)]["final"] for s in args.seeds]
            )
            diff = f"{d:+.4f} ({d - h:+.4f} .. {d + h:+.4f})"
            fp32 = sum(results[(base, s)]["final"] for s in args.seeds) / len(args.seeds)
            percent = f"{100 * d / fp32:+.2f} ({100 * (d - h) / fp32:+.2f} .. " \
                      f"{100 * (d + h) / fp32:+.2f})"
        grad = [g for s in args.seeds for g in results[(arm, s)]["gradient"]]
        seconds = sum(results[(arm, s)]["seconds"] for s in args.seeds)
        step_time = seconds / (len(args.seeds) * args.steps)
        lines.append(
            f"| {arm} | {mean_final:.4f} | {diff} | {percent} | {sum(grad) / len(grad):.2e} | "
            f"{results[(arm, args.seeds[0])]['bits']:.2f} | {step_time:.3f} |"
        )
    pairs = [
        ("gift-nvfp4 no-EF", "nvfp4 no-EF"),
        ("gift-nvfp4 EF", "nvfp4 EF"),
        ("nvfp4 EF", "nvfp4 no-EF"),
        ("gift-nvfp4 EF", "gift-nvfp4 no-EF"),
        ("gift-nvfp4 EF warm-up 50", "gift-nvfp4 EF"),
        ("gift-fp8 EF", "fp8 EF"),
        ("gift-int3 EF", "int3 EF"),
        ("int3 EF", "nvfp4 EF"),
        ("gift-int3 EF", "gift-nvfp4 EF"),
        ("gift-int3 EF", "nvfp4 EF"),
    ]
    lines += ["", "Paired differences between compressed arms (held-out loss, 95 % CI):", ""]
    for a, b in pairs:
        if a in args.arms and b in args.arms:
            d, h = interval(
                [results[(a, s)]["final"] - results[(b, s)]["final"] for s in args.seeds]
            )
            lines.append(f"- {a} - {b}: {d:+.4f} ({d - h:+.4f} .. {d + h:+.4f})")
    png = pathlib.Path(args.out).with_suffix(".png")
    lines += ["", f"![held-out loss and gradient error]({png.name})"]
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text)
    plot(results, args.arms, args.seeds, png)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
