"""The round-trip error of each format with and without the whitening, per width (issue 58,
figure 2): benchmarks/fidelity.py at each width of benchmarks/scaling.py's sweep (its layers
and learning-rate rules), statistics of earlier batches only (t-1, ema10), at steps 10 and 100.

    nice .venv/bin/python benchmarks/scaling_fidelity.py --dims 128 256 512   # ~30 min, 2 cores

Each width's full report is runs/fidelity/d<dim>.md (made once; delete it to measure again),
copied to benchmarks/results/scaling_fidelity_d<dim>.md; the summary, RelL2 = ||Q(G) - G|| /
||G|| over every Linear weight gradient of the step with no transform ("none"), the library's
rotation ("hadamard") and its whitening ("whiten": isotropic-r32-d1, GiftConfig's default) from
the ema10 source, is benchmarks/results/scaling_fidelity.md. fidelity.py sets heads = dim / 64
(train_llama: dim / 32): the linear layers' shapes, whose gradients are measured, are the same.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from scaling import layers, learning_rate, parameters  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRANSFORMS = {"none": "none", "hadamard": "hadamard", "whiten": "isotropic-r32-d1"}
CODECS = {"fp8_e5m2": "FP8 E5M2", "nvfp4": "NVFP4", "int3": "INT3"}
SOURCE = "ema10"


def measured(dim, runs):
    """Width dim's fidelity report (made by fidelity.py unless it exists)."""
    path = runs / f"d{dim}.md"
    if not path.exists():
        runs.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--dim",
                        str(dim), "--layers", str(layers(dim)), "--lr", f"{learning_rate(dim):.6g}",
                        "--steps", "10", "100", "--sources", "t-1", SOURCE, "--codecs",
                        *CODECS, "--transforms", *TRANSFORMS.values(), "--out", str(path)],
                       check=True, cwd=ROOT)
    return path.read_text()


def rel_l2(report, codec, step):
    """{transform spec: RelL2} of one codec's table at one step, the SOURCE column."""
    section = next(s for s in report.split("\n## ") if s.startswith(CODECS[codec])
                   and s.splitlines()[0].endswith(f"step {step}"))
    header = next(line for line in section.splitlines() if line.startswith("| transform"))
    column = [c.strip() for c in header.split("|")].index(SOURCE)
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > column and cells[1] in TRANSFORMS.values():
            out[cells[1]] = float(re.match(r"[0-9.e+-]+", cells[column]).group())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--runs", default=str(ROOT / "runs" / "fidelity"))
    args = p.parse_args()
    results = ROOT / "benchmarks" / "results"
    lines = ["# Round-trip error against width (issue 58)", "",
             "Command: `.venv/bin/python benchmarks/scaling_fidelity.py "
             + " ".join(sys.argv[1:]) + "`; each width's report (and its fidelity.py command): "
             "scaling_fidelity_d<dim>.md. RelL2 over the step's Linear weight gradients, "
             f"statistics from {SOURCE} (earlier batches only); whiten's gain over none in "
             "brackets. Definitions: the docstring of benchmarks/scaling_fidelity.py.", "",
             "| dim | parameters | step | format | none | hadamard | whiten (gain) |",
             "|---|---|---|---|---|---|---|"]
    for dim in args.dims:
        report = measured(dim, pathlib.Path(args.runs))
        shutil.copyfile(pathlib.Path(args.runs) / f"d{dim}.md",
                        results / f"scaling_fidelity_d{dim}.md")
        for step in (10, 100):
            for codec in CODECS:
                r = rel_l2(report, codec, step)
                none, had, white = (r[TRANSFORMS[k]] for k in ("none", "hadamard", "whiten"))
                lines.append(f"| {dim} | {parameters(dim) / 1e6:.2f} M | {step} | "
                             f"{CODECS[codec]} | {none:.3f} | {had:.3f} | {white:.3f} "
                             f"({none / white:.2f}x) |")
    text = "\n".join(lines) + "\n"
    print(text)
    (results / "scaling_fidelity.md").write_text(text)


if __name__ == "__main__":
    main()
