"""Data-parallel pretraining of a small Llama on a byte-level corpus, with Horovod, PyTorch DDP or
FSDP2 (--engine; examples/engines.py).

    horovodrun -np 2 -H localhost:2 python examples/train_llama.py --compression gift-nvfp4
    torchrun --nproc-per-node 2 examples/train_llama.py --engine ddp --compression gift-nvfp4

Rank 0 shows a progress bar, logs loss, tokens/s and bits per gradient element, and writes a CSV.
On a GPU cluster, `--device cuda` puts each rank on its local GPU (its local rank) and runs the
forward and backward passes under bf16 autocast where the GPU supports bf16; parameters,
gradients and GIFT's state stay fp32 on the GPU.
"""

import argparse
import contextlib
import csv
import logging
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from data import ByteBatches, read_corpus  # noqa: E402
from engines import COMPRESSIONS, make_engine, shutdown  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402


def make_compression(
    name, model, bucket_elements=1 << 22, error_feedback=True, log_every=0, start_step=0,
    **options,
):
    """(Horovod's compression for --compression name, the GIFT instance or None); options: more
    GIFT arguments (topology=, node_size=)."""
    import horovod.torch as hvd

    import horovod_gift as gift

    if name == "none":
        return hvd.Compression.none, None
    if name == "fp16":
        return hvd.Compression.fp16, None
    format, transform = COMPRESSIONS[name]
    if transform is not None:
        options["transform"] = transform
    compressor = gift.GIFT(
        model,
        format=format,
        bucket_elements=bucket_elements,
        error_feedback=error_feedback,
        log_every=log_every,
        start_step=start_step,
        **options,
    )
    return compressor, compressor


def bits_per_element(name, compressor):
    if compressor is not None:
        return compressor.stats()["bits_per_element"]
    return {"none": 32.0, "fp16": 16.0}[name]


def make_parser(description=__doc__):
    """The flags of this script (examples/train_hf.py adds its own to them)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engine", default="horovod", choices=("horovod", "ddp", "fsdp", "hsdp"),
                   help="horovod: launch with horovodrun or mpirun; ddp, fsdp, hsdp (FSDP2 "
                        "sharded in each node, replicated across): with torchrun")
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks a node for --engine hsdp and GIFT's two hops under ddp and fsdp "
                        "(default: torchrun's LOCAL_WORLD_SIZE); set it to simulate nodes")
    p.add_argument("--compression", default="gift-nvfp4", choices=list(COMPRESSIONS))
    p.add_argument("--param-format", default=None, choices=("fp8_e4m3",),
                   help="fsdp, hsdp with GIFT: all-gather the parameters in this format")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        default=None,
        help="text file or directory (default: the Python standard library's source)",
    )
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--bucket-elements", type=int, default=1 << 22, help="GIFT bucket size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-error-feedback", action="store_true", help="GIFT without error feedback")
    p.add_argument("--residual-dtype", default="default", choices=("default", "fp32", "bf16"),
                   help="GIFT's error-feedback residuals (default: the library's)")
    p.add_argument(
        "--log-every", type=int, default=0, help="GIFT logs a line every N steps on rank 0"
    )
    p.add_argument(
        "--start-step", type=int, default=0, help="GIFT's warm-up: fp32 before this step"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="held-out loss every N steps (and at the end) on --eval-batches fixed batches",
    )
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument(
        "--gradient-error",
        action="store_true",
        help="log the RelL2 of each step's averaged gradient against an exact fp32 average "
        "(one more fp32 allreduce a step: for studies)",
    )
    p.add_argument(
        "--gradient-error-by-tensor",
        action="store_true",
        help="with --gradient-error: print each tensor's mean RelL2 and share of the "
        "gradient's energy at the end (rank 0)",
    )
    p.add_argument("--csv", default=None, help="write per-step metrics here (rank 0)")
    p.add_argument(
        "--checkpoint", default=None, help="save here at the end (and every --save-every steps)"
    )
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", default=None,
                   help="checkpoint to continue from; 'auto': --checkpoint if it exists (what a "
                        "job restarted by torchrun --max-restarts or horovodrun needs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: each rank on the GPU of its local rank, bf16 autocast where supported",
    )
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def build_model(args, device):
    """The model of --dim and --layers (also built by benchmarks/peers_worker.py)."""
    cfg = LlamaConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 32),
        hidden_dim=(8 * args.dim // 3 + 7) // 8 * 8,
        max_seq_len=args.seq_len,
    )
    return Llama(cfg).to(device)


def make_optimizer(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def make_schedule(optimizer):
    """Linear learning-rate warm-up over the first 20 steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))


