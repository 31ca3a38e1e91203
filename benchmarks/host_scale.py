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
--before COMMIT measures that commit too (checked out into a temporary git worktree and imported
from there, as example_codec.py does; a commit from before the Communicator is driven through a
stand-in for horovod.torch in its collective.py). Writes benchmarks/results/host_scale.md (--out).
"""
import argparse
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
from earlier_tree import earlier_tree

try:
    from horovod_gift.reduce import collective, feedback
except ImportError:         # --before a commit from before the subpackages (0.3.0's first trees)
    from horovod_gift import collective, feedback
BucketReduction, Codec = collective.BucketReduction, collective.Codec
bucket_pieces, fill_buckets = collective.bucket_pieces, collective.fill_buckets
ErrorFeedback = feedback.ErrorFeedback

# a commit from before the Communicator: its collective.py calls horovod.torch itself
LEGACY = hasattr(collective, "hvd")
if not LEGACY:
    communicator = importlib.import_module(collective.__package__ + ".communicator")
    Communicator, Done = communicator.Communicator, communicator.Done
else:
    Communicator = object

    class Done:
        def __init__(self, result):
            self.result = result

        def wait(self):
            return self.result

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

    # horovod.torch's calls, for a commit from before the Communicator (its collective.py calls
    # hvd.*): its owners' payloads differ in size, so the gathered bytes are the bucket's
    def alltoall_async_legacy(self, tensor, splits, name, process_set):
        self.bucket_bytes = tensor.numel()
        return self.alltoall_async(tensor, splits, name)

    def allgather_async_legacy(self, tensor, name, process_set):
        gathered = torch.zeros(self.bucket_bytes, dtype=torch.uint8)
        gathered[: tensor.numel()] = tensor
        return Done(gathered)


class LegacyHorovod:
    """Stands in for horovod.torch in an earlier collective.py, over a SimulatedCommunicator."""

    def __init__(self, comm):
        self.comm = comm
        self.alltoall_async = comm.alltoall_async_legacy
        self.allgather_async = comm.allgather_async_legacy

    @staticmethod
    def synchronize(handle):
        return handle.wait()


def make_reduction(name, flats, codec, comm, residual1, step, key, feedback):
    """A BucketReduction with its stage-2 residual, in this tree's API or an earlier one's."""
    sizes = [f.numel() for f in flats]
    owned = sum(hi - lo for _, lo, hi in bucket_pieces(sizes, comm.size, codec.align)[comm.rank])
    residual2 = feedback.second_stage(key, owned, "cpu")
    if not LEGACY:
        return BucketReduction(name, flats, codec, comm, residual1, residual2, step=step,
                               key=key)
    collective.hvd = LegacyHorovod(comm)
    process_set = type("ProcessSet", (), {"size": lambda _: comm.size,
                                          "rank": lambda _: comm.rank})()
    return BucketReduction(name, flats, codec, process_set, residual1, residual2, step=step)


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
            reduction = make_reduction(f"gift.b{k}", flats, codec, comm,
                                       feedback.first_stage(members), step, k, feedback)
            reduction.start().exchange().finish(over_inputs=True)
        times.append(time.perf_counter() - t0)
    pieces = sum(len(chunk) for members in buckets
                 for chunk in bucket_pieces([sizes[n] for n in members], ranks, codec.align))
    return statistics.median(times[1:] or times), len(buckets), pieces, sum(sizes.values())


def measure_all(args):
    """[model, P, buckets, pieces, seconds a step] for every model and rank count."""
    torch.set_num_threads(1)
    rows = []
    for model in args.models:
        for ranks in args.ranks:
            seconds, buckets, pieces, _ = measure(model, ranks, args)
            rows.append([model, ranks, buckets, pieces, seconds])
            print(f"{model} P={ranks}: {seconds * 1e3:.1f} ms, {buckets} buckets, "
                  f"{pieces} pieces", file=sys.stderr, flush=True)
    return rows


def measure_commit(commit, args):
    """measure_all's rows for an earlier commit, in a subprocess importing its tree."""
    with earlier_tree(commit) as old:
        command = [sys.executable, __file__, "--json", "--ranks", *map(str, args.ranks),
                   "--models", *args.models, "--layers", str(args.layers), "--divide",
                   str(args.divide), "--format", args.format, "--steps", str(args.steps)]
        done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(old)), check=True,
                              stdout=subprocess.PIPE)
        return json.loads(done.stdout)


def ratios(rows):
    """Each row's seconds over its model's at P = 8."""
    base = {model: seconds for model, ranks, _, _, seconds in rows if ranks == 8}
    return [seconds / base[model] if model in base else None
            for model, _, _, _, seconds in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--divide", type=int, default=4)
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--before", help="an earlier commit to measure too")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/host_scale.md"))
    args = parser.parse_args()
    if args.json:
        json.dump(measure_all(args), sys.stdout)
        return
    before = measure_commit(args.before, args) if args.before else None
    after = measure_all(args)
    lines = ["# Host time a step of GIFT's reduction against the rank count", "",
             f"Command: `.venv/bin/python benchmarks/host_scale.py {' '.join(sys.argv[1:])}`", "",
             f"Rank 0 of P simulated in one process, one thread, {args.format}, error feedback, "
             f"{args.layers} layers, elements / {args.divide} (buckets and pieces as at full "
             f"size). Median of steps 2..{args.steps}. Target: at most 1.5x P = 8 at P = 1024.",
             ""]
    if before:
        lines += ["| model | P | buckets before / after | pieces a step | ms a step before | "
                  "ms after | before x P = 8 | after x P = 8 |", "|---" * 8 + "|"]
        for old, new, old_ratio, new_ratio in zip(before, after, ratios(before), ratios(after)):
            lines.append(f"| {new[0]} | {new[1]} | {old[2]} / {new[2]} | {new[3]} | "
                         f"{old[4] * 1e3:.1f} | {new[4] * 1e3:.1f} | {_ratio(old_ratio)} | "
                         f"{_ratio(new_ratio)} |")
    else:
        lines += ["| model | P | buckets | pieces a step | ms a step | x P = 8 |",
                  "|---|---|---|---|---|---|"]
        for (model, ranks, buckets, pieces, seconds), ratio in zip(after, ratios(after)):
            lines.append(f"| {model} | {ranks} | {buckets} | {pieces} | {seconds * 1e3:.1f} | "
                         f"{_ratio(ratio)} |")
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratio(value):
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    main()
