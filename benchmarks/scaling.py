"""Does the parity hold as models grow? (issue 58) A width sweep of examples/train_llama.py
--engine ddp on 2 ranks (torchrun, gloo), paired seeds, two real corpora.

    nice -n 19 .venv/bin/python benchmarks/scaling.py --deadline 23:45   # hours on 2 cores
    .venv/bin/python benchmarks/scaling.py --report-only                 # report from the CSVs

Rules, one per width and none tuned per arm:
- layers = dim / 64, at least 2 (fixed aspect ratio dim / layers = 64, GPT-2 small's 768 / 12):
  2 at 128, 4 at 256, 8 at 512; heads = dim / 32 (train_llama fixes the head dimension, as
  Llama does, and widens by adding heads; it has no --heads flag).
- tokens per step fixed: 16 sequences x 128 bytes a rank, 2 ranks (4096 a step).
- lr = 3e-3 * 128 / dim (AdamW; 3e-3 was tuned at dim 128): muP's 1/width rule for Adam, which
  keeps a step's change of each layer's output the same size as the width grows (here on every
  parameter, with the standard initialization). 20 warm-up steps, then constant (train_llama).
- --steps 300, the earlier studies' choice: dim 128's held-out curve slows but has not flattened
  there (fp32 -0.03 per 25 steps at the end, constant lr); longer would cost the wider widths.
Stages (corpus:dim:seeds:arms, arms "all", "core" or a,b,...) run in order, seed-major (a cut
stage leaves whole pairs); a seed fixes the initialization and data order in every arm.
Endpoint: held-out loss at the last step (16 fixed batches), arm - fp32 as a mean paired
difference with a 95 % interval (Student's t, convergence.py's interval()). Corpora: stdlib
(data.py's default, Python source) and gnu-info (/usr/share/info's GNU manuals gunzipped into
one file: English technical prose on any Debian or Ubuntu machine; data.py reads its first 4 MB).
CSVs under runs/scaling/<corpus>/d<dim>/<regime>/ are reused: a cut sweep resumes. --deadline
HH:MM (UTC) skips a run that the slowest earlier run of its width (or 1.5 x the nearest width's,
scaled by parameters) says would end later. The report (benchmarks/results/scaling.md,
scaling_gap.png, scaling_gain.png) is rewritten after every seed.
"""
import argparse
import csv
import datetime
import functools
import gzip
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from convergence import ROOT, interval  # noqa: E402

# arm -> train_llama flags (COMPRESSIONS in examples/engines.py; gift-* = transform whiten)
ARMS = {"fp32": ["--compression", "none"],
        "gift-int3 EF": ["--compression", "gift-int3"],
        "gift-nvfp4 EF": ["--compression", "gift-nvfp4"],
        "int3 plain": ["--compression", "int3", "--no-error-feedback"],
        "nvfp4 plain": ["--compression", "nvfp4", "--no-error-feedback"],
        "gift-fp8 EF": ["--compression", "gift-fp8"]}
CORE = ["fp32", "gift-int3 EF", "gift-nvfp4 EF", "int3 plain"]
GAINS = [("gift-int3 EF", "int3 plain"), ("gift-nvfp4 EF", "nvfp4 plain")]
STAGES = ["stdlib:128:5:all", "stdlib:256:3:all", "gnu-info:128:3:all", "stdlib:256:5:all",
          "stdlib:512:3:core"]


def layers(dim):
    return max(2, dim // 64)


def learning_rate(dim):
    return 3e-3 * 128 / dim


def regime(dim, steps):
    return f"l{layers(dim)}-lr{learning_rate(dim):.3g}-n{steps}"


def corpus_file(name, runs):
    """None for stdlib (data.py's default); else the text file, made once."""
    if name != "gnu-info":
        return None if name == "stdlib" else sys.exit(f"unknown corpus {name}")
    path = runs / "corpora" / "gnu-info.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        files = sorted(pathlib.Path("/usr/share/info").glob("*.info*.gz"))
        path.write_bytes(b"".join(gzip.open(f).read() for f in files))
    return path


@functools.cache
def parameters(dim):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import train_llama
    model = train_llama.build_model(train_llama.parse_args(
        ["--dim", str(dim), "--layers", str(layers(dim))]), torch.device("cpu"))
    return sum(p.numel() for p in model.parameters())


def tag(arm, seed):
    return f"{arm.replace(' ', '_')}-s{seed}"


def train(corpus, dim, arm, seed, args, out_dir):
    """One torchrun of train_llama (tried twice); its wall seconds, or None."""
    csv_path = out_dir / f"{tag(arm, seed)}.csv"
    data = corpus_file(corpus, args.runs)
    command = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node",
               "2", str(ROOT / "examples" / "train_llama.py"), "--engine", "ddp", *ARMS[arm],
               "--steps", str(args.steps), "--seed", str(seed), "--dim", str(dim),
               "--layers", str(layers(dim)), "--lr", f"{learning_rate(dim):.6g}",
               "--eval-every", "25", "--eval-batches", "16", "--gradient-error", "--quiet",
               "--csv", str(csv_path)] + (["--data", str(data)] if data else [])
    for attempt in (1, 2):
        t0 = time.perf_counter()
        with open(out_dir / f"{tag(arm, seed)}.log", "w") as log:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
        wall = time.perf_counter() - t0
        if rc == 0 and csv_path.exists():
            (out_dir / f"{tag(arm, seed)}.wall").write_text(f"{wall:.1f}\n")
            print(f"{corpus} d{dim} {tag(arm, seed)}: {wall:.0f} s", flush=True)
            return wall
        print(f"{corpus} d{dim} {tag(arm, seed)}: FAILED rc={rc} (try {attempt})", flush=True)
    return None


