"""DiLoCo + GIFT on slow links (issue 55): each replica group a network namespace whose one link
is shaped to 10 or 100 Mbit/s (benchmarks/peers_net.py), against DDP every step and torchft's
DiLoCo without GIFT. Needs root and iproute2 for the timed part.

    .venv/bin/python benchmarks/diloco_cluster.py --seeds 0 1 2     # about 1 h on 2 cores

Two measurements, multiplied:
1. Loss (unshaped, processes on loopback): every arm and seed trains benchmarks/diloco_worker.py's
   model and data to its step budget, evaluating the held-out loss of the global weights every
   20 steps (DDP) or every H (DiLoCo: the global weights change only at a sync). The target is
   DDP fp32's held-out loss at --target-step, median over seeds; an arm's steps to target is the
   first evaluation at or below it.
2. Time and bytes (shaped, one seed): each arm runs two synchronization cycles (H inner steps;
   20 for DDP) with its replicas in namespaces; the bytes each replica's link sent and the
   seconds of each step are read over the second cycle (the first carries the connection
   set-up). Seconds per inner step = one compute time for every arm + the arm's own sync
   seconds per inner step (step_costs says how each is measured, and why).
Time to target = steps to target x seconds per inner step. That product is the run's clock
because an arm's trajectory in steps does not depend on the link: every arm here is
deterministic in steps (DDP and DiLoCo block at each sync; Streaming DiLoCo's overlap is a fixed
number of steps), so the loss measured unshaped is the loss the shaped run would reach.
Link-bound time to target = steps to target x sync seconds per inner step: that clock with the
compute taken out, the limit a job approaches as its step's compute falls below its sync's share.
On this 2-core CPU the example's step computes in 0.09-0.2 s, more than any DiLoCo arm's sync
share, so the full clock ranks the arms mostly by their steps; the link-bound one ranks them by
what they send and how often they sync, which is what a slow link decides.
Writes benchmarks/results/diloco_cluster.md and diloco_cluster.png; raw JSON under
runs/diloco_cluster/.
"""
import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers_net as net  # noqa: E402
from convergence import interval  # noqa: E402
from diloco_worker import ARMS  # noqa: E402
from scaling import kept_reading, learning_rate  # noqa: E402

RUNS = ROOT / "runs" / "diloco_cluster"
# a step whose link sent more synchronized (the lighthouse's heartbeats and a quorum's requests
# are a few kB; the smallest sync here, GIFT INT3's, about 90 kB a fragment)
SYNC_BYTES = 20_000
# issue 55's full-clock target against DDP fp32
SPEEDUP = 20
# sequences a rank a step of the first study, whose cached runs' names do not carry it
BATCH_SIZE = 16
# held-out sequences every evaluation reads, whatever --batch-size (the worker's default 8 x 16)
EVAL_SEQUENCES = 128


def lighthouse(bind, replicas):
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind=f"{bind}:0", min_replicas=replicas)
    return server, f"http://{bind}:{server.address().rsplit(':', 1)[1]}"


def launch(arm, seed, steps, eval_every, args, out, shaped):
    """Runs the arm's replicas to the end; returns their results."""
    server, address = lighthouse(net.BRIDGE_ADDRESS if shaped else "127.0.0.1", args.replicas)
    procs = []
    try:
        for k, local in ((k, j) for k in range(args.replicas) for j in range(args.group_size)):
            here = net.address(k) if shaped else "127.0.0.1"
            command = [sys.executable, str(ROOT / "benchmarks" / "diloco_worker.py"),
                       "--arm", arm, "--replica", str(k), "--replicas", str(args.replicas),
                       "--group-size", str(args.group_size), "--local", str(local),
                       "--address", here, "--peer", net.address(0) if shaped else here,
                       "--lighthouse", address, "--seed", str(seed), "--steps", str(steps),
                       "--eval-every", str(eval_every), "--dim", str(args.dim),
                       "--layers", str(args.layers), "--lr", str(args.lr),
                       "--batch-size", str(args.batch_size),
                       "--eval-batches", str(EVAL_SEQUENCES // args.batch_size),
                       "--out", f"{out}.{k}"]
            if shaped:      # a group's ranks share its namespace: one link a group
                command = ["ip", "netns", "exec", net.namespace(k), *command]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=net.IFNAME if shaped else "lo")
            log = open(f"{out}.{k}.log" if local == 0 else f"{out}.{k}.{local}.log", "w")
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=ROOT))
        deadline = time.monotonic() + args.run_timeout
        while any(p.poll() is None for p in procs):
            # a replica that fails leaves the others waiting for a quorum: stop at once
            if any(p.poll() for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"{arm} seed {seed}: a replica failed or ran past "
                                   f"--run-timeout, see {out}.*.log")
            time.sleep(1)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{arm} seed {seed}: a replica failed, see {out}.*.log")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.shutdown()
    return [json.loads(pathlib.Path(f"{out}.{k}").read_text()) for k in range(args.replicas)]


