"""FSDP2 across nodes on the simulated cluster (benchmarks/cluster.py's network: a namespace a
node, its one link shaped): bytes across a node's link per gradient element a step, time to FSDP
fp32's held-out target, final held-out loss, GIFT's residual bytes and peak memory per rank, for
FSDP2 and HSDP in fp32 and with bf16 gradients (MixedPrecisionPolicy(reduce_dtype=bf16)), HSDP +
GIFT, and 1-D FSDP + GIFT in one hop and in two. Needs root and iproute2.

    .venv/bin/python benchmarks/fsdp_cluster.py      # about 60 minutes on 2 cores

Writes benchmarks/results/fsdp_cluster.md and fsdp_cluster.png; raw runs under runs/cluster/.
"""
import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import cluster  # noqa: E402
import peers  # noqa: E402

ARMS = ["fsdp-fp32", "fsdp-bf16", "hsdp-fp32", "hsdp-bf16", "hsdp-gift-nvfp4",
        "hsdp-gift-nvfp4-ag8", "fsdp-gift-nvfp4", "fsdp-gift-nvfp4-2hop",
        "fsdp-gift-nvfp4-2hop-ag8", "fsdp-gift-nvfp4-2hop-ag8-hpz"]
BASELINE, BYTES_BASELINE = "fsdp-fp32", "hsdp-bf16"


def report(results, args, elements, wall):
    lines = [f"# FSDP2 across nodes: HSDP and two hops with GIFT ({time.strftime('%Y-%m-%d')})",
             "", f"Command (as root): `{args.command}`", "",
             f"Model: examples/train_llama.py --dim {args.dim} --layers {args.layers} --seq-len "
             f"{args.seq_len} --lr {args.lr} ({elements / 1e6:.2f}M gradient elements), each "
             f"block and the model fully_shard'ed; {args.global_batch} sequences a step over all "
             f"ranks; {args.steps} steps (timed configurations) or {args.short_steps} (bytes "
             f"only); held-out loss on {args.eval_batches} validation batches every "
             f"{args.eval_every} steps; seeds {' '.join(map(str, args.seeds))}. Wall time "
             f"{wall / 60:.0f} min.", "",
             "Network as in cluster.md: a node is a namespace whose ranks talk over its own "
             "loopback; its one veth is shaped both ways at the rate. Bytes: what that veth sent "
             "in the second half of the steps, per step and gradient element: parameter "
             "all-gathers (fp32 in every arm) and gradient reductions together, over gloo "
             "(whose reduce-scatter and all-gather algorithms are not NCCL's). "
             "Typical step: the median step of that half, one without GIFT's refresh of its "
             "whitening statistics (every 4 steps an fp32 all-reduce over every rank, large "
             "on this small model: 2 % of the gradient at Llama-8B shapes, cluster.md). "
             "GIFT's count: the bytes its quantized hop handed to gloo, all ranks of a node "
             "summed, per step (the gradients alone: under 1-D FSDP the link also carries the "
             "parameter all-gathers). "
             f"Ratios per paired seed, median [min-max]; `vs {BYTES_BASELINE}` of bytes, "
             f"`vs {BASELINE}` of time (above 1: faster) and of final held-out loss (in %).", ""]
    for config, (rates, runs, (target, table)) in results.items():
        what = (f"target {target:.4f} = median held-out loss of {BASELINE} at step "
                f"{args.target_step}" if target else f"{args.short_steps} steps, bytes only")
        lines += [f"## {config} ({what}; node link measured {rates[0] / 1e6:.0f} / "
                  f"{rates[1] / 1e6:.0f} Mbit/s)", "",
                  f"| arm | B / gradient element / node link | vs {BYTES_BASELINE} | typical "
                  f"step: B / element | vs {BYTES_BASELINE} | GIFT's "
                  "quantized gradients: B / element / node | time to "
                  f"target (s) | vs {BASELINE} | step (s) | final held-out | vs {BASELINE} (%) "
                  "| GIFT residual B / parameter / rank | peak RSS / rank (MB) |",
                  "|---" * 13 + "|"]
        seeds = sorted({seed for _, seed in runs})
        base, bytes_base = table[BASELINE], table[BYTES_BASELINE]
        for arm, m in table.items():
            per_element = [b / elements for b in m["bytes"]]
            residual = [statistics.median(runs[arm, s]["residual_bytes"]) / elements
                        for s in seeds]
            rss = [statistics.median(runs[arm, s]["max_rss_bytes"]) / 2 ** 20 for s in seeds]
            loss = [100 * (f / b - 1) for f, b in zip(m["final"], base["final"])]
            nodes, per_node, _ = cluster.parse_config(config)
            typical = [cluster.typical_step_bytes(runs[arm, s]) / elements for s in seeds]
            typical_base = [cluster.typical_step_bytes(runs[BYTES_BASELINE, s]) / elements
                            for s in seeds]
            gift = [sum(runs[arm, s]["gift_bytes_sent"]) / nodes / len(runs[arm, s]["rows"])
                    / elements for s in seeds]
            times = cluster.ratio(base["time"], m["time"])
            lines.append(
                f"| {arm} | {peers.fmt(per_element)} | "
                f"{peers.fmt([v / b for v, b in zip(m['bytes'], bytes_base['bytes'])])}x | "
                f"{peers.fmt(typical)} | "
                f"{peers.fmt([v / b for v, b in zip(typical, typical_base)])}x | "
                f"{peers.fmt(gift) if any(gift) else '-'} | "
                f"{peers.fmt(m['time'], 1)} | {peers.fmt(times) + 'x' if times else '-'} | "
                f"{peers.fmt(m['seconds'], 3)} | {peers.fmt(m['final'], 4)} | "
                f"{peers.fmt(loss)} | {peers.fmt(residual)} | {peers.fmt(rss, 0)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=["2x2@100mbit"],
                   help="NODESxRANKS@RATE, timed to the target")
    p.add_argument("--bytes-configs", nargs="*", default=["2x2@1gbit", "2x4@1gbit"],
                   help="NODESxRANKS@RATE, --short-steps steps, one seed: bytes and step time")
    p.add_argument("--arms", nargs="+", default=ARMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--target-step", type=int, default=90)
    p.add_argument("--short-steps", type=int, default=12)
    peers.add_training_flags(p)
    p.add_argument("--reuse", nargs="*", default=[],
                   help="configurations whose runs are read from runs/cluster/, not run again")
    p.add_argument("--resume", nargs="*", default=[],
                   help="configurations whose runs already in runs/cluster/ are kept: the rest run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fsdp_cluster.md"))
    args = p.parse_args()
    args.command = " ".join([".venv/bin/python", "benchmarks/fsdp_cluster.py"] + sys.argv[1:])
    args.baseline = BASELINE
    assert {BASELINE, BYTES_BASELINE} <= set(args.arms), "the baselines"
    return args


def main():
    args = parse_args()
    if not peers.can_shape("fsdp_cluster.py"):
        return 0
    t0 = time.perf_counter()
    elements = cluster.gradient_elements(args)
    results = {}
    for config in args.bytes_configs + args.configs:
        results[config] = cluster.run_config(config, config in args.configs, args)
        text = report(results, args, elements, time.perf_counter() - t0)
        pathlib.Path(args.out).write_text(text)     # what is measured so far
    if args.configs:
        cluster.plot(results, args, pathlib.Path(args.out).with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
