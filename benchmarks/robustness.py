"""Robustness campaign: bad input, rank disagreement and crashes, on real ranks of every
engine GIFT has a step frontend for: Horovod (mpirun), DDP and FSDP2 (torchrun, gloo), each flat
and with two hops over simulated nodes, and HSDP (benchmarks/robustness_engines.py).

    python benchmarks/robustness.py       # every configuration; prints the summary table
    python benchmarks/robustness.py --configs horovod:2,ddp:2 --md results/robustness.md

A configuration is ENGINE:RANKS[:NODE_SIZE] (NODE_SIZE < RANKS: GIFT's two hops over nodes of
that many ranks; HSDP: its mesh's nodes). Every case runs on every rank of one job and is judged
on rank 0 from all ranks' outcomes:
  ok                 gradients bit-identical on every rank, finite where every rank's input
                     was finite and within the format's error bound of the exact fp64
                     average (FSDP, HSDP: of FSDP's own fp32 reduction of the same gradients),
                     non-finite where a rank's input was; or, where an error is the
                     defined outcome, every rank raised it
  silent corruption  ranks differ, a finite result is off by more than the bound, a non-finite input
                     came back finite, or a case that must raise did not
  rank disagreement  some ranks raised and others did not (a real job would desynchronize)
  unexpected error   every rank raised where no error is defined (loud, not silent)
  hang               the case did not finish within --case-timeout (the watchdog kills the job)
A crash case per configuration checks that a rank raising mid-step ends the job non-zero in time.
"""

import argparse
import faulthandler
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from robustness_engines import ENGINES  # noqa: E402
CODECS = [("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", 32), ("nvfp4", None),
          ("int3", None)]
# Relative L2 error of one step's averaged gradient (error feedback included) allowed before a
# result counts as corrupted: about 2x the largest value measured over the cases of that format
# (results/robustness.md). Forced whitening has its own, looser bounds: with factors from earlier
# batches it puts error where those batches' inputs had little energy, so it is large in Euclidean
# terms (NVFP4: about 1.2); those bounds only catch gross corruption.
# INT3's exceed 1 (measured up to 1.16: with error feedback a step's result carries what earlier
# steps owed), so a result of zeros (error 1) is judged by a check of its own.
BOUNDS = {"fp8_e4m3": 0.15, "fp8_e5m2": 0.35, "nvfp4": 0.8, "int3": 2.2}
WHITENED_BOUNDS = {"fp8_e4m3": 0.8, "fp8_e5m2": 1.7, "nvfp4": 2.5, "int3": 2.4}
ODD_SIZES = [0, 1, 15, 17, (1 << 20) + 3]
VERDICTS = ["ok", "silent corruption", "rank disagreement", "unexpected error", "hang"]
CONFIGS = "horovod:2,horovod:4,horovod:4:2,ddp:2,ddp:4,ddp:4:2,fsdp:2,fsdp:4:2,hsdp:4:2"
# characters of a failed job's log kept in its verdict: enough for every rank's stacks
HANG_LOG = 6000
TRANSFORMS = ("none", "hadamard", "whiten", "whiten+hadamard", "auto")


ENGINE = None       # the worker's (an instance of one of ENGINES)


# ------------------------------------------------------------------------------------------ worker
def cases(engine, only=""):
    """(category, name, function) for every in-process case of engine whose name contains
    `only`; each function runs on every rank."""
    return [c for c in all_cases(engine) if only in f"{c[0]} / {c[1]}"]


