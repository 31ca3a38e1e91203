"""Step time on a bandwidth-capped link: ranks in a fresh network namespace whose loopback is
shaped with tc tbf (MTU 1500 first, or 64 KB loopback packets bypass the filter), MPI forced
onto TCP over that loopback. Needs root; without it, says so and measures nothing.

    sudo .venv/bin/python benchmarks/bandwidth.py [--rates 100mbit 1gbit 10gbit] [--steps 8]

Topology: both ranks share one shaped loopback queue, so every byte of both ranks passes one
filter of the given rate. Writes benchmarks/results/bandwidth.md: median step time per arm, its
split into compute / codec / waiting on the network (medians over the timed steps, first step
excluded as warm-up), the time from backward's end (the last gradient's hook) to the end of the
optimizer's step, and the speedup against `none` at the same rate, measured in the same run.
--before COMMIT runs the GIFT arms again with the library of that commit (a temporary git
worktree on PYTHONPATH; the example is this tree's).
"""
import argparse
import csv
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from earlier_tree import earlier_tree

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARMS = ["none", "fp16", "gift-fp8", "gift-nvfp4"]


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def shaped_namespace(name, rate):
    bits = {"mbit": 1e6, "gbit": 1e9}[rate[-4:]] * float(rate[:-4])
    burst = max(128 * 1024, int(bits / 8 / 250))           # at least one timer tick of data
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    sh("ip", "-n", name, "link", "set", "lo", "mtu", "1500")
    sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
       "burst", str(burst), "latency", "50ms")


def run_arm(namespace, arm, args, out_dir, rate, tree=None):
    """One run on args.np ranks; tree: another tree's horovod_gift on PYTHONPATH."""
    label = arm if tree is None else f"{arm}-before"
    csv_path = out_dir / f"{rate}-{label}.csv"
    command = [
        "ip",
        "netns",
        "exec",
        namespace,
        "mpirun",
        "-np",
        str(args.np),
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--mca",
        "btl",
        "tcp,self",
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "-x",
        "OMP_NUM_THREADS=1",
        *(["-x", f"PYTHONPATH={tree}"] if tree else []),
        str(ROOT / ".venv" / "bin" / "python"),
        str(ROOT / "examples" / "train_llama.py"),
        "--compression",
        arm,
        "--steps",
        str(args.steps),
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--bucket-elements",
        str(args.bucket_elements),
        "--quiet",
        "--csv",
        str(csv_path),
    ]
    with open(out_dir / f"{rate}-{label}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))[1:]  # the first step warms up (loads the kernels)
    med = lambda key: statistics.median(float(r[key]) for r in rows)  # noqa: E731
    keys = ("seconds", "compute_seconds", "codec_seconds", "wait_seconds",
            "after_backward_seconds")
    return {k: med(k) for k in keys} | {"bits": float(rows[-1]["bits_per_element"])}


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    p.add_argument("--arms", nargs="+", default=ARMS)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--np", type=int, default=2, help="ranks, all behind the one shaped loopback")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--before", help="an earlier commit whose library runs the GIFT arms too")
    p.add_argument("--bucket-elements", type=int, default=1 << 22, help="GIFT's bucket size")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bandwidth.md"))
    args = p.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print(
            "bandwidth.py needs root and iproute2 (ip, tc) to shape a network namespace: "
            "nothing measured"
        )
        return 0
    out_dir = ROOT / "runs" / "bandwidth"
    out_dir.mkdir(parents=True, exist_ok=True)
    results, labels = {}, list(args.arms)
    if args.before:
        labels += [f"{arm}-before" for arm in args.arms if arm.startswith("gift")]
    with earlier_tree(args.before) as old:
        for rate in args.rates:
            namespace = f"gift-bw-{os.getpid()}"
            shaped_namespace(namespace, rate)
            try:
                for label in labels:
                    arm, before = label.removesuffix("-before"), label.endswith("-before")
                    results[rate, label] = r = run_arm(namespace, arm, args, out_dir, rate,
                                                       old if before else None)
                    print(f"{rate} {label}: step {r['seconds']:.3f}s (compute "
                          f"{r['compute_seconds']:.3f}, codec {r['codec_seconds']:.3f}, wait "
                          f"{r['wait_seconds']:.3f}, after backward "
                          f"{r['after_backward_seconds']:.3f})", flush=True)
            finally:
                sh("ip", "netns", "del", namespace)
    params = f"dim {args.dim}, {args.layers} layers, buckets of {args.bucket_elements} elements"
    lines = [
        f"# Step time on a bandwidth-capped link ({time.strftime('%Y-%m-%d')})",
        "",
        f"examples/train_llama.py ({params}, batch 4 x 64 bytes per rank), {args.np} ranks in one "
        "network namespace whose loopback (MTU 1500) is shaped by `tc qdisc tbf`; MPI on TCP over "
        "that loopback; every rank's traffic "
        f"shares the one filter. Medians over steps 2..{args.steps}. Command: `.venv/bin/python "
        f"benchmarks/bandwidth.py {' '.join(sys.argv[1:])}` (as root). After backward: from "
        "backward's end (the last gradient's hook) to the end of the optimizer's step"
        + (f"; `-before`: the library at {args.before}." if args.before else "."),
        "",
        "| rate | arm | step (s) | compute (s) | codec (s) | waiting (s) | after backward (s) "
        "| bits/elem | speedup vs none |",
        "|---" * 9 + "|",
    ]
    for rate in args.rates:
        base = results.get((rate, "none"))
        for label in labels:
            r = results[rate, label]
            speedup = f"{base['seconds'] / r['seconds']:.2f}x" if base else "-"
            lines.append(
                f"| {rate} | {label} | {r['seconds']:.3f} | {r['compute_seconds']:.3f} "
                f"| {r['codec_seconds']:.3f} | {r['wait_seconds']:.3f} "
                f"| {r['after_backward_seconds']:.3f} | {r['bits']:.2f} | {speedup} |"
            )
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
