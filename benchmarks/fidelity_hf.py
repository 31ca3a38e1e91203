"""Round-trip fidelity of GIFT's transforms on Hugging Face transformers models, per group of
tensors, with the statistics a deployed compressor has: those of earlier batches only.

Builds each model of --models from its transformers config (examples/train_hf.py: random init,
byte vocabulary of 256; "type:tie" sets --tie-embeddings, e.g. llama:yes, qwen2:no) and trains it
on the byte-level corpus (one process, AdamW). GIFT's own WhiteningStatistics (rank 32, damping
1.0, refresh every REFRESH_EVERY steps from an EMA over STAT_WINDOW steps, a LocalGroup of one
rank) run as GIFT runs them: at step s (GIFT's s - 1) refresh() when due, then advance(). At each
capture step t, every 2-D trainable weight's gradient G is quantized with each codec (NVFP4; FP8
E4M3 with one scale per tensor) under each candidate transform T of GIFT's TransformPlan (none,
hadamard; whiten and whiten+hadamard for whitenable weights), err = T^-1(D(Q(T(G)))) - G.

Groups: "linear" (weights of their own linear module: nn.Linear, transformers' Conv1D), "tied
embedding" (statistics.borrowed: read as a linear weight through another module, the LM head),
"other 2-D" (no linear module reads them: GPT-2's position embedding wpe, an untied input
embedding), "all 2-D". Metrics, energy-weighted over the group: RelL2 = sqrt(sum ||err||^2 /
sum ||G||^2), gain = RelL2(none) / RelL2, Adam RelL2: the same for the update direction
G / (sqrt(v_hat) + eps) with AdamW's bias-corrected exp_avg_sq before step t, and share: the
group's part of the 2-D gradient energy sum ||G||^2. Plans: a weight without the transform takes
GIFT's fallback (whiten -> none, whiten+hadamard -> hadamard); "whiten, others hadamard" is
whiten with hadamard for the weights that cannot be whitened. "whiten" is GIFT's default.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fidelity_hf.py --models gpt2 llama:yes qwen2:no
"""
import argparse
import math
import os
import pathlib
import sys
import time
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from horovod_gift.codec.tensor_codec import Codec  # noqa: E402
from horovod_gift.reduce.communicator import LocalGroup  # noqa: E402
from horovod_gift.core.gift_core import REFRESH_EVERY, STAT_WINDOW  # noqa: E402
from horovod_gift.codec.rotation import HadamardRotation  # noqa: E402
from horovod_gift.geometry.statistics import WhiteningStatistics  # noqa: E402
from horovod_gift.geometry.transforms import TransformPlan  # noqa: E402
from data import ByteBatches, read_corpus  # noqa: E402
from train_hf import CausalLM, make_config  # noqa: E402

CODECS = {"nvfp4": ("NVFP4", Codec("nvfp4")),
          "fp8_e4m3": ("FP8 E4M3, per tensor", Codec("fp8_e4m3")),
          "int3": ("INT3 (7 levels, block 32)", Codec("int3"))}
GROUPS = ("linear", "tied embedding", "other 2-D", "all 2-D")
# plan -> (transform of whitenable weights, of the others)
PLANS = {"none": ("none", "none"), "hadamard": ("hadamard", "hadamard"),
         "whiten": ("whiten", "none"), "whiten, others hadamard": ("whiten", "hadamard"),
         "whiten+hadamard": ("whiten+hadamard", "hadamard")}
SHOWN = {"linear": ("none", "hadamard", "whiten", "whiten+hadamard"),
         "tied embedding": ("none", "hadamard", "whiten", "whiten+hadamard"),
         "other 2-D": ("none", "hadamard"), "all 2-D": tuple(PLANS)}
EPS = 1e-8                      # AdamW's eps
RANK, DAMPING = 32, 1.0         # GIFT's defaults (whitening_rank, damping)


def group_of(name, stats):
    if name in stats.borrowed:
        return "tied embedding"
    return "linear" if name in stats.whitening else "other 2-D"


