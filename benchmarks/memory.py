"""GIFT's own memory per byte of fp32 parameters, measured on a Llama-shaped model with
full-width layers (few blocks), and extrapolated per layer to the Llama-3.2-1B and -3.1-8B shapes.

    .venv/bin/python benchmarks/memory.py                   # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/memory.py --md benchmarks/results/memory.md

Each arm is one `mpirun -np NP` job that trains the same model with SGD for a few steps:
Horovod fp32 (no compression: the baseline), GIFT NVFP4 with transform="auto" (statistics,
hooks and factors) with fp32 and with bf16 residuals, and GIFT with transform="none".
- held: the bytes of every tensor GIFT keeps between steps, by what it is for (residuals,
  statistics + factors, workspaces, the CPU rotation's cached signs), walked from the object;
- peak: the growth of the process's peak resident memory (ru_maxrss) over the baseline arm's,
  which also counts GIFT's temporaries within a step (payloads, decoded sums, copies);
- the step time of a statistics-refresh step against a plain step of the same arm;
- the peak per bucket size: the GIFT arms again with each of --bucket-sizes (the payloads in
  flight are what a step adds to what GIFT holds).
All per byte of fp32 parameters, worst rank. Every arm runs with MALLOC_MMAP_THRESHOLD_=131072:
each tensor over 128 KB is then its own mapping, returned when freed, so the resident memory
follows the live tensors, as a GPU caching allocator's peak does. With glibc's default (a
threshold that rises to 32 MB as large blocks are freed) freed tensors stay in the heap and the
peak depends on the order of allocations: 0.3-0.5x of the parameters' bytes more for the GIFT
arms, differing from run to run.
"""
import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

ARMS = {"horovod fp32": None,
        "gift nvfp4, auto, fp32 residuals": dict(transform="auto", residual_dtype="float32"),
        "gift nvfp4, auto, bf16 residuals": dict(transform="auto", residual_dtype="bfloat16"),
        "gift nvfp4, none, fp32 residuals": dict(transform="none", residual_dtype="float32")}
DEFAULT_BUCKET = 1 << 22  # GIFT's default bucket_elements
REFRESH_EVERY = 3       # steps 0, 3, 6 refresh (3, 6 also vote under "auto"); the others are plain
STEPS = 7

# Shapes of the extrapolation: (hidden, MLP width, blocks, q/k/v/o outputs, vocab, tied head)
SHAPES = {"Llama-3.2-1B": (2048, 8192, 16, (2048, 512, 512, 2048), 128256, True),
          "Llama-3.1-8B": (4096, 14336, 32, (4096, 1024, 1024, 4096), 128256, False)}


