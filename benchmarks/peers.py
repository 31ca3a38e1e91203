"""GIFT against what users would pick instead, each rank behind its own shaped link: wall-clock
training time to a held-out loss target for Horovod fp32 / fp16, torch DDP fp32, DDP + its bf16
hook, DDP + PowerSGD (rank 1 and 4), DDP + GIFT's hook, FSDP2 fp32 and FSDP2 + GIFT's
reduce-scatter, and GIFT through Horovod (gift-fp8, gift-nvfp4). Needs root and iproute2;
without them it says so and measures nothing.

    .venv/bin/python benchmarks/peers.py            # about 40 minutes on 2 cores

Network (benchmarks/peers_net.py): each rank in its own network namespace, a veth to a bridge,
both ends shaped by tc tbf at the configuration's rate; its rate is measured with a TCP stream in
both directions before the runs. Open MPI (Horovod) and gloo (DDP) both go over those veths:
btl tcp,self only (no shared memory), GLOO_SOCKET_IFNAME, MASTER_ADDR = rank 0's address (DDP
and FSDP run over gloo).
Training (benchmarks/peers_worker.py): examples/train_llama.py's model, ByteBatches and AdamW
with its warm-up, the same seeds and data order in every arm; arms interleaved within each seed,
the order rotated by one arm per seed. Target: the median over seeds of Horovod fp32's held-out
loss at --target-step, measured in the same run; the clock is training time only (the held-out
evaluations are off it), interpolated linearly between evaluations. Configurations named in
--step-time-only run --short-steps steps and report step time, bytes and no target.
Writes benchmarks/results/peers.md and peers.png (held-out loss against time, 2 ranks at 1gbit);
raw per-run JSON under runs/peers/.
"""
import argparse
import itertools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers_net as net  # noqa: E402
from peers_worker import ARMS  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
DISCUSSION = "## Where GIFT wins, where it does not, and why"
FLAGS = ("dim", "layers", "seq_len", "lr", "eval_batches")


def launch(ranks, arm, seed, steps, args, out, per_node=1, extra=()):
    """One mpirun, each rank exec'd inside its namespace (per_node ranks share one: rank r in
    namespace r // per_node); MPI only over the veths (and a namespace's loopback). extra: more
    peers_worker.py flags."""
    command = ["mpirun", "-np", str(ranks), "--allow-run-as-root", "--oversubscribe",
               "--bind-to", "none", "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", net.IFNAME, "-x", "OMP_NUM_THREADS=1",
               "-x", f"MASTER_ADDR={net.address(0)}", "-x", "MASTER_PORT=29431",
               "-x", f"GLOO_SOCKET_IFNAME={net.IFNAME}", "-x", "PATH",
               "-x", f"PYTHONPATH={ROOT}",      # this tree's library, not the editable install's
               "bash", "-c",
               f'exec ip netns exec {net.PREFIX}$((OMPI_COMM_WORLD_RANK / {per_node})) "$@"',
               "rank",
               PY, str(ROOT / "benchmarks" / "peers_worker.py"), "--arm", arm,
               "--ifname", net.IFNAME, "--out", str(out), "--seed", str(seed),
               "--steps", str(steps), "--eval-every", str(args.eval_every), "--quiet",
               "--batch-size", str(args.global_batch // ranks), *extra]   # the same global batch
    for flag in FLAGS:
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                       timeout=args.run_timeout, env=dict(os.environ, **net.pmix_env()))
    return time.perf_counter() - t0


def time_to(evals, target):
    """Training seconds until the held-out loss first reaches target (linear between
    evaluations), or None."""
    for before, now in itertools.pairwise(evals):
        if now["heldout"] <= target:
            drop = before["heldout"] - now["heldout"]
            share = (before["heldout"] - target) / drop if drop > 0 else 1.0
            return before["clock"] + max(0.0, share) * (now["clock"] - before["clock"])
    return None


def heldout_at(evals, step):
    return next(e["heldout"] for e in evals if e["step"] == step)


def steady(run, key):
    """Median over the second half of the steps, after every arm's warm-up."""
    rows = run["rows"][len(run["rows"]) // 2:]
    return statistics.median(r[key] for r in rows)


def summarize(runs, seeds, config, args):
    """Per arm: lists over seeds of each metric (None where the target was not reached)."""
    timed = config not in args.step_time_only
    baseline = getattr(args, "baseline", "hvd-fp32")     # whose held-out loss is the target
    target = (statistics.median(heldout_at(runs[baseline, s]["evals"], args.target_step)
                                for s in seeds) if timed else None)
    table = {}
    for arm in args.arms:
        rs = [runs[arm, s] for s in seeds]
        half = [len(r["rows"]) - len(r["rows"]) // 2 for r in rs]
        table[arm] = {
            "time": [time_to(r["evals"], target) if timed else None for r in rs],
            "final": [r["evals"][-1]["heldout"] for r in rs],
            "bytes": [statistics.median(r["steady_bytes_by_rank"]) / n for r, n in zip(rs, half)],
            **{k: [steady(r, k) for r in rs] for k in ("seconds", "compute", "codec", "wait")}}
    return target, table


def fmt(values, digits=2, scale=1.0):
    """median [min-max] of the values reached; 'n/m reached' when some were not."""
    got = [v * scale for v in values if v is not None]
    if not got:
        return "not reached"
    text = f"{statistics.median(got):.{digits}f}"
    if len(got) > 1:
        text += f" [{min(got):.{digits}f}-{max(got):.{digits}f}]"
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)} reached)"
    return text


