"""One rank's host time a step of GIFT's reduction as the rank count P grows, at Llama shapes.

    .venv/bin/python benchmarks/host_scale.py              # ~10 min; one process, one thread

The other P - 1 ranks are simulated in this process (SimulatedCommunicator: what a rank receives
has the sizes a real job gives, its bytes this rank's own), so one process can play rank 0 of a
1024-rank job; the mpi tests keep real Horovod. Per step and bucket: BucketReduction start (the
stage-1 encode with residuals and the alltoall), exchange (the owner's decode, fp32 sum and
re-encode, the allgather) and finish (the final decode): everything GIFT's core does on the host
apart from the transforms, which cost the same at every P.

The tensors are Llama-3.2-1B's and Llama-3.1-8B's layers (--layers of them; no embedding), each
tensor's elements and the bucket size divided by --divide so that a step runs in seconds while
every one of 1024 chunks of a bucket still holds elements: the number of buckets, pieces and
calls is the real one, the element work 1/divide of it. Reported: the median step time over
--steps, the pieces a step, and the ratio to P = 8 (target: at most 1.5x at P = 1024). The
element work is the same at every P, so what grows with P is host work per piece.
Writes benchmarks/results/host_scale.md (--out).
"""
import argparse
import pathlib
import statistics
import sys
import time

import torch

from horovod_gift.collective import BucketLayout, BucketReduction, Codec, fill_buckets
from horovod_gift.communicator import Communicator, Done
from horovod_gift.feedback import ErrorFeedback

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name: (hidden, intermediate, key/value width), from the models' configs
MODELS = {"Llama-3.2-1B": (2048, 8192, 512), "Llama-3.1-8B": (4096, 14336, 1024)}
BUCKET_ELEMENTS = 1 << 22       # GIFT's default


class SimulatedCommunicator(Communicator):
    """Rank `rank` of `size`, alone in this process: every rank is taken to send what this one
    does, so received buffers have their real sizes (P chunks of this rank's chunk, P owners'
    slots); reductions and broadcasts return the input."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def alltoall_async(self, tensor, splits, name):
        start = int(splits[: self.rank].sum())
        mine = tensor[start : start + int(splits[self.rank])]
        return Done((mine.repeat(self.size), torch.full((self.size,), mine.numel())))

    def allgather_async(self, tensor, name):
        return Done(tensor.repeat(self.size))

    def allreduce_async(self, tensor, op, name):
        return Done(tensor.clone())

    def broadcast_async_(self, tensor, root, name):
        return Done(tensor)


def layer_shapes(model, layers):
    hidden, intermediate, kv = MODELS[model]
    one = [("q", hidden * hidden), ("k", kv * hidden), ("v", kv * hidden), ("o", hidden * hidden),
           ("gate", intermediate * hidden), ("up", intermediate * hidden),
           ("down", hidden * intermediate), ("input_norm", hidden), ("post_norm", hidden)]
    return {f"layers.{i}.{name}": numel for i in range(layers) for name, numel in one}


def measure(model, ranks, args):
    sizes = {name: max(1, numel // args.divide) for name, numel in
             layer_shapes(model, args.layers).items()}
    names = list(reversed(sizes))                            # backward order
    buckets = fill_buckets(names, sizes, BUCKET_ELEMENTS // args.divide)
    codec = Codec(args.format)
    params = {n: torch.nn.Parameter(torch.empty(sizes[n]), requires_grad=False) for n in names}
    feedback = ErrorFeedback(params, buckets, codec.align)
    comm = SimulatedCommunicator(ranks)
    generator = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(sizes[n], generator=generator) for n in names}
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        for k, members in enumerate(buckets):
            flats = [grads[n].clone() for n in members]
            owned = BucketLayout.of(tuple(f.numel() for f in flats), ranks, codec.align).owned
            reduction = BucketReduction(f"gift.b{k}", flats, codec, comm,
                                        feedback.first_stage(members),
                                        feedback.second_stage(k, owned[comm.rank], "cpu"),
                                        step=step, key=k)
            reduction.start().exchange().finish(over_inputs=True)
        times.append(time.perf_counter() - t0)
    pieces = sum(len(chunk) for members in buckets for chunk in
                 BucketLayout.of(tuple(sizes[n] for n in members), ranks, codec.align).pieces)
    return statistics.median(times[1:] or times), len(buckets), pieces, sum(sizes.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--divide", type=int, default=16)
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/host_scale.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model in args.models:
        base = None
        for ranks in args.ranks:
            seconds, buckets, pieces, elements = measure(model, ranks, args)
            base = seconds if ranks == 8 else base
            rows.append((model, ranks, buckets, pieces, elements, seconds, base))
            print(f"{model} P={ranks}: {seconds * 1e3:.1f} ms, {buckets} buckets, "
                  f"{pieces} pieces", flush=True)
    lines = ["# Host time a step of GIFT's reduction against the rank count", "",
             f"Command: `.venv/bin/python benchmarks/host_scale.py {' '.join(sys.argv[1:])}`", "",
             f"Rank 0 of P simulated in one process, one thread, {args.format}, error feedback, "
             f"{args.layers} layers, elements / {args.divide} (buckets and pieces as at full "
             "size). Median of steps 2..N.", "",
             "| model | P | buckets | pieces a step | ms a step | us a piece | x P = 8 |",
             "|---|---|---|---|---|---|---|"]
    for model, ranks, buckets, pieces, elements, seconds, base in rows:
        ratio = f"{seconds / base:.2f}x" if base else "-"
        lines.append(f"| {model} | {ranks} | {buckets} | {pieces} | {seconds * 1e3:.1f} | "
                     f"{seconds * 1e6 / pieces:.0f} | {ratio} |")
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
