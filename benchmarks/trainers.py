"""GIFT in the trainers, over paired seeds: a transformers GPT-2 trained by
examples/train_trainers.py under Lightning (DDP and FSDP2), Accelerate and the transformers
Trainer on 2 ranks (torchrun, gloo), each with and without GIFT (NVFP4), the same seed's model,
data and order in both. Held-out loss (64 sequences) at the end, GIFT's minus the trainer's own,
paired by seed: mean and 95 % interval; bits per gradient element GIFT sent.

    .venv/bin/python benchmarks/trainers.py          # about 8 minutes on 2 cores

Writes benchmarks/results/trainers.md.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from convergence import interval  # noqa: E402

TRAINERS = ["lightning", "lightning-fsdp", "accelerate", "hf"]


def run(trainer, seed, gift, epochs, scratch):
    out = pathlib.Path(scratch) / f"{trainer}-{seed}-{int(gift)}.json"
    command = [str(ROOT / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples/train_trainers.py"), "--trainer", trainer, "--seed", str(seed),
               "--epochs", str(epochs), "--folder", str(scratch), "--out", str(out)]
    done = subprocess.run(command + (["--gift"] if gift else []), cwd=ROOT, capture_output=True,
                          text=True)
    # Lightning's FSDP2 runs on gloo end, now and then, in an abort at interpreter exit ("terminate
    # called without an active exception", with or without GIFT): the result, written after
    # training and evaluation, counts
    if not out.exists():
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", nargs="+", default=TRAINERS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/trainers.md"))
    args = p.parse_args()
    t0 = time.perf_counter()
    lines = ["# GIFT in the trainers (" + time.strftime("%Y-%m-%d") + ")", "",
             "Command: `.venv/bin/python benchmarks/trainers.py " + " ".join(sys.argv[1:]) + "`",
             "", __doc__.split("\n\n")[0].replace("\n", " "), f"{args.epochs} epochs of 8 "
             "steps, AdamW lr 1e-2, GIFT NVFP4 with whitening (min_elements 1024); seeds "
             + " ".join(map(str, args.seeds)) + ".", "",
             "| trainer | held-out, without GIFT | with GIFT | GIFT - without (%), mean "
             "[95 % interval] | GIFT's bits / gradient element |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for trainer in args.trainers:
            plain = [run(trainer, s, False, args.epochs, scratch)["held_out"] for s in args.seeds]
            gift = [run(trainer, s, True, args.epochs, scratch) for s in args.seeds]
            losses = [g["held_out"] for g in gift]
            diffs = [100 * (g / b - 1) for g, b in zip(losses, plain)]
            mean, half = interval(diffs)
            bits = sum(g["stats"]["bits_per_element"] for g in gift) / len(gift)
            lines.append(f"| {trainer} | {sum(plain) / len(plain):.4f} | "
                         f"{sum(losses) / len(losses):.4f} | {mean:+.2f} "
                         f"[{mean - half:+.2f}, {mean + half:+.2f}] | {bits:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {(time.perf_counter() - t0) / 60:.0f} min. bits / element counts "
              "every gradient element, the tensors under min_elements (biases, norms) at 32.", ""]
    pathlib.Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
