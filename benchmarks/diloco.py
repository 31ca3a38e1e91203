"""DiLoCo (torchft) with GIFT's outer all-reduce: which transform suits a pseudo-gradient, and the
held-out loss and bytes of each arm against torchft's fp32 DiLoCo.

1. Fidelity: the example Llama trains with AdamW; from step `--warmup`, H inner steps make a
   pseudo-gradient (weights before - after) while each linear layer's input statistic (the one
   GIFT whitens gradients with) is kept over those steps. Its round trip through INT3 and NVFP4
   with transform none, hadamard and whiten (relative L2 over the linear weights), and, as a
   control, that of the last inner step's gradient with the same statistic.
2. Loss: two replicas (threads of this process, a real torchft Lighthouse, Managers and gloo),
   each its own data stream, inner AdamW, outer SGD Nesterov (lr 0.7, momentum 0.9: DiLoCo's),
   sync every H steps; paired seeds (initialization and data). Held-out loss of the global
   weights at the end, each arm minus fp32 DiLoCo with a 95 % interval; bytes a replica sends a
   sync, and bits a parameter an inner step.

    .venv/bin/python benchmarks/diloco.py --seeds 0 1 2 --steps 300 --sync-every 20
"""
import argparse
import json
import pathlib
import shlex
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft._torchft import LighthouseServer
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.convergence import interval  # noqa: E402
from examples.data import ByteBatches, read_corpus  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402
from horovod_gift import HadamardRotation, InputWhitening, decode, encode  # noqa: E402
from horovod_gift.integrations.torchft import GiftDiLoCo  # noqa: E402

# arm -> GiftDiLoCo's options (None: torchft's own fp32 DiLoCo)
ARMS = {"fp32 DiLoCo": None,
        "GIFT INT3 hadamard": dict(format="int3", transform="hadamard"),
        "GIFT INT3 none": dict(format="int3", transform="none"),
        "INT3 hadamard, no EF": dict(format="int3", transform="hadamard", error_feedback=False),
        "GIFT NVFP4 hadamard": dict(format="nvfp4", transform="hadamard")}


def model_for(args, seed):
    torch.manual_seed(seed)
    return Llama(LlamaConfig(dim=args.dim, n_layers=args.layers, max_seq_len=args.seq_len))


def linear_inputs(model):
    """name of each Linear weight -> its InputWhitening, fed by a forward pre-hook."""
    whitening, params = {}, dict(model.named_parameters())
    for name, module in model.named_modules():
        # a tied lm_head's weight is the embedding's: not a linear layer's pseudo-gradient
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in params:
            w = InputWhitening(module.in_features, rank=32, ema=1 - 1 / 5)
            whitening[f"{name}.weight"] = w
            module.register_forward_pre_hook(lambda _m, x, w=w: w.update(x[0]))
    return whitening


def round_trip(x, fmt, transform, whitening):
    if transform == "hadamard":
        rotation = HadamardRotation(128, 0)
        return rotation.inverse(decode(encode(rotation.forward(x), fmt)))
    if transform == "whiten":
        return whitening.inverse(decode(encode(whitening.forward(x), fmt)))
    return decode(encode(x, fmt))


def fidelity(args, corpus):
    model = model_for(args, 0)
    whitening = linear_inputs(model)
    data = ByteBatches(corpus, args.seq_len, args.batch_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = dict(model.named_parameters())
    rows = []
    for step in range(args.warmup + args.sync_every):
        if step == args.warmup:
            before = {n: params[n].detach().clone() for n in whitening}
        x, y = data.next()
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    gradient = {n: params[n].grad.detach().clone() for n in whitening}
    delta = {n: before[n] - params[n].detach() for n in whitening}
    for what, tensors in (("pseudo-gradient", delta), ("gradient (control)", gradient)):
        for fmt in ("int3", "nvfp4"):
            errors = {}
            for transform in ("none", "hadamard", "whiten"):
                err = sum((round_trip(t, fmt, transform, whitening[n]) - t).pow(2).sum()
                          for n, t in tensors.items())
                errors[transform] = (err / sum(t.pow(2).sum() for t in tensors.values())).sqrt()
            rows.append((what, fmt, *(f"{errors[t]:.3e}" for t in ("none", "hadamard",
                                                                    "whiten"))))
    return rows


def replica(k, args, seed, options, corpus, lighthouse, barrier, out):
    model = model_for(args, seed)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = ByteBatches(corpus, args.seq_len, args.batch_size, seed=seed, rank=k)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=2,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(k), store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse.address(), port=0,
                      timeout=timedelta(seconds=120), use_async_quorum=False, init_sync=False)
    engine = (DiLoCo(manager, [model], inner, outer, args.sync_every) if options is None else
              GiftDiLoCo(manager, [model], inner, outer, args.sync_every, **options))
    barrier.wait()
    try:
        with engine:
            for _ in range(args.steps):
                x, y = data.next()
                inner.zero_grad()
                model(x, y)[1].backward()
                inner.step()
        model.load_state_dict({n: t for n, t in engine._fragments[0].original_parameters.items()},
                              strict=False)
        with torch.no_grad():
            held = [model(*data.validation(seed=1234 + b))[1].item()
                    for b in range(args.eval_batches)]
        sent = engine.stats()["bytes_sent"][0] if options is not None else None
        out[k] = (sum(held) / len(held), sent)
    finally:
        manager.shutdown(wait=False)


