"""A simulated cluster: nodes of several ranks, one shaped link a node. Bytes that cross each
node's link a step, and wall-clock time to Horovod fp32's held-out loss, for Horovod fp32 (with
and without HOROVOD_HIERARCHICAL_ALLREDUCE=1), Horovod fp16, and GIFT flat and two-hop. Needs root
and iproute2; without them it says so and measures nothing.

    .venv/bin/python benchmarks/cluster.py          # about 80 minutes on 2 cores

Network (benchmarks/peers_net.py, per_node): a node is a network namespace holding its L ranks,
which talk over the namespace's own loopback (unshaped, as NVLink would be cheap); its one veth
to the bridge is shaped both ways by tc tbf at the configuration's rate. Open MPI over TCP only.
Bytes: what the node's veth sent during the second half of the training steps (/proc/net/dev:
wire bytes with headers and ACKs, Horovod's coordination included), per step, median over ranks
(every rank of a node reads the same counter), and per gradient element.
Training (benchmarks/peers_worker.py, the arms of benchmarks/peers.py): examples/train_llama.py's
model, data and AdamW, the same seeds and data order in every arm, arms interleaved within each
seed and rotated by one per seed; the clock is training time only. Configurations NODESxRANKS@RATE
in --configs are timed to a target (the median over seeds of Horovod fp32's held-out loss at
--target-step); those in --bytes-configs run --short-steps steps for bytes and step time.
Writes benchmarks/results/cluster.md and cluster.png; raw per-run JSON under runs/cluster/.
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import peers  # noqa: E402
import peers_net as net  # noqa: E402

ARMS = ["hvd-fp32", "hvd-fp32-hier", "hvd-fp16", "gift-nvfp4-flat", "gift-nvfp4-2hop",
        "gift-fp8-2hop"]


def parse_config(config):
    """'2x2@1gbit' -> (nodes, ranks a node, rate)."""
    shape, rate = config.split("@")
    nodes, per_node = map(int, shape.split("x"))
    return nodes, per_node, rate


def gradient_elements(args):
    import torch
    import train_llama
    model = train_llama.build_model(train_llama.parse_args(
        [f"--{f.replace('_', '-')}={getattr(args, f)}" for f in peers.FLAGS]), torch.device("cpu"))
    return sum(p.numel() for p in model.parameters())


def run_config(config, timed, args):
    nodes, per_node, rate = parse_config(config)
    ranks = nodes * per_node
    out_dir = ROOT / "runs" / "cluster" / config
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    seeds = args.seeds if timed else args.seeds[:1]
    if config in args.reuse:
        rates = json.loads((out_dir / "link.json").read_text())
        runs = {(arm, seed): json.loads((out_dir / f"{arm}-s{seed}.json").read_text())
                for arm in args.arms for seed in seeds}
        args.step_time_only = [] if timed else [config]
        return rates, runs, peers.summarize(runs, seeds, config, args)
    with net.Network(ranks, rate, per_node=per_node) as network:
        rates = (network.measure(0, 1), network.measure(1, 0))
        (out_dir / "link.json").write_text(json.dumps(rates))
        print(f"{config}: node 0 <-> 1 measured {rates[0] / 1e6:.0f} / {rates[1] / 1e6:.0f} "
              "Mbit/s", flush=True)
        for i, seed in enumerate(seeds):
            order = args.arms[i % len(args.arms):] + args.arms[:i % len(args.arms)]
            for arm in order:
                out = out_dir / f"{arm}-s{seed}.json"
                if config in args.resume and out.exists():     # an interrupted study goes on
                    runs[arm, seed] = json.loads(out.read_text())
                    continue
                seconds = peers.launch(ranks, arm, seed, args.steps if timed else args.short_steps,
                                       args, out, per_node=per_node,
                                       extra=["--node-size", str(per_node)])
                runs[arm, seed] = json.loads(out.read_text())
                print(f"  {config} seed {seed} {arm}: {seconds:.0f} s, held-out "
                      f"{runs[arm, seed]['evals'][-1]['heldout']:.4f}", flush=True)
    args.step_time_only = [] if timed else [config]
    return rates, runs, peers.summarize(runs, seeds, config, args)


def ratio(base, values):
    """base / value per paired seed, where both are there."""
    return [b / v for b, v in zip(base, values) if b and v]


def report(results, args, elements, wall):
    lines = [f"# Nodes of several ranks: bytes across nodes and time to target "
             f"({time.strftime('%Y-%m-%d')})", "", f"Command (as root): `{args.command}`", "",
             f"Model: examples/train_llama.py --dim {args.dim} --layers {args.layers} --seq-len "
             f"{args.seq_len} --lr {args.lr} ({elements / 1e6:.2f}M gradient elements), "
             f"{args.global_batch} sequences a step over all ranks; {args.steps} steps (timed "
             f"configurations) or {args.short_steps} (bytes only); held-out loss on "
             f"{args.eval_batches} validation batches every {args.eval_every} steps; seeds "
             f"{' '.join(map(str, args.seeds))}. Wall time {wall / 60:.0f} min.", "",
             "Node link: each node a network namespace holding its ranks (they talk over its "
             "loopback, unshaped); its one veth shaped both ways by tc tbf at the rate. "
             "Bytes: the node's veth, sent during the second half of the steps, per step (mean "
             "over those steps, and the median step, one without GIFT's refresh of its "
             "whitening statistics, which comes every 4 steps). "
             "Ratios: per paired seed, median [min-max]. `vs fp16` of time is fp16's time over "
             "the arm's (above 1: faster than Horovod fp16).", ""]
    for config, (rates, runs, (target, table)) in results.items():
        what = (f"target {target:.4f} = median held-out loss of hvd-fp32 at step "
                f"{args.target_step}" if target else f"{args.short_steps} steps, bytes only")
        lines += [f"## {config} ({what}; node link measured {rates[0] / 1e6:.0f} / "
                  f"{rates[1] / 1e6:.0f} Mbit/s)", "",
                  "| arm | B / gradient element / node link | vs hvd-fp16 bytes | typical step: "
                  "B / element | vs hvd-fp16 | time to target (s) | vs hvd-fp16 | vs hvd-fp32 | "
                  "step (s) | codec | waiting | final held-out |", "|---" * 12 + "|"]
        fp16, fp32 = table["hvd-fp16"], table["hvd-fp32"]
        seeds = sorted({seed for _, seed in runs})
        typical = {arm: [typical_step_bytes(runs[arm, seed]) for seed in seeds] for arm in table}
        for arm, m in table.items():
            per_element = [b / elements for b in m["bytes"]]
            by_bytes = [v / f for v, f in zip(m["bytes"], fp16["bytes"])]
            by_typical = [v / f for v, f in zip(typical[arm], typical["hvd-fp16"])]
            lines.append(
                f"| {arm} | {peers.fmt(per_element)} | {peers.fmt(by_bytes)}x | "
                f"{peers.fmt([b / elements for b in typical[arm]])} | "
                f"{peers.fmt(by_typical)}x | "
                f"{peers.fmt(m['time'], 1)} | {_ratio_text(fp16['time'], m['time'])} | "
                f"{_ratio_text(fp32['time'], m['time'])} | {peers.fmt(m['seconds'], 3)} | "
                f"{peers.fmt(m['codec'], 3)} | {peers.fmt(m['wait'], 3)} | "
                f"{peers.fmt(m['final'], 4)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def typical_step_bytes(run):
    """The median over the second half of the steps of what node 0's link sent in a step: a step
    without the whitening statistics' refresh (one step in refresh_every sends them too)."""
    return statistics.median(row["bytes"] for row in run["rows"][len(run["rows"]) // 2:])


def _ratio_text(base, values):
    r = ratio(base, values)
    return peers.fmt(r) + "x" if r else "-"


def plot(results, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    timed = [(c, r) for c, r in results.items() if r[2][0] is not None]
    fig, axes = plt.subplots(1, len(timed), figsize=(6 * len(timed), 4.5), squeeze=False)
    for ax, (config, (_, runs, (target, _))) in zip(axes[0], timed):
        for arm in args.arms:
            curves = [runs[arm, s]["evals"] for s in args.seeds]
            clock = [statistics.median(p) for p in zip(*[[e["clock"] for e in c] for c in curves])]
            loss = [statistics.median(p) for p in zip(*[[e["heldout"] for e in c] for c in curves])]
            ax.plot(clock, loss, marker=".", label=arm)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        nodes, per_node, rate = parse_config(config)
        ax.set(xlabel="training wall-clock (s)", ylabel="held-out loss (median over seeds)",
               title=f"{nodes} nodes x {per_node} ranks, {rate} node links")
        ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=["2x2@1gbit", "2x2@100mbit"],
                   help="NODESxRANKS@RATE, timed to the target")
    p.add_argument("--bytes-configs", nargs="*", default=["2x4@1gbit", "4x2@1gbit"],
                   help="NODESxRANKS@RATE, --short-steps steps, one seed: bytes and step time")
    p.add_argument("--arms", nargs="+", default=ARMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--target-step", type=int, default=90)
    p.add_argument("--short-steps", type=int, default=12)
    peers.add_training_flags(p)
    p.add_argument("--reuse", nargs="*", default=[],
                   help="configurations whose runs (and link rates) are read from runs/cluster/ "
                        "as an earlier invocation left them, not run again")
    p.add_argument("--resume", nargs="*", default=[],
                   help="configurations whose runs already in runs/cluster/ are kept: the rest run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cluster.md"))
    args = p.parse_args()
    args.command = " ".join([".venv/bin/python", "benchmarks/cluster.py"] + sys.argv[1:])
    assert {"hvd-fp32", "hvd-fp16"} <= set(args.arms), "the baselines"
    return args


def main():
    args = parse_args()
    if not peers.can_shape("cluster.py"):
        return 0
    t0 = time.perf_counter()
    elements = gradient_elements(args)
    results = {}
    for config in args.configs + args.bytes_configs:
        results[config] = run_config(config, config in args.configs, args)
    text = report(results, args, elements, time.perf_counter() - t0)
    out = pathlib.Path(args.out)
    out.write_text(text + peers.kept_discussion(out))
    if args.configs:
        plot(results, args, out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