SETUP = """## Setup

- Each rank runs in its own network namespace on its own veth to a bridge; tc tbf at the
  configuration's rate on both ends of every veth (out of the rank and into it), MTU 1500. The
  rates above are one TCP stream between rank 0 and rank 1 through both shapers, measured by the
  receiver with Python sockets. Segmentation offloads stay on: tbf counts every segment of a
  64 KB super-packet with its headers, so the rate holds (the table), while with them off the
  per-packet cost on this 2-core VM caps an unshaped veth at {offloads_off:.0f} Mbit/s (measured
  in this run), below the 10 Gbit/s under test.
- Horovod: Open MPI `--mca btl tcp,self --mca btl_tcp_if_include gift0` (no shared memory), each
  rank exec'd by `ip netns exec` inside its namespace. PMIx 4 only has a TCP transport and
  listens on 127.0.0.1, which a rank in another namespace cannot reach, so mpirun's PMIx server
  listens on the bridge's address instead (PMIX_MCA_ptl_tcp_remote_connections): wire-up only.
  DDP: gloo, GLOO_SOCKET_IFNAME=gift0, MASTER_ADDR = rank 0's veth address, launched the same way.
- Same init (seed), data order (ByteBatches of seed and rank), AdamW and 20-step warm-up in every
  arm. Horovod's broadcast_optimizer_state is not called: on a fresh optimizer it takes one AdamW
  step on zero gradients, which changes Adam's bias correction for the next steps, and DDP takes
  none. DDP averages gradients, as Horovod does: same learning rate. PowerSGD:
  matrix_approximation_rank 1 or 4, error feedback and warm start on, start_powerSGD_iter =
  max(20 warm-up steps, 10 % of the steps) = {powersgd_start} as its documentation advises; other
  settings its defaults, but DDP with one gradient bucket (bucket_cap_mb=25 given explicitly):
  with DDP's default small first bucket, rank 4 aborted in gloo with a collective size mismatch
  (PowerSGD issues its allreduces from the callbacks of both buckets, whose order can differ
  between ranks). DDP fp32 keeps DDP's default buckets. GIFT: `train_llama.make_compression`,
  the library's defaults.
- Clock: training time only. The held-out evaluations are off it, and so is step 1 (GIFT's
  kernels compile there, DDP rebuilds its buckets). Time to target is interpolated linearly in
  the held-out loss between the evaluations on both sides of the crossing.
- Step split: Horovod fp32/fp16: waiting = time blocked in `optimizer.synchronize()` (the
  allreduces overlap backward until then; fp16's casts are in it), codec 0. GIFT: its own
  counters (codec work, time blocked on the network). DDP: waiting = the tail of backward()
  after the last local gradient and the last comm hook (DDP waits for its allreduces there);
  codec = PowerSGD hook time on the training thread (P = MQ, error feedback); its
  orthogonalization, Q = M^T P and decompression run in gloo's callback thread and count as
  waiting. Compute = the rest of the step (forward, backward, optimizer).
- Bytes: what the rank's veth sent during its training steps (/proc/net/dev in its namespace:
  wire bytes with TCP/IP headers and ACKs, Horovod's coordination messages included), divided
  by the steps; median over ranks.
"""