def tensors_in(obj, seen=None):
    """Every tensor reachable from obj through attributes and containers, each storage once;
    modules and parameters (the model's, not GIFT's) are not followed."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.nn.Parameter)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("horovod_gift"):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_in(child, seen)]


def nbytes(tensors):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def worker(arm, args):
    import horovod.torch as hvd
    import horovod_gift as gift
    from horovod_gift.codec import rotation
    from horovod_gift.codec import workspaces as reused_buffers
    from model import Llama, LlamaConfig
    hvd.init()
    torch.manual_seed(0)
    signs = []                       # the CPU rotation's per-size cache, recorded as it fills
    cached = rotation.random_signs
    rotation.random_signs = lambda *a: signs.append(cached(*a)) or signs[-1]
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128,
                      hidden_dim=args.hidden, max_seq_len=args.seq_len)
    model = Llama(cfg)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    options = ARMS[arm]
    compression = hvd.Compression.none
    if options is not None:
        compression = gift.GIFT(model, format="nvfp4", transform=options["transform"],
                                residual_dtype=getattr(torch, options["residual_dtype"]),
                                refresh_every=REFRESH_EVERY, verbose=False,
                                bucket_elements=args.bucket_elements)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    g = torch.Generator().manual_seed(hvd.rank())
    seconds = []
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    result = dict(arm=arm, param_bytes=param_bytes, seconds=seconds,
                  peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if options is not None:
        residuals = compression.reducer.feedback.tensors()
        stats = tensors_in(compression.statistics)
        workspaces = list(getattr(reused_buffers._workspaces, "buffers", {}).values())
        result["held"] = {"residuals": nbytes(residuals), "statistics + factors": nbytes(stats),
                          "workspaces": nbytes(workspaces), "rotation signs (CPU)": nbytes(signs)}
        result["statistics"] = [dict(owner=name, in_features=w.in_features, bytes=nbytes(
            tensors_in(w))) for name, w in _distinct(compression.statistics.whitening).items()]
    everyone = hvd.allgather_object(result)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)


def _distinct(whitening):
    out, seen = {}, set()
    for name, w in whitening.items():
        if id(w) not in seen:
            seen.add(id(w))
            out[name] = w
    return out


def launch(arm, args, bucket_elements=DEFAULT_BUCKET):
    command = ["bash", str(ROOT / "scripts/mpirun.sh"), str(args.np), sys.executable, __file__,
               "--worker", arm, f"--bucket-elements={bucket_elements}"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k in ("dim", "hidden", "layers", "batch", "seq_len")]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{arm}: exit {out.returncode}\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def extrapolate(per_feature, n, residual_bytes):
    """Per-layer formulas with the measured statistic bytes per input feature: one statistic per
    distinct input (attention in, o_proj in, MLP in, down_proj in; the head's input)."""
    rows = []
    for model, (hidden, mlp, blocks, qkvo, vocab, tied) in SHAPES.items():
        params = blocks * (hidden * sum(qkvo) + 3 * hidden * mlp + 2 * hidden) + vocab * hidden
        params += 0 if tied else vocab * hidden
        stat_inputs = blocks * (3 * hidden + mlp) + hidden
        stats = per_feature * stat_inputs
        residuals = residual_bytes * (1 + 1 / n) * params
        rows.append((model, params, stats / (4 * params), residuals / (4 * params)))
    return rows


def peak_growth(ranks, base, param_bytes):
    return (max(r["peak_rss"] for r in ranks) - base) / param_bytes


def held_in_all(ranks, param_bytes):
    return sum(max(r["held"][k] for r in ranks) for k in ranks[0]["held"]) / param_bytes


def report(results, by_bucket, args):
    base = max(r["peak_rss"] for r in results["horovod fp32"])
    param_bytes = results["horovod fp32"][0]["param_bytes"]
    lines = [f"Model: Llama-shaped, dim {args.dim}, MLP {args.hidden}, {args.layers} blocks, "
             f"{param_bytes / 4e6:.1f}M parameters ({param_bytes / 1e6:.0f} MB fp32); "
             f"{args.np} ranks; SGD; {STEPS} steps, whitening refreshed every {REFRESH_EVERY}.", "",
             "| arm | residuals | statistics + factors | workspaces | rotation signs (CPU) | "
             "held in all | peak growth over Horovod fp32 | refresh step / plain step |",
             "|---|---|---|---|---|---|---|---|"]
    per_feature = 0.0
    for arm, ranks in results.items():
        if arm == "horovod fp32":
            continue
        held = {k: max(r["held"][k] for r in ranks) / param_bytes for k in ranks[0]["held"]}
        peak = peak_growth(ranks, base, param_bytes)
        refresh = statistics.median(max(r["seconds"][s] for r in ranks) for s in (3, 6))
        plain = statistics.median(max(r["seconds"][s] for r in ranks) for s in (2, 5))
        lines.append(f"| {arm} | " + " | ".join(f"{v:.3f}x" for v in held.values())
                     + f" | {sum(held.values()):.3f}x | {peak:.3f}x | "
                     f"{refresh:.2f} s / {plain:.2f} s |")
        for s in ranks[0].get("statistics", []):
            per_feature = max(per_feature, s["bytes"] / s["in_features"])
    plain_none = statistics.median(max(r["seconds"][s] for r in results["horovod fp32"])
                                   for s in (2, 5))
    lines += ["", f"Horovod fp32's plain step: {plain_none:.2f} s. Sizes are per byte of fp32 "
              "parameters (x), worst rank.", "",
              f"Extrapolated with the measured {per_feature:.0f} bytes of statistics + factors "
              "per input feature of each distinct Linear input, and residuals of 4 (fp32) or "
              f"2 (bf16) bytes x (1 + 1/{args.np}) per parameter:", "",
              "| model | parameters | statistics + factors | residuals fp32 | residuals bf16 |",
              "|---|---|---|---|---|"]
    for (model, params, stats, fp32), (_, _, _, bf16) in zip(
            extrapolate(per_feature, args.np, 4), extrapolate(per_feature, args.np, 2)):
        lines.append(f"| {model} | {params / 1e9:.2f}B | {stats:.4f}x | {fp32:.2f}x | "
                     f"{bf16:.2f}x |")
    sizes = sorted({size for size, _ in by_bucket} | {DEFAULT_BUCKET})
    lines += ["", "Peak growth over Horovod fp32 by bucket_elements (transient: above what the arm "
              "holds; target <= 0.25x):", "",
              "| arm | " + " | ".join(f"{size:,} elements" for size in sizes) + " |",
              "|---|" + "---|" * len(sizes)]
    for arm in results:
        if arm == "horovod fp32":
            continue
        cells = []
        for size in sizes:
            ranks = results[arm] if size == DEFAULT_BUCKET else by_bucket.get((size, arm))
            if ranks is None:
                cells.append("")
                continue
            peak = peak_growth(ranks, base, param_bytes)
            cells.append(f"{peak:.3f}x (transient {peak - held_in_all(ranks, param_bytes):.3f}x)")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-elements", type=int, default=DEFAULT_BUCKET,
                   help=argparse.SUPPRESS)   # a worker's
    p.add_argument("--bucket-sizes", default="1048576,16777216",
                   help="bucket_elements the GIFT arms also run with (comma-separated; the "
                   "default size always runs)")
    p.add_argument("--md", default=None, help="also write the report here")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args)
    results, by_bucket = {}, {}
    for arm in ARMS:
        print(f"running: {arm}", file=sys.stderr, flush=True)
        results[arm] = launch(arm, args)
    for size in [int(s) for s in args.bucket_sizes.split(",") if s]:
        for arm in ARMS:
            if ARMS[arm] is not None and size != DEFAULT_BUCKET:
                print(f"running: {arm}, bucket_elements={size}", file=sys.stderr, flush=True)
                by_bucket[size, arm] = launch(arm, args, size)
    text = report(results, by_bucket, args)
    print(text)
    if args.md:
        command = "    .venv/bin/python benchmarks/memory.py " + " ".join(sys.argv[1:])
        pathlib.Path(args.md).write_text("# GIFT's memory per byte of parameters\n\n" + command
                                         + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