def cached(args, arm, seed, corpus):
    """train()'s (held-out loss, bytes a sync), kept under runs/diloco/ per arm, seed and setting:
    a cut study resumes, and arms added later pair with the runs already made."""
    key = f"{arm}-s{seed}-H{args.sync_every}-n{args.steps}-d{args.dim}-l{args.layers}-lr{args.lr}"
    path = ROOT / "runs" / "diloco" / (key.replace(" ", "_").replace(",", "") + ".json")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(train(args, seed, ARMS[arm], corpus)))
    return json.loads(path.read_text())


def train(args, seed, options, corpus):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    barrier, out = threading.Barrier(2), [None, None]
    try:
        threads = [threading.Thread(target=replica, args=(k, args, seed, options, corpus,
                                                          lighthouse, barrier, out))
                   for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        lighthouse.shutdown()
    return out[0]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--warmup", type=int, default=100, help="steps before the fidelity's H")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/diloco.md"))
    args = p.parse_args()
    torch.set_num_threads(1)
    corpus = read_corpus()
    command = "`.venv/bin/python benchmarks/diloco.py " + shlex.join(sys.argv[1:]) + "`"
    lines = [f"# DiLoCo with GIFT's outer all-reduce ({time.strftime('%Y-%m-%d')})", "",
             f"Command: {command}", "",
             f"Example Llama dim {args.dim}, {args.layers} layers, inner AdamW lr {args.lr}, "
             f"batch {args.batch_size} x {args.seq_len} bytes a replica, H = {args.sync_every}.",
             "", "## Round trip of one pseudo-gradient (relative L2 over the linear weights)", "",
             f"H = {args.sync_every} inner steps from step {args.warmup}; whiten: each layer's "
             "input statistic kept over those steps (rank 32), as GIFT whitens gradients.", "",
             "| tensor | format | none | hadamard | whiten |", "|---|---|---|---|---|"]
    for row in fidelity(args, corpus):
        lines.append("| " + " | ".join(row) + " |")
    print("\n".join(lines), flush=True)
    finals, sent, seconds = {}, {}, {}
    for arm in args.arms:
        t0 = time.perf_counter()
        results = [cached(args, arm, seed, corpus) for seed in args.seeds]
        seconds[arm] = (time.perf_counter() - t0) / len(args.seeds)
        finals[arm] = [loss for loss, _ in results]
        sent[arm] = results[0][1]
        print(arm, finals[arm], sent[arm], flush=True)
    model = model_for(args, 0)
    params = sum(p.numel() for p in model.parameters())
    # fp32 DiLoCo: a ring all-reduce sends 2 (n - 1) / n of the weights' bytes a replica
    sent["fp32 DiLoCo"] = 2 * (2 - 1) / 2 * 4 * params
    lines += ["", f"## Held-out loss of the global weights after {args.steps} inner steps, 2 "
              f"replicas, seeds {args.seeds}", "",
              "Difference: mean over seeds of (arm - fp32 DiLoCo), 95 % interval (t over seeds). "
              "Bytes: what one replica sends a sync (GIFT: measured; fp32: a ring all-reduce's "
              "2 (n-1)/n x 4 B a parameter); bits a parameter an inner step: bytes x 8 / "
              f"parameters / H ({params} parameters).", "",
              "| arm | held-out loss | vs fp32 DiLoCo (95 % CI) | vs fp32 DiLoCo % | "
              "bytes a sync | bits/param/inner step | bytes vs DDP fp32 a step | s a run |",
              "|---|---|---|---|---|---|---|---|"]
    base = finals.get("fp32 DiLoCo")
    for arm in args.arms:
        mean = sum(finals[arm]) / len(finals[arm])
        if base is None or arm == "fp32 DiLoCo":
            diff = percent = "-"
        else:
            m, h = interval([a - b for a, b in zip(finals[arm], base)])
            diff = f"{m:+.4f} ({m - h:+.4f} .. {m + h:+.4f})"
            b = sum(base) / len(base)
            percent = f"{100 * m / b:+.2f} ({100 * (m - h) / b:+.2f} .. {100 * (m + h) / b:+.2f})"
        bits = 8 * sent[arm] / params / args.sync_every if sent[arm] else float("nan")
        # DDP fp32 on 2 ranks: a ring all-reduce of 4 B a parameter every inner step
        ddp = sent[arm] / args.sync_every / (2 * (2 - 1) / 2 * 4 * params)
        lines.append(f"| {arm} | {mean:.4f} | {diff} | {percent} | {sent[arm]:.0f} | {bits:.4f} "
                     f"| 1/{1 / ddp:.0f} | {seconds[arm]:.0f} |")
    lines += ["", "Per seed: " + "; ".join(
        f"{arm} " + ", ".join(f"{v:.4f}" for v in finals[arm]) for arm in args.arms) + "."]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(args.arms) - 2:]))


if __name__ == "__main__":
    main()