def key(arm, *parts):
    return "-".join([arm.replace(" ", "_").replace("+", "p"), *map(str, parts)])


def shape_tag(args):
    """The model and cluster in a cached run's name (the first study's 2 layers and 2 replica
    groups unnamed, so its runs stay reusable)."""
    return (f"d{args.dim}" + (f"-l{args.layers}" if args.layers != 2 else "")
            + (f"-lr{args.lr:g}" if args.lr != learning_rate(args.dim) else "")
            + (f"-r{args.replicas}" if args.replicas != 2 else "")
            + (f"-g{args.group_size}" if args.group_size != 1 else "")
            + (f"-b{args.batch_size}" if args.batch_size != BATCH_SIZE else ""))


def loss_run(arm, seed, args):
    kind, h, _ = ARMS[arm]
    steps = args.steps if kind == "ddp" else args.diloco_steps
    path = RUNS / "loss" / (key(arm, f"s{seed}", f"n{steps}", shape_tag(args)) + ".json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        results = launch(arm, seed, steps, 20 if kind == "ddp" else h, args, path, shaped=False)
        path.write_text(json.dumps(results[0]["evals"]))
    return json.loads(path.read_text())


def timed_run(arm, rate, args):
    kind, h, _ = ARMS[arm]
    cycle = 20 if kind == "ddp" else h
    path = RUNS / "time" / (key(arm, rate, shape_tag(args)) + ".json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with net.Network(args.replicas, rate):
            results = launch(arm, 0, 2 * cycle, 0, args, path, shaped=True)
        path.write_text(json.dumps({"parameters": results[0]["parameters"]}))
    # each replica's steps of the second cycle, from its own output
    return dict(json.loads(path.read_text()), second=[
        json.loads(pathlib.Path(f"{path}.{k}").read_text())["rows"][cycle:]
        for k in range(args.replicas)])


def step_costs(timing, rate, args):
    """(compute, per arm {seconds, sync, bytes} per inner step) at rate. Every arm computes the
    same model, batch and optimizer, so compute is one number: the median over every DiLoCo
    arm's steps whose link carried no synchronization (<= SYNC_BYTES); an arm's sync seconds are
    what its synchronizing steps took beyond it, spread over its cycle (DDP: every step). This
    keeps the 2-core machine's load, which moves every step's compute, out of the comparison
    of links; the bytes are each replica's link counter, median over replicas."""
    quiet = [x["seconds"] for arm in args.arms if ARMS[arm][0] != "ddp"
             for rows in timing[arm, rate]["second"] for x in rows if x["sent"] <= SYNC_BYTES]
    compute, costs = statistics.median(quiet), {}
    for arm in args.arms:
        second = timing[arm, rate]["second"]
        cycle = len(second[0])
        sync = statistics.median(sum(x["seconds"] - compute for x in rows
                                     if x["sent"] > SYNC_BYTES) / cycle for rows in second)
        costs[arm] = dict(seconds=compute + sync, sync=sync, bytes=statistics.median(
            sum(x["sent"] for x in rows) / cycle for rows in second))
    return compute, costs


def steps_to(evals, target):
    return next((e["step"] for e in evals if e["heldout"] <= target), None)


def compute_for_speedup(ratio, base_steps, base_sync, steps, sync):
    """The most compute seconds an inner step at which an arm that reaches the target in steps,
    syncing sync seconds an inner step, gets there ratio x sooner than a baseline (base_steps,
    base_sync): the c that solves base_steps (c + base_sync) = ratio steps (c + sync). None
    when not even link-bound (c = 0) it is ratio x sooner; inf when it is at any c. Compute is
    what a GPU changes, and what this CPU cannot show; the link's share is measured."""
    slack = base_steps * base_sync - ratio * steps * sync     # > 0: link-bound it is sooner
    if slack < 0:
        return None
    if ratio * steps <= base_steps:
        return float("inf")
    return slack / (ratio * steps - base_steps)


def paired(a, b):
    m, h = interval([x - y for x, y in zip(a, b)])
    base = statistics.mean(b)
    return f"{100 * m / base:+.2f} % ({100 * (m - h) / base:+.2f} .. {100 * (m + h) / base:+.2f})"


def compute_limit(seconds, base_sync):
    if seconds is None:
        return "not reached"
    if seconds == float("inf"):
        return "any"
    return f"{seconds:.3f} s ({100 * seconds / base_sync:.1f} % of DDP's sync)"


def spread(values, unit="", digits=0):
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    text = f"{statistics.median(got):.{digits}f}{unit}"
    if len(got) > 1:
        text += f" [{min(got):.{digits}f}-{max(got):.{digits}f}]"
    return text + ("" if len(got) == len(values) else f" ({len(got)}/{len(values)} reached)")


def report(losses, timing, target, args, wall):
    seeds = args.seeds
    parameters = next(iter(timing.values()))["parameters"]
    lines = [f"# DiLoCo + GIFT on shaped links ({time.strftime('%Y-%m-%d')})", "",
             "Command: `.venv/bin/python benchmarks/diloco_cluster.py "
             + shlex.join(sys.argv[1:]) + f"` ({wall / 60:.0f} min on 2 cores)", "",
             *kept_reading(args.out),
             f"Example Llama dim {args.dim}, {args.layers} layers ({parameters / 1e6:.2f} M "
             f"parameters), {args.replicas} replica "
             f"groups of {args.group_size} rank(s), each group in its own network namespace "
             "(DDP inside it over the namespace's loopback) with one link shaped both "
             f"ways; AdamW lr {args.lr:g}, {args.batch_size} x 128 bytes a rank a step; "
             f"DDP {args.steps} steps, DiLoCo arms {args.diloco_steps} inner steps; "
             f"seeds {seeds}. Target: DDP fp32's held-out loss at step {args.target_step}, "
             f"median over seeds: {target:.4f}. How the two measurements combine, and why: "
             "the docstring of benchmarks/diloco_cluster.py.",
             ""]
    ddp = [e[-1]["heldout"] for e in (losses["DDP fp32", s] for s in seeds)]
    for rate in args.rates:
        base_time = base_link = base_steps = None
        compute, costs = step_costs(timing, rate, args)
        lines += [f"## {rate}", "", f"Compute: {compute:.3f} s an inner step (every arm).", "",
                  "| arm | link bytes / inner step / parameter | sync s / inner step | "
                  "s / inner step | steps to target | time to target (s) | vs DDP fp32 | "
                  "link-bound time to target (s) | vs DDP fp32, link-bound | "
                  f"{SPEEDUP}x DDP fp32 while compute / inner step <= | "
                  "held-out at the end | vs DDP fp32 | vs DiLoCo fp32, same H |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm in args.arms:
            t = dict(costs[arm], parameters=timing[arm, rate]["parameters"])
            steps = [steps_to(losses[arm, s], target) for s in seeds]
            times = [None if n is None else n * t["seconds"] for n in steps]
            links = [None if n is None else n * t["sync"] for n in steps]
            if arm == "DDP fp32":
                base_time = statistics.median(x for x in times if x is not None)
                base_link = statistics.median(x for x in links if x is not None)
                base_steps = statistics.median(x for x in steps if x is not None)
                base_sync = t["sync"]
            speed, link_speed = (
                f"{base / statistics.median(got):.1f}x" if got and base else "-"
                for base, got in ((base_time, [x for x in times if x is not None]),
                                  (base_link, [x for x in links if x is not None])))
            reached = [x for x in steps if x is not None]
            limit = "-"
            if base_steps is not None and arm != "DDP fp32" and reached:
                limit = compute_limit(compute_for_speedup(
                    SPEEDUP, base_steps, base_sync, statistics.median(reached), t["sync"]),
                    base_sync)
            finals = [losses[arm, s][-1]["heldout"] for s in seeds]
            h = ARMS[arm][1]
            fp32 = f"DiLoCo fp32 H{h}"
            same_h = (paired(finals, [losses[fp32, s][-1]["heldout"] for s in seeds])
                      if ARMS[arm][0] != "ddp" and arm != fp32 and fp32 in args.arms else "-")
            lines.append(
                f"| {arm} | {t['bytes'] / t['parameters']:.4f} | {t['sync']:.4f} | "
                f"{t['seconds']:.3f} | "
                f"{spread(steps)} | {spread(times, digits=1)} | {speed} | "
                f"{spread(links, digits=1)} | {link_speed} | {limit} | "
                f"{statistics.mean(finals):.4f} | "
                f"{paired(finals, ddp) if arm != 'DDP fp32' else '-'} | {same_h} |")
        lines.append("")
    lines += ["Bytes: what a replica's shaped link sent per inner step over the second cycle "
              "(wire bytes, headers, ACKs and the lighthouse's heartbeats included), divided by "
              "the parameters. vs DDP fp32: the ratio of median times to target. Link-bound: steps "
              "to target x sync seconds per inner step (the module docstring). "
              f"{SPEEDUP}x DDP fp32 while compute <=: the most seconds of compute an inner "
              f"step (every arm's, DDP's too) at which the arm's full clock to the target is "
              f"still {SPEEDUP}x DDP fp32's, from the median steps and the sync seconds above "
              "(compute_for_speedup), and that as a share of DDP fp32's sync seconds a step: "
              "on a real cluster, compute a step against the gradient's bytes over the link. "
              "Held-out at the "
              "end: after each arm's own step budget (DDP's is shorter); the differences are "
              "paired over seeds with a 95 % interval (t).", "",
              f"![held-out loss against time]({args.out.with_suffix('.png').name})", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


def plot(losses, timing, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.rates), figsize=(6 * len(args.rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], args.rates):
        costs = step_costs(timing, rate, args)[1]
        for arm in args.arms:
            per_step = costs[arm]["seconds"]
            evals = losses[arm, args.seeds[0]]
            ax.plot([e["step"] * per_step for e in evals], [e["heldout"] for e in evals],
                    label=arm, marker="." if ARMS[arm][0] != "ddp" else None)
        ax.set_xscale("log")
        ax.set_xlabel(f"seconds at {rate} (seed {args.seeds[0]})")
        ax.set_ylabel("held-out loss")
        ax.set_ylim(top=2.6)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--rates", nargs="+", default=["10mbit", "100mbit"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--group-size", type=int, default=1,
                   help="ranks a replica group (DDP inside it, in one namespace)")
    p.add_argument("--steps", type=int, default=400, help="DDP's steps")
    p.add_argument("--diloco-steps", type=int, default=1000)
    p.add_argument("--target-step", type=int, default=200,
                   help="the DDP fp32 step whose held-out loss is the target")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                   help="sequences a rank a step: fewer make a step's compute a smaller share "
                        "of its sync, as a GPU's is against a slow link")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW's learning rate (default: scaling.py's muP rule, 3e-3 x 128 / dim)")
    p.add_argument("--run-timeout", type=int, default=1800)
    p.add_argument("--only", choices=["loss", "time"], default=None,
                   help="run one measurement's missing runs and stop (no report)")
    p.add_argument("--out", type=pathlib.Path,
                   default=ROOT / "benchmarks/results/diloco_cluster.md")
    args = p.parse_args()
    args.lr = learning_rate(args.dim) if args.lr is None else args.lr
    if args.batch_size < 1 or EVAL_SEQUENCES % args.batch_size:
        p.error(f"--batch-size must divide {EVAL_SEQUENCES} (the held-out sequences every "
                f"evaluation reads, the same for every batch size), got {args.batch_size}")
    reason = net.available()
    if reason:
        sys.exit(f"diloco_cluster.py: {reason}: nothing measured")
    t0 = time.perf_counter()
    losses, timing = {}, {}
    for seed in args.seeds if args.only != "time" else []:
        for arm in args.arms:
            losses[arm, seed] = loss_run(arm, seed, args)
            print(f"loss {arm} seed {seed}: {losses[arm, seed][-1]}", flush=True)
    for rate in args.rates if args.only != "loss" else []:
        for arm in args.arms:
            timing[arm, rate] = timed_run(arm, rate, args)
            print(f"time {arm} {rate}: done", flush=True)
    if args.only:
        return
    target = statistics.median(next(e["heldout"] for e in losses["DDP fp32", s]
                                    if e["step"] == args.target_step) for s in args.seeds)
    report(losses, timing, target, args, time.perf_counter() - t0)
    plot(losses, timing, args, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
