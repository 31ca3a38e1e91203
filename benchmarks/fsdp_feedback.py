"""What error feedback costs and buys under FSDP2 (horovod_gift.fsdp): examples/train_llama.py
--engine fsdp on 2 ranks (torchrun, gloo), paired seeds, GIFT NVFP4 with fp32 residuals, bf16
residuals and none, against FSDP's own fp32 reduce-scatter.

Under FSDP a rank keeps 1/ranks of the parameters, gradients and Adam state (16 / ranks bytes per
parameter in fp32), but a residual covers every piece the rank encodes: the whole parameter
group, 4 bytes per parameter (fp32) or 2 (bf16), whatever the number of ranks. Endpoint: the
held-out loss at the last step, as a mean paired difference to fp32 with a 95 % confidence
interval (Student's t over seeds); memory: the residual bytes a rank held, measured.

    .venv/bin/python benchmarks/fsdp_feedback.py --seeds 0 1 2 3 4

Runs whose CSV is already in runs/fsdp_feedback/ are reused. Writes
benchmarks/results/fsdp_feedback.md.
"""
import argparse
import csv
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from convergence import interval  # noqa: E402

FSDP = ["--engine", "fsdp"]
# arm -> train_llama flags
ARMS = {"fsdp fp32": FSDP + ["--compression", "none"],
        "gift-nvfp4 EF fp32": FSDP + ["--compression", "gift-nvfp4", "--residual-dtype", "fp32"],
        "gift-nvfp4 EF bf16": FSDP + ["--compression", "gift-nvfp4", "--residual-dtype", "bf16"],
        "gift-nvfp4 no EF": FSDP + ["--compression", "gift-nvfp4", "--no-error-feedback"]}


def run(arm, flags, seed, args, out_dir):
    """One torchrun of examples/train_llama.py with flags (the engine's among them), or the
    result already on disk: the held-out loss at the last step and what the log says."""
    tag = f"{arm.replace(' ', '_')}-s{seed}"
    csv_path, log_path = out_dir / f"{tag}.csv", out_dir / f"{tag}.log"
    if not csv_path.exists():
        command = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node",
                   str(args.ranks), str(ROOT / "examples" / "train_llama.py"),
                   *flags, "--steps", str(args.steps), "--seed", str(seed),
                   "--dim", str(args.dim), "--layers", str(args.layers), "--lr", str(args.lr),
                   "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
                   "--quiet", "--csv", str(csv_path)]
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        print(f"{tag}: {time.perf_counter() - t0:.0f} s", flush=True)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    found = re.search(r"residuals (\d+) bytes a rank", log_path.read_text())
    heldout = [float(r["heldout_loss"]) for r in rows if r["heldout_loss"]]
    return {"final": heldout[-1], "residual_bytes": int(found.group(1)) if found else 0,
            "bits": float(rows[-1]["bits_per_element"]),
            "seconds": sum(float(r["seconds"]) for r in rows)}


def parameters(args):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import train_llama
    model = train_llama.build_model(train_llama.parse_args(
        ["--dim", str(args.dim), "--layers", str(args.layers)]), torch.device("cpu"))
    return sum(p.numel() for p in model.parameters())


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fsdp_feedback.md"))
    args = p.parse_args()
    out_dir = ROOT / "runs" / "fsdp_feedback"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {(arm, s): run(arm, ARMS[arm], s, args, out_dir)
               for s in args.seeds for arm in ARMS}
    n_params = parameters(args)
    lines = [
        "# Error feedback under FSDP2: held-out loss and memory", "",
        f"Command: `.venv/bin/python benchmarks/fsdp_feedback.py --seeds "
        f"{' '.join(map(str, args.seeds))}` ({(time.perf_counter() - t0) / 60:.0f} min; runs "
        "already on disk are reused)", "",
        f"examples/train_llama.py --engine fsdp on {args.ranks} ranks (torchrun, gloo, this "
        f"2-core CPU machine), --dim {args.dim} --layers {args.layers} ({n_params} parameters), "
        f"{args.steps} steps of AdamW, lr {args.lr}, held-out loss on {args.eval_batches} fixed "
        f"batches; seeds {args.seeds}, the same initialization and data order in every arm. "
        "Difference: arm - fsdp fp32 at the last step, mean over seeds with a 95 % confidence "
        "interval (t over seeds). Memory: the residual bytes one rank held (measured), per "
        "parameter; FSDP's own sharded state (fp32 parameters, gradients, Adam's two moments) "
        f"is 16 / {args.ranks} = {16 / args.ranks:.1f} bytes per parameter here, 16 / ranks in "
        "general.", "",
        "| arm | held-out loss (mean) | vs fsdp fp32 (95 % CI) | vs EF bf16 (95 % CI) "
        "| residual bytes / parameter | bits / element | seconds a run |",
        "|---|---|---|---|---|---|---|"]

    def paired(arm, against):
        if arm == against:
            return "-"
        d, h = interval([results[arm, s]["final"] - results[against, s]["final"]
                         for s in args.seeds])
        return f"{d:+.4f} ({d - h:+.4f} .. {d + h:+.4f})"

    for arm in ARMS:
        runs = [results[arm, s] for s in args.seeds]
        finals = [r["final"] for r in runs]
        lines.append(f"| {arm} | {sum(finals) / len(finals):.4f} | {paired(arm, 'fsdp fp32')} | "
                     f"{paired(arm, 'gift-nvfp4 EF bf16')} | "
                     f"{runs[0]['residual_bytes'] / n_params:.2f} | {runs[0]['bits']:.2f} | "
                     f"{sum(r['seconds'] for r in runs) / len(runs):.0f} |")
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