def report(results, rates, seeds, args, wall, offloads_off):
    title = ("# Time to a held-out loss against Horovod fp16 and PowerSGD "
             f"({time.strftime('%Y-%m-%d')})")
    model = (f"Model: examples/train_llama.py --dim {args.dim} --layers {args.layers} --seq-len "
             f"{args.seq_len} --lr {args.lr}, {args.global_batch} sequences a step over all ranks "
             f"(--batch-size {args.global_batch} / ranks); "
             f"{args.steps} steps, held-out loss on {args.eval_batches} validation batches every "
             f"{args.eval_every} steps; seeds {' '.join(map(str, seeds))}. Benchmark wall time "
             f"{wall / 60:.0f} min.")
    lines = [title, "", f"Command (as root): `{args.command}`", "", model, "",
             "## Links (measured before the runs)", "",
             "| configuration | rank 0 -> 1 | rank 1 -> 0 |", "|---|---|---|"]
    lines += [f"| {c} | {a / 1e6:.0f} Mbit/s | {b / 1e6:.0f} Mbit/s |" for c, (a, b) in
              rates.items()]
    setup = SETUP.format(offloads_off=offloads_off / 1e6,
                         powersgd_start=max(20, args.steps // 10))
    lines += ["", setup.rstrip(), "", "## Results", "",
              ("Median [min-max] over seeds. Time: training seconds until the held-out loss "
               "reaches the target; step split and bytes: medians over the second half of each "
               "run."), ""]
    head = ("| arm | time to target (s) | vs hvd-fp32 | step (s) | compute | codec | waiting "
            "| MB/step/rank | final held-out |")
    for config, (target, table) in results.items():
        what = (f"target {target:.4f} = median of hvd-fp32 at step {args.target_step}"
                if target else f"{args.short_steps} steps, step time only")
        lines += [f"### {config} ({what})", "", head, "|---" * 9 + "|"]
        base = table["hvd-fp32"]["time"]
        for arm, m in table.items():
            ratio = [b / t for b, t in zip(base, m["time"]) if b and t]
            lines.append(
                f"| {arm} | {fmt(m['time'], 1)} | {fmt(ratio) + 'x' if ratio else '-'} | "
                f"{fmt(m['seconds'], 3)} | {fmt(m['compute'], 3)} | {fmt(m['codec'], 3)} | "
                f"{fmt(m['wait'], 3)} | {fmt(m['bytes'], 2, 1e-6)} | {fmt(m['final'], 4)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def kept_discussion(path):
    """The hand-written discussion at the end of an earlier peers.md, kept across reruns."""
    old = path.read_text() if path.exists() else ""
    at = old.find(DISCUSSION)
    return "" if at < 0 else "\n" + old[at:]


def plot(runs, seeds, arms, target, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm in arms:
        curves = [runs[arm, s]["evals"] for s in seeds]
        clock = [statistics.median(p) for p in zip(*[[e["clock"] for e in c] for c in curves])]
        loss = [statistics.median(p) for p in zip(*[[e["heldout"] for e in c] for c in curves])]
        ax.plot(clock, loss, marker=".", label=arm)
    if target:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set(xlabel="training wall-clock (s), evaluation excluded",
           ylabel="held-out loss (median over seeds)", title="2 ranks, each on its own 1 Gbit/s")
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_training_flags(p):
    """The model, data and run flags peers.py and cluster.py share."""
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per step over all ranks (8 a rank on 2 ranks, 4 on 4)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-timeout", type=int, default=900, help="seconds a run may take")


def can_shape(script):
    """True where the shaped network can be built; else says why. A SIGTERM or SIGHUP then
    unwinds through the finally blocks, so the namespaces go with the run."""
    reason = net.available()
    if reason:
        print(f"{script}: {reason}: nothing measured")
        return False
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    return True


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["2x1gbit", "4x1gbit", "2x10gbit",
                                                    "2x100mbit"], help="RANKSxRATE")
    p.add_argument("--step-time-only", nargs="*", default=["2x100mbit"])
    p.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--target-step", type=int, default=120)
    p.add_argument("--short-steps", type=int, default=16)
    add_training_flags(p)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers.md"))
    args = p.parse_args()
    args.command = " ".join([".venv/bin/python", "benchmarks/peers.py"] + sys.argv[1:])
    assert "hvd-fp32" in args.arms, "hvd-fp32 sets the target"
    assert args.target_step % args.eval_every == 0 and args.target_step <= args.steps
    return args


def main():
    args = parse_args()
    if not can_shape("peers.py"):
        return 0
    t_start = time.perf_counter()
    with net.Network(2, None, offloads=False) as network:
        offloads_off = network.measure(0, 1)
    results, rates, runs_1g = {}, {}, None
    for config in args.configs:
        ranks, rate = int(config.split("x")[0]), config.split("x")[1]
        timed = config not in args.step_time_only
        steps = args.steps if timed else args.short_steps
        out_dir = ROOT / "runs" / "peers" / config
        out_dir.mkdir(parents=True, exist_ok=True)
        runs = {}
        with net.Network(ranks, rate) as network:
            rates[config] = (network.measure(0, 1), network.measure(1, 0))
            print(f"{config}: measured {rates[config][0] / 1e6:.0f} / "
                  f"{rates[config][1] / 1e6:.0f} Mbit/s", flush=True)
            for i, seed in enumerate(args.seeds):
                order = args.arms[i % len(args.arms):] + args.arms[:i % len(args.arms)]
                for arm in order:
                    out = out_dir / f"{arm}-s{seed}.json"
                    seconds = launch(ranks, arm, seed, steps, args, out)
                    runs[arm, seed] = json.loads(out.read_text())
                    print(f"  {config} seed {seed} {arm}: {seconds:.0f} s, held-out "
                          f"{runs[arm, seed]['evals'][-1]['heldout']:.4f}", flush=True)
        results[config] = summarize(runs, args.seeds, config, args)
        if config == "2x1gbit":
            runs_1g = runs
    text = report(results, rates, args.seeds, args, time.perf_counter() - t_start,
                  offloads_off)
    out = pathlib.Path(args.out)
    out.write_text(text + kept_discussion(out))
    if runs_1g is not None:
        plot(runs_1g, args.seeds, args.arms, results["2x1gbit"][0],
             pathlib.Path(args.out).with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