def all_cases(engine):
    kind = ENGINES[engine]
    out = []
    for fmt, block in CODECS:
        codec = fmt + (f"/{block}" if block else "")
        kw = dict(format=fmt, block_size=block)
        for transform in TRANSFORMS:
            if transform in kind.transforms:
                out.append(("clean steps", f"{codec} {transform}",
                            lambda kw=kw, t=transform: train(dict(kw, transform=t))))
            else:       # FSDP takes two of them: the others must be refused on every rank
                out.append(("clean steps", f"{codec} {transform} (refused)",
                            lambda kw=kw, t=transform: expect_error(
                                lambda: train(dict(kw, transform=t)), "transform must be one of")))
        for value in ("nan", "inf", "-inf"):
            out.append(("non-finite on one rank", f"{codec} {value} at step 1",
                        lambda kw=kw, v=value: train(kw, poison=float(v))))
        # FSDP refuses "raise": each shard's sum is seen by its owner alone
        raised = "nonfinite must be 'nan'" if kind.exact_by_reference else "is not finite"
        out.append(("non-finite on one rank", f"{codec} nan, nonfinite=raise",
                    lambda kw=kw, m=raised: expect_error(
                        lambda: train(dict(kw, nonfinite="raise"), poison=float("nan")), m)))
        for scale in (1e30, 1e-30):
            out.append(("extreme magnitudes", f"{codec} gradients x{scale:g}",
                        lambda kw=kw, s=scale: train(kw, scale=s)))
        out.append(("extreme magnitudes", f"{codec} all-zero gradients",
                    lambda kw=kw: train(kw, scale=0.0)))
        if not kind.exact_by_reference:
            # (FSDP2 reduce-scatters the gradients a rank has: ranks whose sets differ give it
            # buffers of different sizes, with or without GIFT)
            out.append(("missing and late gradients", f"{codec} no gradient for the MLP on rank 0",
                        lambda kw=kw: train(kw, skip_mlp_on_rank0=True)))
        if engine != "ddp":     # GIFT averages it (DDP: below)
            out.append(("missing and late gradients",
                        f"{codec} frozen layer made trainable at step 1",
                        lambda kw=kw: train(kw, unfreeze_at=1)))
        for dtype in ("float16", "bfloat16", "float64"):
            out.append(("parameter dtypes", f"{codec} {dtype}",
                        lambda kw=kw, d=dtype: train(kw, dtype=d)))
        # (FSDP2 fails on a parameter of 0 elements in a group, with or without GIFT: its
        # reduce-scatter's copy-in, torch.ops.fsdp.chunk_cat, refuses an empty tensor)
        sizes = "1, 15, 17, 2^20+3 elements" if kind.exact_by_reference else (
            "0, 1, 15, 17, 2^20+3 elements, non-contiguous")
        out.append(("odd sizes", f"{codec} {sizes}",
                    lambda kw=kw: train(dict(kw, min_elements=1), odd_sizes=True)))
    mismatches = [
        ("format", "nvfp4", "fp8_e4m3"),
        ("transform", "auto" if "auto" in kind.transforms else "whiten", "none"),
        ("block_size", None, 32),
        ("seed", 0, 1),
        ("rounding", "nearest", "stochastic"),
        ("error_feedback", True, False),
        ("min_elements", 1024, 4096),
        ("refresh_every", 50, 10),
    ]
    for field, a, b in mismatches:
        out.append(("ranks disagree", f"{field} {a!r} vs {b!r}",
                    lambda f=field, a=a, b=b: expect_error(
                        lambda: train({"format": "fp8_e4m3", f: a if rank() % 2 else b}),
                        f"differs across ranks in {f}")))
    # (DDP checks the shapes itself when it wraps the model, before GIFT exists, and raises
    # only on the ranks whose shapes differ from rank 0's: DDP's behaviour, not GIFT's)
    if engine != "ddp":
        out.append(("ranks disagree", "model shapes differ", lambda: expect_error(
            lambda: train(dict(format="nvfp4"), hidden=172 if rank() == 0 else 160),
            "differs across ranks in model")))
    out.append(("ranks disagree", "compressor state loaded on rank 0 only",
                lambda: expect_error(lambda: train(dict(format="nvfp4"), load_on_rank0=True),
                                     "differs across ranks in step")))
    case, message = kind.misuse
    out.append(("misuse", case, lambda: expect_error(
        lambda: train(dict(format="nvfp4"), misuse=True), message)))
    if engine == "ddp":
        # DDP never reduces a parameter that was frozen when it wrapped the model
        out.append(("missing and late gradients", "frozen layer made trainable at step 1",
                    lambda: expect_error(lambda: train(dict(format="nvfp4"), unfreeze_at=1),
                                         "was frozen when DDP wrapped the model")))
    return out


def rank():
    return ENGINE.rank


def expect_error(run, pattern):
    try:
        run()
    except Exception as e:  # judged below: the message must be the defined one
        return {"error": f"{type(e).__name__}: {e}", "expected": pattern}
    return {"error": None, "expected": pattern}