def main(argv=None, parse=parse_args, build=build_model):
    """Train; parse(argv) gives the arguments, build(args, device) the model (default: the Llama
    of model.py), which returns (logits, loss) of model(tokens, targets)."""
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    engine = make_engine(args.engine, args.device)
    check_engine_flags(args, engine)
    torch.manual_seed(args.seed)
    device, autocast = place(args.device, engine)
    model = build(args, device)
    run, optimizer, compressor = engine.wrap(model, lambda m: make_optimizer(m, args.lr), args,
                                             make_compression)
    start_step = 0
    if args.resume == "auto" and not args.checkpoint:
        raise SystemExit("--resume auto resumes from --checkpoint: give --checkpoint too")
    resume = args.checkpoint if args.resume == "auto" else args.resume
    if resume and (args.resume != "auto" or os.path.exists(checkpoint_file(resume, engine))):
        start_step = load_checkpoint(resume, engine, model, optimizer, compressor)
    # every rank must resume from the same step: a kill between two ranks' saves leaves files
    # of different steps (each file is whole, the set is not)
    # (the same verdict on every rank: the steps' spread, n sum(s^2) - (sum s)^2, is 0 or not)
    total, squares, ranks = engine.sum(
        torch.tensor([start_step, start_step ** 2, 1], dtype=torch.float64), "resume_step").tolist()
    if ranks * squares != total ** 2:
        raise SystemExit(f"the ranks resume from different steps (this one from {start_step}): "
                         "the last save did not finish on every rank")
    engine.broadcast(model, optimizer)
    batches = ByteBatches(
        read_corpus(args.data),
        args.seq_len,
        args.batch_size,
        seed=args.seed,
        rank=engine.rank,
        step=start_step,
    )
    schedule = make_schedule(optimizer)
    for _ in range(start_step):
        schedule.step()

    rank0 = engine.rank == 0
    bar = None
    if rank0 and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start_step, unit="step", dynamic_ncols=True)
    rows, losses = [], []
    exact = (ExactAverage(model, engine) if args.gradient_error or args.gradient_error_by_tensor
             else None)
    tokens_per_step = args.batch_size * args.seq_len * engine.size
    t_start = time.perf_counter()
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        before = compressor.stats() if compressor is not None else None
        x, y = (t.to(device, non_blocking=True) for t in batches.next())
        optimizer.zero_grad()
        with autocast():
            _, loss = run(x, y)
        loss.backward()
        t_step = time.perf_counter()
        gradient_error = engine.step(optimizer, exact)
        in_step = time.perf_counter() - t_step
        schedule.step()
        dt = time.perf_counter() - t0
        mean_loss = engine.average([loss.detach()], "train.loss")[0].item()
        losses.append(mean_loss)
        if (
            compressor is not None
        ):  # split of the step: codec work, waiting on the network, the rest
            after = compressor.stats()
            codec = after["codec_seconds"] - before["codec_seconds"]
            wait = after["wait_seconds"] - before["wait_seconds"]
        else:
            # Horovod's synchronize() inside optimizer.step(); DDP and FSDP wait in backward
            codec, wait = 0.0, in_step
        row = {
            "step": step + 1,
            "loss": mean_loss,
            "tokens_per_s": tokens_per_step / dt,
            "bits_per_element": bits_per_element(args.compression, compressor),
            "seconds": dt,
            "codec_seconds": codec,
            "wait_seconds": wait,
            "compute_seconds": dt - codec - wait,
            # from backward's end (the last gradient's hook) to the optimizer step's end
            "after_backward_seconds": in_step,
        }
        if exact is not None:
            row["gradient_rel_l2"] = gradient_error
        if args.eval_every:
            last = step + 1 == args.steps
            row["heldout_loss"] = (
                heldout_loss(run, batches, args, device, autocast, engine)
                if last or (step + 1) % args.eval_every == 0
                else ""
            )
        rows.append(row)
        if rank0:
            if bar is not None:
                bar.set_postfix(
                    loss=f"{mean_loss:.4f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    bits=f"{row['bits_per_element']:.2f}",
                )
                bar.update(1)
            else:
                print(
                    f"step {step + 1:5d}  loss {mean_loss:.4f}  "
                    f"tokens/s {row['tokens_per_s']:.0f}  "
                    f"bits/elem {row['bits_per_element']:.2f}",
                    flush=True,
                )
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(args.checkpoint, engine, model, optimizer, compressor, step + 1)
    if bar is not None:
        bar.close()
    if args.checkpoint:
        save_checkpoint(args.checkpoint, engine, model, optimizer, compressor, args.steps)
    if rank0 and args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if rank0 and exact is not None and args.gradient_error_by_tensor:
        print(exact.by_tensor(), flush=True)
    if rank0 and losses:
        print(
            summary(args, engine.size, losses, compressor, time.perf_counter() - t_start,
                    len(losses)),
            flush=True,
        )
    return losses


