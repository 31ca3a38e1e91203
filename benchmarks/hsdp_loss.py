"""Does GIFT under HSDP and two hops keep FSDP fp32's held-out loss? examples/train_llama.py on 4
ranks as 2 simulated nodes x 2 (torchrun, gloo, --node-size 2), paired seeds: FSDP2 fp32 (1-D),
HSDP + GIFT NVFP4 (bf16 residuals with stage 2's error folded in), the same with FP8 parameter
all-gathers, the same with fp32 residuals, and 1-D FSDP + GIFT over two hops with FP8
all-gathers.

fsdp_cluster.py times these arms over shaped links, 3 seeds; this study is the loss alone, with
more seeds and steps on this machine's loopback. Endpoint: the held-out loss at the last step, as
a mean paired difference to FSDP fp32 with a 95 % confidence interval (Student's t over seeds),
also in % of FSDP fp32's loss.

    .venv/bin/python benchmarks/hsdp_loss.py --seeds 0 1 2 3 4

Runs whose CSV is already in runs/hsdp_loss/ are reused. Writes benchmarks/results/hsdp_loss.md.
"""
import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from convergence import interval  # noqa: E402
from fsdp_feedback import parameters, run  # noqa: E402

GIFT = ["--compression", "gift-nvfp4", "--node-size", "2"]
FP8_GATHER = ["--param-format", "fp8_e4m3"]
# arm -> train_llama flags
ARMS = {"fsdp fp32": ["--engine", "fsdp", "--compression", "none"],
        "hsdp gift-nvfp4": ["--engine", "hsdp", *GIFT],
        "hsdp gift-nvfp4 ag8": ["--engine", "hsdp", *GIFT, *FP8_GATHER],
        # FSDP's residuals are bf16 by default, DDP's fp32: is that where HSDP's cost comes from?
        "hsdp gift-nvfp4 fp32 residuals": ["--engine", "hsdp", *GIFT, "--residual-dtype", "fp32"],
        "fsdp two-hop gift-nvfp4 ag8": ["--engine", "fsdp", *GIFT, *FP8_GATHER],
        # controls: the same two hops under DDP (fp32 residuals, whole-tensor whitening), and
        # HSDP with FP8 in place of NVFP4
        "ddp two-hop gift-nvfp4": ["--engine", "ddp", *GIFT],
        "hsdp gift-fp8": ["--engine", "hsdp", "--compression", "gift-fp8", "--node-size", "2"],
        "hsdp gift-int3": ["--engine", "hsdp", "--compression", "gift-int3", "--node-size", "2"]}
BASELINE = "fsdp fp32"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                   help="the arms to run and tabulate (the baseline always runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hsdp_loss.md"))
    args = p.parse_args()
    args.ranks = 4
    # runs are cached by arm and seed: a study of another length has a folder of its own
    out_dir = ROOT / "runs" / ("hsdp_loss" if args.steps == 200 else f"hsdp_loss_{args.steps}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    arms = [BASELINE] + [arm for arm in args.arms if arm != BASELINE]
    results = {(arm, s): run(arm, ARMS[arm], s, args, out_dir)
               for s in args.seeds for arm in arms}
    n_params = parameters(args)
    lines = [
        "# GIFT under HSDP and two hops: held-out loss against FSDP fp32", "",
        f"Command: `.venv/bin/python benchmarks/hsdp_loss.py --seeds "
        f"{' '.join(map(str, args.seeds))} --steps {args.steps}"
        f"{'' if arms == list(ARMS) else ' --arms ' + ' '.join(repr(a) for a in arms[1:])}` "
        f"({(time.perf_counter() - t0) / 60:.0f} min; runs already on disk are reused)", "",
        f"examples/train_llama.py on 4 ranks as 2 nodes x 2 (torchrun, gloo, this 2-core CPU "
        f"machine), --dim {args.dim} --layers {args.layers} ({n_params} parameters), "
        f"{args.steps} steps of AdamW, lr {args.lr}, 16 sequences a rank a step, held-out loss on "
        f"{args.eval_batches} fixed batches; seeds {args.seeds}, the same initialization and data "
        f"order in every arm. Difference: arm - {BASELINE} at the last step, mean over seeds "
        "with a 95 % confidence interval (t over seeds). Residuals: the bytes one rank held "
        "(measured) per parameter; bits: GIFT's quantized hop's, scales included.", "",
        f"| arm | held-out loss (mean) | vs {BASELINE} (95 % CI) | vs {BASELINE} (%) "
        "| residual bytes / parameter | bits / element | seconds a run |",
        "|---|---|---|---|---|---|---|"]
    base = sum(results[BASELINE, s]["final"] for s in args.seeds) / len(args.seeds)
    for arm in arms:
        runs = [results[arm, s] for s in args.seeds]
        finals = [r["final"] for r in runs]
        paired, percent = "-", "-"
        if arm != BASELINE:
            d, h = interval([results[arm, s]["final"] - results[BASELINE, s]["final"]
                             for s in args.seeds])
            paired = f"{d:+.4f} ({d - h:+.4f} .. {d + h:+.4f})"
            percent = f"{100 * d / base:+.2f} ({100 * (d - h) / base:+.2f} .. " \
                      f"{100 * (d + h) / base:+.2f})"
        lines.append(f"| {arm} | {sum(finals) / len(finals):.4f} | {paired} | {percent} | "
                     f"{runs[0]['residual_bytes'] / n_params:.2f} | {runs[0]['bits']:.2f} | "
                     f"{sum(r['seconds'] for r in runs) / len(runs):.0f} |")
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