def full(tensor):
    """A sharded tensor gathered whole (collective), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(gift_kwargs, steps=3, poison=None, scale=1.0, skip_mlp_on_rank0=False,
          unfreeze_at=None, dtype="float32", odd_sizes=False, hidden=172, load_on_rank0=False,
          misuse=False):
    """A few steps of a one-block Llama (plus odd-sized parameters if asked) on ENGINE; returns,
    per step and parameter, the averaged gradient and either every rank's local one or, where
    the engine has no local one to read (exact_by_reference), the exact average, for judge()."""
    import torch
    from data import ByteBatches
    from model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=64, n_layers=1, n_heads=4, hidden_dim=hidden, max_seq_len=32))
    if odd_sizes:
        sizes = ODD_SIZES[1:] if ENGINE.exact_by_reference else ODD_SIZES    # (all_cases)
        model.odd = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n)) for n in sizes)
    model = model.to(getattr(torch, dtype))
    if unfreeze_at is not None:
        model.blocks[0].mlp.w_down.weight.requires_grad_(False)
    if ENGINE.gift_node_size is not None:
        gift_kwargs = dict(gift_kwargs, node_size=ENGINE.gift_node_size)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    by_reference = ENGINE.exact_by_reference and not misuse
    reference = ENGINE.reference(model) if by_reference else None
    module, opt, compression = ENGINE.wrap(model, base, gift_kwargs, misuse, skip_mlp_on_rank0)
    models = [model] + ([reference] if reference is not None else [])
    if load_on_rank0:
        state = dict(compression.state_dict(), step=5)  # collective: every rank saves
        if rank() == 0:
            compression.load_state_dict(state)
    data = ByteBatches(CORPUS, seq_len=32, batch_size=4, rank=rank())
    names = {p: n for n, p in model.named_parameters()}
    if odd_sizes and not by_reference:      # (FSDP's gradients are its own to lay out)
        model.odd[3].register_hook(
            lambda g: g.view(1, -1).expand(2, -1)[0]
        )  # a non-contiguous gradient
    history = []
    for step in range(steps):
        if step == unfreeze_at:
            for m in models:
                m.blocks[0].mlp.w_down.weight.requires_grad_(True)
        if reference is not None:   # from the weights GIFT's run has now
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters()):
                    q.to_local().copy_(p.to_local())
        hooks, local = [], {}
        if poison is not None and step == 1 and rank() == ENGINE.size - 1:  # before the capture
            if by_reference:    # into what reaches wq's output: its weight's gradient follows
                hooks += [m.blocks[0].attn.wq.register_full_backward_pre_hook(
                    lambda module, g: (g[0].index_fill(-1, torch.tensor([2]), poison),))
                    for m in models]
            else:
                hooks.append(model.blocks[0].attn.wq.weight.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([2]), poison)))
        if not by_reference:
            hooks += [p.register_hook(lambda g, n=n: local.__setitem__(n, g.detach().clone()))
                      for p, n in names.items() if p.requires_grad]
        x, y = data.next()
        for m, run in zip(models, [module, reference]):
            (opt if m is model else m).zero_grad()
            block = m.blocks[0]
            if skip_mlp_on_rank0 and rank() == 0:
                block.mlp.forward = torch.zeros_like
            logits, loss = run(x, y)
            if skip_mlp_on_rank0 and rank() == 0:
                del block.mlp.forward
            if odd_sizes:
                flat = torch.randn((1 << 20) + 3,
                                   generator=torch.Generator().manual_seed(step * 7 + rank()))
                loss = loss + sum((w * flat[: w.numel()]).square().sum() for w in m.odd) * 1e-6
            (loss.float() * scale).backward()
        for h in hooks:
            h.remove()
        if misuse:
            ENGINE.step(opt)
            continue
        ENGINE.averaged(opt)
        exact = dict(zip(names.values(), reference.parameters())) if by_reference else {}
        history.append({
            n: (None if p.grad is None else full(p.grad).detach().clone(),
                full(exact[n].grad) if by_reference else local.get(n, torch.zeros_like(p)))
            for p, n in names.items() if p.requires_grad})
        ENGINE.step(opt)
    whitened = gift_kwargs.get("transform", "whiten").startswith("whiten")
    return {"history": history, "exact_given": by_reference,
            "bound": (WHITENED_BOUNDS if whitened else BOUNDS)[gift_kwargs["format"]]}


def judge(outcome):
    """Verdict of one case from every rank's outcome (runs on every rank; rank 0 reports it)."""
    import torch

    everyone = ENGINE.allgather(outcome.get("raised") or outcome.get("error"))
    expected = outcome.get("expected")
    if expected and all(e and expected in e for e in everyone):
        return "ok", everyone[0]
    if any(everyone) and not all(everyone):
        return "rank disagreement", "; ".join(f"rank {r}: {e}" for r, e in enumerate(everyone))
    if any(everyone):
        return "unexpected error", everyone[0]
    if expected:
        return "silent corruption", f"no rank raised '{expected}'"
    worst, bound = 0.0, outcome["bound"]
    for step, grads in enumerate(outcome["history"]):
        for name, (avg, local) in grads.items():
            exact = (local.double() if outcome["exact_given"]
                     else sum(ENGINE.allgather(local.double())) / ENGINE.size)
            if (
                avg is None
                or len(
                    set(
                        ENGINE.allgather(
                            avg.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        )
                    )
                )
                != 1
            ):
                return "silent corruption", f"step {step} {name}: ranks differ"
            if not torch.isfinite(exact).all():
                if torch.isfinite(avg).all():
                    return (
                        "silent corruption",
                        f"step {step} {name}: a rank's non-finite gradient came back finite",
                    )
                continue
            if not torch.isfinite(avg).all():
                return (
                    "silent corruption",
                    f"step {step} {name}: finite inputs came back non-finite",
                )
            norm = exact.norm()
            if norm > 0 and not avg.any():
                return "silent corruption", f"step {step} {name}: the result is all zeros"
            err = (
                float((avg.double() - exact).norm() / norm) if norm > 0 else float((avg != 0).any())
            )
            worst = max(worst, err)
            if err > bound:
                return (
                    "silent corruption",
                    f"step {step} {name}: relative error {err:.3g} > {bound}",
                )
    return "ok", f"worst relative error {worst:.3g}"