class ExactAverage:
    """For studies: copies each local gradient as autograd makes it (a tensor hook runs before
    Horovod's accumulator hook and DDP's, which may compress .grad in place), and compares the
    averaged gradients the engine leaves in .grad with an fp32 average of the copies."""

    def __init__(self, model, engine):
        self.engine = engine
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.local = {}
        self.sums = {}  # index -> [sum over steps of RelL2, of squared norm, steps]
        for i, p in enumerate(self.params):
            p.register_hook(
                lambda g, i=i: self.local.__setitem__(i, g.detach().to(torch.float32, copy=True))
            )

    def relative_error(self):
        indices = sorted(self.local)
        reference = self.engine.average([self.local[i] for i in indices], "train.exact_average")
        err2 = norm2 = 0.0
        for i, ref in zip(indices, reference):
            e = float((self.params[i].grad.double() - ref.double()).square().sum())
            q = float(ref.double().square().sum())
            err2, norm2 = err2 + e, norm2 + q
            sums = self.sums.setdefault(i, [0.0, 0.0, 0])
            sums[0] += (e / q) ** 0.5 if q else 0.0
            sums[1] += q
            sums[2] += 1
        self.local = {}
        return (err2 / norm2) ** 0.5 if norm2 else 0.0

    def by_tensor(self):
        """A markdown table: each tensor's RelL2 (mean over steps) and share of the energy."""
        total = sum(s[1] for s in self.sums.values()) or 1.0
        lines = ["| tensor | gradient RelL2 | share of energy |", "|---|---|---|"]
        for i in sorted(self.sums):
            rel, energy, steps = self.sums[i]
            lines.append(f"| {self.names[i]} | {rel / steps:.3e} | {energy / total:.3f} |")
        return "\n".join(lines)


