"""The codec seconds a step of examples/train_llama.py on 2 ranks: this tree against an earlier
commit, paired runs (the two alternate, the order swapped every repeat).

    .venv/bin/python benchmarks/example_codec.py --before 06b513c     # about 5 minutes

The earlier commit is checked out into a temporary git worktree and imported from there with
this tree's virtual environment (its kernels/ linked in as horovod_gift.kernels, as the editable
install maps it). Reports per arm and version: the median over steps 2..N of the codec seconds
(rank 0's counter), the first step's seconds (kernel loading or compilation), and the median of
the paired ratios before / after. Writes benchmarks/results/example_codec.md.
"""
import argparse
import csv
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")


def run(tree, arm, args, csv_path):
    """One 2-rank run of the example in tree; (median codec seconds, first step seconds)."""
    command = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to",
               "none", "-x", "OMP_NUM_THREADS=1", "-x", f"PYTHONPATH={tree}", PY,
               str(pathlib.Path(tree) / "examples" / "train_llama.py"), "--compression", arm,
               "--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
               "--seq-len", "64", "--batch-size", "4", "--quiet", "--csv", str(csv_path)]
    subprocess.run(command, check=True, cwd=tree, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    codec = statistics.median(float(r["codec_seconds"]) for r in rows[1:])
    return codec, float(rows[0]["seconds"])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the earlier commit")
    p.add_argument("--arms", nargs="+", default=["gift-fp8", "gift-nvfp4"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "example_codec.md"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old = pathlib.Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            (old / "horovod_gift" / "kernels").symlink_to(old / "kernels")
            trees = {"before": str(old), "after": str(ROOT)}
            results = {(arm, v): [] for arm in args.arms for v in trees}
            for repeat in range(args.repeats):
                for arm in args.arms:
                    order = list(trees) if repeat % 2 == 0 else list(trees)[::-1]
                    for version in order:
                        got = run(trees[version], arm, args,
                                  pathlib.Path(scratch) / f"{arm}-{version}.csv")
                        results[arm, version].append(got)
                        print(f"{arm} {version}: codec {got[0]:.4f} s/step, first step "
                              f"{got[1]:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                           check=False, capture_output=True)
    command = " ".join(["benchmarks/example_codec.py"] + sys.argv[1:])
    lines = [f"# Codec seconds a step of the example, before and after "
             f"({time.strftime('%Y-%m-%d')})", "", f"Command: `.venv/bin/python {command}`",
             "", f"examples/train_llama.py --dim {args.dim} --layers {args.layers} --seq-len 64 "
             f"--batch-size 4, 2 ranks, OMP_NUM_THREADS=1, {args.steps} steps; before = "
             f"{args.before}, after = this tree; {args.repeats} paired repeats. Codec: median over "
             "steps 2..N of rank 0's codec seconds; first step: its wall seconds.", "",
             "| arm | codec before (s/step) | codec after (s/step) | before / after (paired) | "
             "first step before (s) | first step after (s) |", "|---|---|---|---|---|---|"]
    for arm in args.arms:
        before, after = results[arm, "before"], results[arm, "after"]
        ratios = [b[0] / a[0] for b, a in zip(before, after)]
        med = lambda runs, i: statistics.median(r[i] for r in runs)  # noqa: E731
        lines.append(f"| {arm} | {med(before, 0):.4f} | {med(after, 0):.4f} | "
                     f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
                     f"{med(before, 1):.2f} | {med(after, 1):.2f} |")
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