def tensor_errors(plan, name, g, scale):
    """{transform: (||err||^2, ||err / (sqrt(v_hat) + eps)||^2)} over plan.candidates(name)."""
    out = {}
    for transform in plan.candidates(name):
        for label, (_, codec) in CODECS.items():
            u = plan.forward(name, g.clone(), transform)
            back = codec.decode(codec.encode(u), u.numel())
            err = (plan.inverse(name, back, transform).view_as(g) - g).double()
            out[(label, transform)] = (float(err.square().sum()),
                                       float((err * scale).square().sum()))
    return out


def run_model(spec, args, corpus):
    """Train one model; return (records, losses, parameter count, groups of the 2-D weights).
    records[t][name] = (||G||^2, ||G / (sqrt(v_hat) + eps)||^2, tensor_errors)."""
    kind, _, tie = spec.partition(":")
    torch.manual_seed(args.seed)
    cfg = make_config(SimpleNamespace(config=kind, dim=args.dim, layers=args.layers,
                                      seq_len=args.seq_len, tie_embeddings=tie or "config"))
    from transformers import AutoModelForCausalLM
    model = CausalLM(AutoModelForCausalLM.from_config(cfg)).train()
    weights = {n: p for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2}
    comm = LocalGroup(1).communicators()[0]
    stats = WhiteningStatistics(model, weights, RANK, DAMPING, REFRESH_EVERY, STAT_WINDOW, comm)
    plan = TransformPlan(weights, "whiten", stats, HadamardRotation(128, args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = ByteBatches(corpus, args.seq_len, args.batch_size, seed=args.seed)
    records, losses = {}, {}
    for step in range(1, max(args.steps) + 1):
        x, y = batches.next()
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if stats.due(step - 1):         # GIFT counts steps from 0
            stats.refresh()
        if step in args.steps:
            losses[step], records[step] = loss.item(), {}
            for name, p in weights.items():
                g, state = p.grad.detach().float(), opt.state.get(p)
                k = int(state["step"]) if state else 0
                v = state["exp_avg_sq"] / (1 - 0.999 ** k) if k else torch.ones_like(g)
                scale = 1 / (v.double().sqrt() + EPS)
                records[step][name] = (float(g.double().square().sum()),
                                       float((g.double() * scale).square().sum()),
                                       tensor_errors(plan, name, g, scale))
            print(f"{spec}: step {step}, loss {loss.item():.3f}", flush=True)
        stats.advance()
        opt.step()
    stats.remove_hooks()
    groups = {n: group_of(n, stats) for n in weights}
    params = sum(p.numel() for p in model.parameters())
    return records, losses, params, groups


def group_row(tensors, groups, group, codec, plan_name):
    """(RelL2, Adam RelL2, ||G||^2) of a plan over a group's tensors ({name: record})."""
    e2 = n2 = ae2 = an2 = 0.0
    for name, (g2, ag2, errors) in tensors.items():
        if group != "all 2-D" and groups[name] != group:
            continue
        whitenable, other = PLANS[plan_name]
        transform = other if groups[name] == "other 2-D" else whitenable
        err2, adam_err2 = errors[(codec, transform)]
        e2, n2, ae2, an2 = e2 + err2, n2 + g2, ae2 + adam_err2, an2 + ag2
    return (math.sqrt(e2 / n2), math.sqrt(ae2 / an2), n2) if n2 else None


def summary(results, args):
    """The numbers the choice for non-whitenable weights rests on, one row per model/codec/step."""
    out = ["## Summary", "",
           "Gain of whiten over none (RelL2) on the linear and tied-embedding groups; other 2-D: "
           "RelL2 and Adam RelL2 under none -> hadamard; all 2-D: RelL2 of GIFT's default plan "
           "(whiten, others none) against all-none, and with others hadamard. Adam RelL2 of "
           "hadamard explodes where the rotation leaks error into elements whose gradient is "
           "always 0 (v_hat = 0, a weight of 1 / eps): rows of bytes absent from the corpus.", "",
           "| model | codec | step | linear gain | tied gain | other RelL2 none -> hadamard "
           "| other Adam none -> hadamard | all 2-D none -> whiten (gain) | whiten, others had. |",
           "|---|---|---|---|---|---|---|---|---|"]
    for spec, (records, _, _, groups) in results.items():
        for codec in args.codecs:
            for t in args.steps:
                def row(group, plan):
                    return group_row(records[t], groups, group, codec, plan)

                def gain(group):
                    r = row(group, "none")
                    return f"{r[0] / row(group, 'whiten')[0]:.2f}x" if r else "-"
                other = [row("other 2-D", p) for p in ("none", "hadamard")]
                rel = f"{other[0][0]:.3e} -> {other[1][0]:.3e}" if other[0] else "-"
                adam = f"{other[0][1]:.3e} -> {other[1][1]:.3e}" if other[0] else "-"
                none, default, mixed = (row("all 2-D", p)[0] for p in
                                        ("none", "whiten", "whiten, others hadamard"))
                out.append(f"| {spec} | {codec} | {t} | {gain('linear')} | {gain('tied embedding')}"
                           f" | {rel} | {adam} | {none:.3e} -> {default:.3e} "
                           f"({none / default:.2f}x) | {mixed:.3e} ({none / mixed:.2f}x) |")
    return out + [""]


def report(results, args, seconds):
    out = [f"# Fidelity of GIFT's transforms on transformers models ({time.strftime('%Y-%m-%d')})",
           "", f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} "
           ".venv/bin/python benchmarks/fidelity_hf.py "
           + " ".join(sys.argv[1:]) + "`", "",
           f"Models: {', '.join(args.models)}; dim {args.dim}, {args.layers} layers, batch "
           f"{args.batch_size} x {args.seq_len} bytes, AdamW lr {args.lr}, seed {args.seed}, "
           f"whitening rank {RANK}, damping {DAMPING}, refresh every {REFRESH_EVERY}, window "
           f"{STAT_WINDOW}. Run time {seconds:.0f} s. Definitions: the script's docstring.", ""]
    out += summary(results, args)
    for spec, (records, losses, params, groups) in results.items():
        counts = {g: sum(1 for v in groups.values() if v == g) for g in GROUPS[:3]}
        out += [f"## {spec}", "", f"{params / 1e6:.2f}M parameters; 2-D weights per group: "
                + ", ".join(f"{g} {c}" for g, c in counts.items()) + "; "
                + ", ".join(n for n, g in groups.items() if g != "linear") + " not linear; loss "
                + ", ".join(f"{losses[t]:.3f} at step {t}" for t in args.steps) + ".", ""]
        for codec in args.codecs:
            out += [f"### {spec}, {CODECS[codec][0]}", "",
                    "Cells: RelL2 (gain over none) / Adam RelL2 (gain); share of energy per step.",
                    "", "| group | transform | " + " | ".join(f"step {t}" for t in args.steps)
                    + " | share |", "|---|---|" + "---|" * (len(args.steps) + 1)]
            for group in GROUPS:
                for plan_name in SHOWN[group]:
                    cells, shares = [], []
                    for t in args.steps:
                        r = group_row(records[t], groups, group, codec, plan_name)
                        if r is None:
                            break
                        base = group_row(records[t], groups, group, codec, "none")
                        total = group_row(records[t], groups, "all 2-D", codec, "none")[2]
                        cells.append(f"{r[0]:.3e} ({base[0] / r[0]:.2f}x) / "
                                     f"{r[1]:.3e} ({base[1] / r[1]:.2f}x)")
                        shares.append(f"{r[2] / total:.3f}")
                    if cells:
                        out.append(f"| {group} | {plan_name} | " + " | ".join(cells)
                                   + f" | {', '.join(shares)} |")
            out.append("")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "llama:yes"],
                   help="transformers model types, optionally :yes / :no to tie embeddings")
    p.add_argument("--steps", type=int, nargs="+", default=[20, 100, 300])
    p.add_argument("--codecs", nargs="+", choices=list(CODECS), default=list(CODECS))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fidelity_hf.md"))
    args = p.parse_args()
    if min(args.steps) <= REFRESH_EVERY:
        p.error(f"capture steps start after {REFRESH_EVERY} (the first whitening factors)")
    args.steps = sorted(set(args.steps))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = read_corpus(args.data)
    results = {spec: run_model(spec, args, corpus) for spec in args.models}
    text = report(results, args, time.perf_counter() - t0)
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