def load(out_dir):
    """{(arm, seed): result} of the CSVs in out_dir."""
    results = {}
    for arm in ARMS:
        for path in sorted(out_dir.glob(f"{tag(arm, '')}*.csv")):
            seed = int(path.stem.rsplit("-s", 1)[1])
            with open(path) as f:
                rows = list(csv.DictReader(f))
            heldout = [float(r["heldout_loss"]) for r in rows if r["heldout_loss"]]
            wall = path.with_suffix(".wall")
            mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
            results[(arm, seed)] = {
                "final": heldout[-1], "bits": float(rows[-1]["bits_per_element"]),
                "grad": mean("gradient_rel_l2"), "step": mean("seconds"),
                "wall": float(wall.read_text()) if wall.exists() else float("nan")}
    return results


def paired(results, a, b):
    """[(a - b) per seed that has both]."""
    seeds = sorted(s for (arm, s) in results if arm == a and (b, s) in results)
    return [results[(a, s)]["final"] - results[(b, s)]["final"] for s in seeds]


# a reading written by hand into the report, kept when the script rewrites it
READING = ("<!-- reading: written by hand, kept when the script rewrites this file -->",
           "<!-- /reading -->")


def kept_reading(path):
    text = path.read_text() if path.exists() else ""
    start, end = text.find(READING[0]), text.find(READING[1])
    return [text[start:end + len(READING[1])], ""] if 0 <= start < end else []