def worker(args):
    from data import read_corpus

    global CORPUS, ENGINE
    ENGINE = ENGINES[args.engine](args.node_size)
    CORPUS = read_corpus(max_bytes=200_000)
    out = pathlib.Path(args.out)
    # every rank prints its threads' stacks into the job's log shortly before the watchdog would
    # kill it: a hang says where it waits (re-armed at each case)
    stacks_after = 0.9 * args.case_timeout
    faulthandler.dump_traceback_later(stacks_after)
    if args.crash:
        crash_midway()
        return
    for index, (category, name, run) in enumerate(cases(args.engine, args.only)):
        if index < args.first_case:
            continue
        if rank() == 0:  # written whole, then renamed: the watchdog never reads half a file
            (out / "progress.tmp").write_text(json.dumps({"index": index, "since": time.time()}))
            os.replace(out / "progress.tmp", out / "progress")
        faulthandler.dump_traceback_later(stacks_after)
        try:
            outcome = run()
        except Exception as e:
            outcome = {"raised": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        verdict, detail = judge(outcome)
        if rank() == 0:
            with open(out / "results.jsonl", "a") as f:
                f.write(
                    json.dumps(
                        {
                            "index": index,
                            "category": category,
                            "case": name,
                            "verdict": verdict,
                            "detail": detail[:300],
                        }
                    )
                    + "\n"
                )


def crash_midway():
    import torch

    real_step = torch.optim.SGD.step

    def failing(self, *a, **k):
        failing.calls += 1
        if rank() == 1 and failing.calls == 2:
            raise RuntimeError("rank 1 fails mid-run")
        return real_step(self, *a, **k)

    failing.calls = 0
    torch.optim.SGD.step = failing
    train(dict(format="nvfp4"), steps=6)


# ------------------------------------------------------------------------------------------ driver
def parse_config(text):
    """"ENGINE:RANKS[:NODE_SIZE]" -> (engine, ranks, node_size or None)."""
    engine, ranks, *node = text.split(":")
    if engine not in ENGINES:
        raise SystemExit(f"robustness.py: unknown engine {engine!r} in {text!r}")
    return engine, int(ranks), int(node[0]) if node else None


def launch(config, out, extra, case_timeout):
    """Runs one job of config's engine; returns 'done', 'hang' (watchdog) or 'exit N'."""
    engine, np, node_size = parse_config(config)
    worker = [__file__, "--worker", "--engine", engine, "--out", str(out),
              "--case-timeout", str(case_timeout), *extra]
    if node_size is not None:
        worker += ["--node-size", str(node_size)]
    if engine == "horovod":
        cmd = ["bash", str(ROOT / "scripts" / "mpirun.sh"), str(np), sys.executable, *worker]
    else:
        cmd = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone",
               "--nproc-per-node", str(np), *worker]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the job's output to a file: a pipe read only at the end blocks a job that writes 64 KB
    with open(out / "job.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        started = time.time()
        while proc.poll() is None:
            time.sleep(0.5)
            progress = out / "progress"
            since = json.loads(progress.read_text())["since"] if progress.exists() else started
            if time.time() - max(since, started) > case_timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                return "hang"
    return "done" if proc.returncode == 0 else f"exit {proc.returncode}"


def run_config(config, case_timeout, only):
    """Every case of one configuration, a job per run of cases (a job that dies or hangs is
    judged on its case and the next job starts after it), then the crash case."""
    engine = parse_config(config)[0]
    rows, total = [], len(cases(engine, only))
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        start = 0
        while start < total:
            status = launch(config, out, ["--first-case", str(start), "--only", only], case_timeout)
            done = (
                [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
                if (out / "results.jsonl").exists()
                else []
            )
            seen = {r["index"] for r in rows}
            rows += [r for r in done if r["index"] not in seen]
            next_start = max([r["index"] for r in rows], default=-1) + 1
            if next_start >= total:
                break
            category, name, _ = cases(engine, only)[next_start]
            verdict = "hang" if status == "hang" else "unexpected error"
            rows.append(
                {
                    "index": next_start,
                    "category": category,
                    "case": name,
                    "verdict": verdict,
                    "detail": status + ": " + (out / "job.log").read_text()[-HANG_LOG:],
                }
            )
            start = next_start + 1
        crash_out = out / "crash"
        crash_out.mkdir()
        t0 = time.time()
        status = launch(config, crash_out, ["--crash"], case_timeout)
        log = (crash_out / "job.log").read_text()
        verdict = (
            "ok"
            if status.startswith("exit") and "rank 1 fails mid-run" in log
            else "hang"
            if status == "hang"
            else "silent corruption"
        )
        rows.append(
            {
                "index": total,
                "category": "a rank raises mid-step",
                "case": "job ends non-zero",
                "verdict": verdict,
                "detail": f"{status} after {time.time() - t0:.0f} s"
                + ("" if verdict == "ok" else ": " + log[-HANG_LOG:]),
            }
        )
    return rows


def summary(results):
    lines = [
        "| configuration | category | cases | " + " | ".join(VERDICTS) + " |",
        "|---" * (3 + len(VERDICTS)) + "|",
    ]
    for config, rows in results.items():
        for category in dict.fromkeys(r["category"] for r in rows):
            mine = [r for r in rows if r["category"] == category]
            lines.append(
                f"| {config} | {category} | {len(mine)} | "
                + " | ".join(str(sum(r["verdict"] == v for r in mine)) for v in VERDICTS)
                + " |"
            )
    everything = [dict(r, config=config) for config, rows in results.items() for r in rows]
    count = {v: sum(r["verdict"] == v for r in everything) for v in VERDICTS}
    closing = (
        f"robustness: {len(everything)} cases tried, {count['hang']} hangs, "
        f"{count['silent corruption']} silent corruptions, "
        f"{count['rank disagreement']} rank disagreements, "
        f"{count['unexpected error']} unexpected errors"
    )
    return "\n".join(lines), closing, everything


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default=CONFIGS,
                   help="ENGINE:RANKS[:NODE_SIZE],... (engines: " + ", ".join(ENGINES) + ")")
    p.add_argument(
        "--case-timeout",
        type=float,
        default=300.0,
        help="seconds one case may take before it is a hang",
    )
    p.add_argument(
        "--only", default="", help="run only the cases whose 'category / case' contains this"
    )
    p.add_argument("--md", default=None, help="also write the table and every case's verdict here")
    p.add_argument(
        "--verbose", action="store_true", help="print every case's verdict, not only failures"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="horovod", help=argparse.SUPPRESS)
    p.add_argument("--node-size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--first-case", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    t0 = time.time()
    results = {config: run_config(config, args.case_timeout, args.only)
               for config in args.configs.split(",")}
    table, closing, everything = summary(results)
    print(table)
    for r in everything:
        if r["verdict"] != "ok" or args.verbose:
            print(f"  {r['verdict']}: {r['config']}: {r['category']} / {r['case']}: "
                  f"{r['detail']}")
    print(f"{closing} ({time.time() - t0:.0f} s)")
    if args.md:
        details = "\n".join(
            f"| {config} | {r['category']} | {r['case']} | {r['verdict']} | "
            + r["detail"].replace("\n", "<br>") + " |"
            for config, rows in results.items()
            for r in rows
        )
        pathlib.Path(args.md).write_text(
            f"# Robustness campaign\n\n`python benchmarks/robustness.py --configs {args.configs}` "
            f"({time.time() - t0:.0f} s)\n\n{table}\n\n"
            f"**{closing}**\n\nRelative-error bounds: {BOUNDS}; "
            f"with forced whitening: {WHITENED_BOUNDS}\n\n"
            "| configuration | category | case | verdict | detail |\n"
            f"|---|---|---|---|---|\n{details}\n"
        )
    sys.exit(0 if all(r["verdict"] == "ok" for r in everything) else 1)


if __name__ == "__main__":
    main()