def heldout_loss(model, batches, args, device, autocast, engine):
    """Mean loss over the same --eval-batches held-out batches at every call (split over ranks;
    under FSDP every rank runs as many forwards, each all-gathers, and the extra ones do not
    count)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    batches_run = args.eval_batches
    if getattr(engine, "lockstep_forward", False):
        batches_run = -(-args.eval_batches // engine.size) * engine.size
    with torch.no_grad():
        for k in range(engine.rank, batches_run, engine.size):
            x, y = (t.to(device) for t in batches.validation(seed=1234 + k))
            with autocast():
                _, loss = model(x, y)
            if k < args.eval_batches:
                total += torch.tensor([float(loss), 1.0], dtype=torch.float64)
    model.train(was_training)
    total = engine.sum(total, "train.heldout")
    return float(total[0] / total[1])


def check_engine_flags(args, engine):
    """Refuse, by name, the flags an engine cannot honour."""
    fsdp = [("--start-step", args.start_step), ("--gradient-error",
             args.gradient_error or args.gradient_error_by_tensor)]
    refused = {"fsdp": fsdp, "hsdp": fsdp}
    for flag, given in refused.get(engine.name, []):
        if given:
            raise SystemExit(f"{flag} is not supported with --engine {engine.name}")


def place(device, engine):
    """The device of this rank and the autocast context of its forward pass."""
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // engine.local_size))
        return torch.device("cpu"), contextlib.nullcontext
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch build sees no CUDA device")
    torch.cuda.set_device(engine.local_rank)
    if not torch.cuda.is_bf16_supported():
        return torch.device("cuda"), contextlib.nullcontext
    return torch.device("cuda"), lambda: torch.autocast("cuda", dtype=torch.bfloat16)


def summary(args, n, losses, compressor, seconds, steps):
    text = (
        f"done: {steps} steps on {n} ranks in {seconds:.1f}s "
        f"with --engine {args.engine} --compression {args.compression}; "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    if compressor is not None:
        s = compressor.stats()
        fp32_bytes = 2 * (n - 1) / n * 4 * s["elements"]  # a ring allreduce of fp32 gradients
        sent = s["bytes_sent"] + 2 * (n - 1) / n * 4 * s["uncompressed_elements"]
        text += (
            f"\nbytes sent per rank: {sent / 1e6:.2f} MB vs {fp32_bytes / 1e6:.2f} MB for fp32 "
            f"({fp32_bytes / max(sent, 1):.1f}x less); "
            f"{s['bits_per_element']:.2f} bits per gradient element"
        )
        if "residual_bytes" in s:
            text += f"; error-feedback residuals {s['residual_bytes']} bytes a rank"
    return text


def save_checkpoint(path, engine, model, optimizer, compressor, step):
    """Rank 0 saves the model, the optimizer and GIFT's shared state; every rank saves GIFT's own
    state (its error-feedback residuals) beside it, so a job of the same size resumes bit for bit
    and a job of another size resumes with residuals at zero. Under FSDP every rank saves its
    shards of everything to its own file. Each file is written whole or not at all (save)."""
    if engine.sharded:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "compressor": None if compressor is None else compressor.state_dict()}
        save(state, rank_state_path(path, engine.rank))
        return
    if compressor is not None:
        save(compressor.state_dict(), rank_state_path(path, engine.rank))
    if engine.rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if compressor is not None:
            state["compressor"] = compressor.state_dict(rank_state=False)
        save(state, path)


def save(state, path):
    """torch.save to a temporary name, then a rename: a process killed while saving leaves the
    previous file whole (a rename within a directory is atomic)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    torch.save(state, temporary)
    os.replace(temporary, path)


def checkpoint_file(path, engine):
    """The file a rank reads first when it resumes from path."""
    return rank_state_path(path, engine.rank) if engine.sharded else path


def rank_state_path(path, rank):
    return f"{path}.gift-rank{rank}"


def load_checkpoint(path, engine, model, optimizer, compressor):
    """What save_checkpoint saved, back into the model (the unwrapped one), the optimizer and
    GIFT; returns the step."""
    if engine.sharded:
        ckpt = torch.load(rank_state_path(path, engine.rank), map_location="cpu",
                          weights_only=False)
        if compressor is not None:
            compressor.load_state_dict(ckpt["compressor"])
    else:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        if compressor is not None:
            load_compressor(compressor, path, ckpt, engine.rank)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["step"]


def load_compressor(compressor, path, ckpt, rank):
    """This rank's saved GIFT state if there is one from the same save (a file left by an earlier,
    larger job is not), else the shared state in the checkpoint."""
    mine = rank_state_path(path, rank)
    if os.path.exists(mine):
        state = torch.load(mine, map_location="cpu", weights_only=False)
        if state["step"] == ckpt["step"]:
            compressor.load_state_dict(state)
            return
    compressor.load_state_dict(ckpt["compressor"])

if __name__ == "__main__":
    main()
    shutdown()