def report(args):
    """Tables from whatever CSVs exist, and the two plots."""
    saved = args.runs / "commands.txt"     # every sweep's command, in order
    commands = (saved.read_text().splitlines() if saved.exists()
                else [shlex.join(sys.argv[1:])])
    lines = [f"# Scaling: the loss gap against width ({time.strftime('%Y-%m-%d')})", "",
             *kept_reading(args.out),
             "Commands (in order; each reuses the runs before it):", "",
             *(f"- `nice -n 19 .venv/bin/python benchmarks/scaling.py {c}`" for c in commands),
             "",
             f"examples/train_llama.py --engine ddp on 2 ranks (torchrun, gloo), one 2-core "
             f"machine, {args.steps} steps of 16 x 128 bytes a rank; layers = dim/64 (>= 2), "
             "heads = dim/32, AdamW lr = 3e-3 * 128 / dim (muP's 1/width rule), 20 warm-up "
             "steps. vs fp32: held-out loss at the last step (16 fixed batches), mean paired "
             "difference over the seeds both arms have, 95 % CI (Student's t); negative is "
             "better. gift-* EF: "
             "whitening + error feedback; plain: neither. Wall: one run, start to end. Corpora: "
             "stdlib (Python source), gnu-info (/usr/share/info's manuals, English prose). "
             "Rules and reasons: the docstring of benchmarks/scaling.py.", ""]
    points, gains = {}, {}     # (corpus, arm) -> [(params, gap %, half-width %)]
    corpora = [p for p in args.runs.iterdir() if p.is_dir() and p.name != "corpora"]
    for corpus_dir in sorted(corpora, key=lambda p: (p.name != "stdlib", p.name)):
        for dim_dir in sorted((p for p in corpus_dir.glob("d*")), key=lambda p: int(p.name[1:])):
            dim = int(dim_dir.name[1:])
            results = load(dim_dir / regime(dim, args.steps))
            if not results:
                continue
            n = parameters(dim)
            lines += [f"## {corpus_dir.name}, dim {dim}, {layers(dim)} layers, {n / 1e6:.2f} M "
                      f"parameters, lr {learning_rate(dim):.3g}", "",
                      "| arm | seeds | held-out loss | vs fp32 (95 % CI) | vs fp32 % (95 % CI) "
                      "| gradient RelL2 | bits/element | step (s) | wall per run (s) |",
                      "|---|---|---|---|---|---|---|---|---|"]
            fp32 = [r["final"] for (a, _), r in results.items() if a == "fp32"] or [math.nan]
            base = sum(fp32) / len(fp32)
            for arm in ARMS:
                runs = [r for (a, _), r in results.items() if a == arm]
                if not runs:
                    continue
                mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
                diffs, gap, pct = paired(results, arm, "fp32"), "-", "-"
                if arm != "fp32" and diffs:
                    d, h = interval(diffs)
                    gap, pct = f"{d:+.4f} (1 seed: no interval)", f"{100 * d / base:+.2f}"
                    if len(diffs) > 1:
                        gap = f"{d:+.4f} ({d - h:+.4f} .. {d + h:+.4f})"
                        pct = f"{100 * d / base:+.2f} ({100 * (d - h) / base:+.2f} .. " \
                              f"{100 * (d + h) / base:+.2f})"
                    points.setdefault((corpus_dir.name, arm), []).append(
                        (n, 100 * d / base, 100 * h / base))
                lines.append(f"| {arm} | {len(runs)} | {mean('final'):.4f} | {gap} | {pct} | "
                             f"{mean('grad'):.2e} | {mean('bits'):.2f} | {mean('step'):.3f} | "
                             f"{mean('wall'):.0f} |")
            lines += ["", "Whitening + error feedback against neither (paired, 95 % CI):", ""]
            if not any(paired(results, a, b) for a, b in GAINS):
                lines.append("- not run at this width")
            for a, b in GAINS:
                diffs = paired(results, a, b)
                if diffs:
                    d, h = interval(diffs)
                    lines.append(f"- {a} - {b}: {d:+.4f} ({d - h:+.4f} .. {d + h:+.4f}), "
                                 f"{len(diffs)} seeds")
                    if math.isfinite(base):     # a stage without fp32 has no scale for it
                        gains.setdefault((corpus_dir.name, f"{a} - {b}"), []).append(
                            (n, 100 * d / base, 100 * h / base))
            lines.append("")
    gap_png, gain_png = (args.out.with_name(f"{args.out.stem}_{k}.png") for k in ("gap", "gain"))
    lines += [f"![gap against parameters]({gap_png.name})", "",
              f"![whitening's gain against parameters]({gain_png.name})"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    plot(points, "held-out loss - fp32's (% of fp32), 95 % CI", gap_png)
    plot(gains, "held-out loss difference (% of fp32), 95 % CI", gain_png)
    print(f"wrote {args.out}", flush=True)


def plot(series, ylabel, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402
    fig, ax = plt.subplots(figsize=(8, 5))
    names = sorted({name for _, name in series})        # one colour an arm in both corpora
    for i, ((corpus, name), pts) in enumerate(sorted(series.items())):
        x = [n * 1.04 ** (i - len(series) / 2) for n, _, _ in pts]     # spread the error bars
        ax.errorbar(x, [g for _, g, _ in pts], yerr=[h for _, _, h in pts], capsize=3,
                    color=f"C{names.index(name)}",
                    marker="o" if corpus == "stdlib" else "s",
                    linestyle="-" if corpus == "stdlib" else "--", label=f"{name} ({corpus})")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xscale="log", xlabel="parameters", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", default=STAGES, help="corpus:dim:seeds:all|core|a,b")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--deadline", default=None, help="HH:MM UTC: start no run ending later")
    p.add_argument("--runs", type=pathlib.Path, default=ROOT / "runs" / "scaling")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks/results/scaling.md")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return report(args)
    with open(args.runs / "commands.txt", "a") as history:
        history.write(shlex.join(sys.argv[1:]) + "\n")
    deadline = args.deadline and datetime.datetime.now(datetime.timezone.utc).replace(
        hour=int(args.deadline[:2]), minute=int(args.deadline[3:]), second=0).timestamp()
    last = {}       # dim -> wall seconds of its slowest run
    for stage in args.stages:
        corpus, dim, seeds, arms = stage.split(":")
        dim = int(dim)
        arms = list(ARMS) if arms == "all" else CORE if arms == "core" else arms.split(",")
        out_dir = args.runs / corpus / f"d{dim}" / regime(dim, args.steps)
        out_dir.mkdir(parents=True, exist_ok=True)
        walls = [float(w.read_text()) for w in out_dir.glob("*.wall")]
        last[dim] = max(walls + [last.get(dim, 0)]) or None
        for seed in range(int(seeds)):
            for arm in arms:
                if (out_dir / f"{tag(arm, seed)}.csv").exists():
                    continue
                estimate = last.get(dim)
                known = [d for d in last if last[d]]
                if estimate is None and known:
                    near = min(known, key=lambda d: abs(d - dim))
                    estimate = 1.5 * last[near] * parameters(dim) / parameters(near)
                if deadline and estimate and time.time() + estimate + 60 > deadline:
                    print(f"skip {corpus} d{dim} {tag(arm, seed)}: ~{estimate:.0f} s would "
                          "pass the deadline", flush=True)
                    continue
                wall = train(corpus, dim, arm, seed, args, out_dir)
                if wall is not None:
                    last[dim] = max(wall, last.get(dim) or 0)
            report(args)


if __name__ == "__main__":
    sys.exit(main())
