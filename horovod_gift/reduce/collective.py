"""The quantized allreduce: a reduce-scatter and an allgather of FP8/NVFP4 bytes, summed in fp32.

For a bucket of flat fp32 tensors u_1..u_m (already in the transformed space) on n ranks:
  1. The bucket is cut into n chunks; rank k owns chunk k. Every rank quantizes each piece
     (a tensor's part of a chunk) with its own stage-1 residual r1 (error feedback) and sends
     chunk k's bytes to rank k: one alltoall of uint8 (a reduce-scatter).
  2. The owner decodes the n payloads of each piece and sums them in fp32 in rank order 0..n-1
     (an average divides by n), adds its stage-2 residual r2, quantizes again, and the owners'
     bytes go to every rank: one allgather of uint8, every owner's slot padded to the largest
     chunk's bytes (an allgather of one size is one collective, not n broadcasts).
  3. Every rank decodes the same bytes with the same scales: results are bit-identical.
No FP8 arithmetic sums (no overflow), and no scale is ever local to one rank (no drift). Each
piece has its own scales, so a non-finite tensor poisons only itself.
Bytes sent per rank: 2 (n-1)/n * elements * bits/8 plus the scales.

The collectives go through a Communicator (communicator.py): this module imports no engine.
A bucket's layout (its pieces, their payload offsets, the alltoall's splits) is computed once
per (tensor sizes, ranks, codec) and cached: nothing here is recomputed per step.
"""

import bisect
import functools
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.tensor_codec import TensorPieces
from ..codec.workspaces import workspace
from .pipeline import Reduction


def chunk_bounds(total, n, align):
    """n contiguous [start, end) ranges covering total elements, boundaries on multiples of
    align."""
    units = -(-total // align)
    per, extra = divmod(units, n)
    bounds, start = [], 0
    for k in range(n):
        end = min(total, start + (per + (k < extra)) * align)
        bounds.append((start, end))
        start = end
    return bounds


def bucket_pieces(sizes, n, align):
    """For each of n chunks of a bucket of tensors with these sizes: the (tensor index, lo, hi)
    pieces it holds, in that tensor's own coordinates."""
    return BucketLayout.of(tuple(sizes), n, align).pieces


@dataclass(frozen=True)
class Piece:
    """A tensor's part of a chunk: flat[tensor][lo:hi], whose payload is bytes [start, end) of
    its chunk's payload."""
    tensor: int
    lo: int
    hi: int
    start: int
    end: int


class BucketLayout:
    """Where every piece of a bucket lies, for n ranks and one codec (its payload sizes), made
    once and cached (BucketLayout.of): chunk k's pieces, each chunk's payload bytes (the
    alltoall's splits), and the allgather's slot (the largest chunk's bytes)."""

    def __init__(self, sizes, n, align, codec=None):
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        self.sizes, self.n = sizes, n
        self.pieces = []        # per chunk: (tensor index, lo, hi)
        for start, end in chunk_bounds(offsets[-1], n, align):
            # the tensors overlapping [start, end), from the one holding start
            first = max(0, bisect.bisect_right(offsets, start) - 1)
            chunk = []
            for i in range(first, len(sizes)):
                if offsets[i] >= end:
                    break
                lo, hi = max(start, offsets[i]) - offsets[i], min(end, offsets[i + 1]) - offsets[i]
                if lo < hi:
                    chunk.append((i, lo, hi))
            self.pieces.append(chunk)
        self.owned = [sum(hi - lo for _, lo, hi in chunk) for chunk in self.pieces]
        if codec is None:
            return
        self.chunks = []        # per chunk: its Pieces with payload offsets
        for chunk in self.pieces:
            placed, position = [], 0
            for i, lo, hi in chunk:
                size = codec.payload_bytes(hi - lo)
                placed.append(Piece(i, lo, hi, position, position + size))
                position += size
            self.chunks.append(placed)
        self.chunk_bytes = [chunk[-1].end if chunk else 0 for chunk in self.chunks]
        self.chunk_starts = [0]
        for size in self.chunk_bytes:
            self.chunk_starts.append(self.chunk_starts[-1] + size)
        # engines read the splits on the host, whatever the payload's device
        self.splits = torch.tensor(self.chunk_bytes, dtype=torch.int32, device="cpu")
        self.slot = max(self.chunk_bytes)
        # per tensor, its pieces in chunk order: where their payloads go in the alltoall's send
        # buffer and lie in the allgather's (one pass over the pieces)
        mine = [[] for _ in sizes]
        for k, chunk in enumerate(self.chunks):
            for piece in chunk:
                mine[piece.tensor].append((k, piece))
        self.sent, self.gathered = [], []
        for i, placed in enumerate(mine):
            starts = np.array([piece.lo for _, piece in placed], np.int64)
            ends = np.array([piece.hi for _, piece in placed], np.int64)
            chunks = np.array([k for k, _ in placed], np.int64)
            for offsets, out in (([self.chunk_starts[k] + p.start for k, p in placed], self.sent),
                                 ([k * self.slot + p.start for k, p in placed], self.gathered)):
                out.append(TensorPieces(starts, ends, np.array(offsets, np.int64), chunks, i))

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def of(sizes, n, align, codec=None):
        return BucketLayout(sizes, n, align, codec)


def fill_buckets(names, sizes, bucket_elements):
    """Consecutive names grouped into buckets of at most bucket_elements elements. A tensor
    larger than that is a bucket of its own; the small tensors around it go on filling the
    current bucket (without it, each large tensor would close a bucket of a few small ones)."""
    buckets, current, filled = [], [], 0
    for n in names:
        if sizes[n] > bucket_elements:
            buckets.append([n])
            continue
        if current and filled + sizes[n] > bucket_elements:
            buckets.append(current)
            current, filled = [], 0
        current.append(n)
        filled += sizes[n]
    return buckets + ([current] if current else [])


def owned_elements(sizes, n, rank, align):
    """How many elements of a bucket of tensors with these sizes rank owns (its chunk) of n."""
    return BucketLayout.of(tuple(sizes), n, align).owned[rank]


def mix_seed(*values):
    """A 31-bit seed from integers, the same in every process (the hash of an int tuple is not
    salted)."""
    return hash(tuple(values)) & 0x7FFFFFFF


def name_key(name):
    """An integer for a name, the same in every process (str hashes are salted)."""
    return zlib.crc32(name.encode())


def timed_wait(handle):
    """(handle.wait()'s result, the seconds it blocked)."""
    t0 = time.perf_counter()
    out = handle.wait()
    return out, time.perf_counter() - t0


class BucketReduction(Reduction):
    """One quantized reduction of a list of flat fp32 tensors over comm (a Communicator):
    start() -> exchange() -> finish(). key: an integer naming the bucket in the stochastic
    rounding's seeds (every bucket draws its own noise)."""

    final_stage = 2     # finish() reads the collective in flight in this stage

    def __init__(self, name, flats, codec, comm, residual1=None, residual2=None, average=True,
                 step=0, maxima=None, key=0, divisor=None):
        self.name, self.flats, self.codec, self.comm = name, flats, codec, comm
        self.residual1, self.residual2 = residual1, residual2
        # the owner's fp32 sum is divided by this: the ranks for an average (a two-hop reduction
        # over nodes passes every rank of every node), 1 for a sum
        self.divisor = divisor or (comm.size if average else 1)
        self.step, self.key = step, key
        # per flat, None or its pieces' largest magnitude_bits: the flat then holds u + r1
        # (TransformPlan.forward_folded), and r1 is only written
        self.maxima = maxima or [None] * len(flats)
        self.n, self.rank = comm.size, comm.rank
        self.layout = BucketLayout.of(tuple(f.numel() for f in flats), self.n, codec.align, codec)
        self.bytes_sent = 0
        self.wait_seconds = 0.0  # blocked waiting for the communicator
        self.amax_bounds = []  # bounds on each piece encoded with a residual (encode_pieces)
        self.stage = 0          # 1: the alltoall is in flight; 2: the allgather; 3: finished

    def _wait(self, handle):
        out, seconds = timed_wait(handle)
        self.wait_seconds += seconds
        return out

    def _bound(self, payload, m, residual):
        if residual is not None and m:
            self.amax_bounds.append(self.codec.amax_bound(payload, m))
        return payload

    def start(self):
        layout = self.layout
        send = torch.empty(layout.chunk_starts[-1], dtype=torch.uint8, device=self.flats[0].device)
        seed = mix_seed(self.codec.seed, self.step, self.rank, self.key, 1)
        for i, flat in enumerate(self.flats):
            residual = None if self.residual1 is None else self.residual1[i]
            bounds = self.codec.encode_pieces(flat, residual, layout.sent[i], send, seed,
                                              self.maxima[i])
            if residual is not None:
                self.amax_bounds.extend(bounds)
        self.bytes_sent += layout.chunk_starts[-1] - layout.chunk_bytes[self.rank]
        self._handle = self.comm.alltoall_async(send, layout.splits, f"{self.name}.reduce_scatter")
        self.stage = 1
        return self

    def ready(self):
        """True when the next call (exchange() in stage 1, finish() in stage 2) would not
        wait."""
        return self._handle.poll()

    def exchange(self):
        received, _ = self._wait(self._handle)
        self._handle = None     # the alltoall's buffers go as soon as this stage is done
        if received.is_cuda:    # read by the kernels queued below: no reuse before they ran
            received.record_stream(torch.cuda.current_stream(received.device))
        sources = received.view(self.n, -1)     # every rank sent this rank's chunk: one size
        mine, slot = self.layout.chunks[self.rank], self.layout.slot
        out = torch.empty(slot, dtype=torch.uint8, device=received.device)
        out[self.layout.chunk_bytes[self.rank]:] = 0     # the padding: the same bytes everywhere
        offset = 0
        for piece in mine:
            i, m = piece.tensor, piece.hi - piece.lo
            residual = None if self.residual2 is None else self.residual2[offset : offset + m]
            payload = self.codec.reduce_encode(
                sources[:, piece.start : piece.end],
                m,
                self.divisor,
                residual,
                mix_seed(self.codec.seed, self.step, self.rank, self.key, i, 2),
                sum_out=workspace(m, received.device, "sum"),
                out=out[piece.start : piece.end],
            )
            self._bound(payload, m, residual)
            offset += m
        self.bytes_sent += slot * (self.n - 1)
        self._handle = self.comm.allgather_async(out, f"{self.name}.allgather")
        self.stage = 2
        return self

    def gathered(self):
        """The allgather's bytes, identical on every rank: every owner's slot in rank order."""
        gathered = self._wait(self._handle)
        self._handle = None     # and the allgather's once read: not held until the step ends
        if gathered.is_cuda:    # allocated by the engine, read on this stream
            gathered.record_stream(torch.cuda.current_stream(gathered.device))
        self.stage = 3
        return gathered

    def finish(self, over_inputs=False):
        """The reduced tensors, flat fp32, identical on every rank. over_inputs: written over the
        input tensors, whose values start() has sent, instead of new ones: on CPU a new tensor of
        over 32 MB costs a page fault per 4 KB (finish() of a 2**24-element tensor on 2 ranks:
        80 -> 28 ms)."""
        gathered = self.gathered()
        out = self.flats if over_inputs else [torch.empty_like(f) for f in self.flats]
        for i, pieces in enumerate(self.layout.gathered):
            self.codec.decode_pieces(gathered, pieces, out[i])
        return out


class Fp32Reduction:
    """The fp32 average (divisor: the ranks) or sum (1) of a flat fp32 tensor over comm, summed
    on each chunk's owner and allgathered: every element's sum is the same whatever tensors it
    is reduced with (a ring allreduce's order depends on where an element lies in its buffer, so
    a frontend whose buffers change, as DDP's do after the first step, would not resume bit for
    bit). start() -> exchange() -> finish(); the bytes are a ring allreduce's."""

    final_stage = 2     # as BucketReduction's

    def __init__(self, name, flat, comm, divisor):
        self.name, self.flat, self.comm, self.divisor = name, flat, comm, divisor
        self.chunk = -(-flat.numel() // comm.size)
        self.stage = 0          # 1: the alltoall is in flight; 2: the allgather

    def start(self):
        n, chunk = self.comm.size, self.chunk
        padded = torch.zeros(n * chunk, dtype=torch.float32, device=self.flat.device)
        padded[: self.flat.numel()] = self.flat
        splits = torch.full((n,), chunk, dtype=torch.int32, device="cpu")
        self._handle = self.comm.alltoall_async(padded, splits, f"{self.name}.reduce_scatter")
        self.stage = 1
        return self

    def exchange(self):
        received, _ = self._handle.wait()
        owned = received.view(self.comm.size, self.chunk).sum(0).div_(self.divisor)
        self._handle = self.comm.allgather_async(owned, f"{self.name}.allgather")
        self.stage = 2
        return self

    def finish(self):
        """The reduced flat tensor, the same bytes on every rank."""
        if self.stage == 1:
            self.exchange()
        return self._handle.wait()[: self.flat.numel()]


class RowReduction:
    """FSDP's quantized reduce-scatter of a group's rows (fsdp.state.GroupLayout): row k of
    every rank to comm's rank k, which decodes them and sums them in fp32, in rank order, as
    BucketReduction's stage 1 does, with no stage 2 (nobody else needs the sum). Tensors under
    min_elements (the layout's small ones) travel in fp32 in the same alltoall. residual: the
    rank's stage-1 residual over every row it quantizes (None: no error feedback)."""

    def __init__(self, layout, codec, comm, residual, seed):
        self.layout, self.codec, self.comm = layout, codec, comm
        self.residual, self.seed = residual, seed
        self.amax_bounds = []   # bounds on each piece encoded with a residual (feedback.scrub)
        self.counts = {}        # Telemetry's counters of this reduction

    def run(self, rows, divisor):
        """This rank's row of the sum of every rank's rows (fp32), divided by divisor."""
        layout, n, device = self.layout, self.layout.ranks, rows.device
        send = torch.empty(n * layout.row_bytes, dtype=torch.uint8, device=device)
        send_rows = send.view(n, layout.row_bytes)
        # a bf16 residual through an fp32 copy: the codec's one-call paths take fp32 ones (else
        # a call per piece: ranks x parameters of them)
        residual = self.residual
        wide = None if residual is None else residual.to(torch.float32)
        if len(layout.pieces.starts):
            self.amax_bounds += self.codec.encode_pieces(rows.view(-1), wide, layout.pieces,
                                                         send, self.seed)
        if residual is not None and wide is not residual:
            residual.copy_(wide)
        small = np.flatnonzero(layout.small).tolist()
        for i in small:
            layout.columns(send_rows, i, 4 * layout.shards[i]).view(torch.float32).copy_(
                layout.columns(rows, i))
        splits = torch.full((n,), layout.row_bytes, dtype=torch.int32, device="cpu")
        (received, _), seconds = timed_wait(self.comm.alltoall_async(send, splits, "gift.fsdp"))
        sources = torch.empty(n * layout.shard, dtype=torch.float32, device=device)
        if len(layout.pieces.starts):
            self.codec.decode_pieces(received, layout.pieces, sources)
        source_rows, received_rows = sources.view(n, layout.shard), received.view(n, -1)
        for i in small:
            layout.columns(source_rows, i).copy_(
                layout.columns(received_rows, i, 4 * layout.shards[i]).view(torch.float32))
        fp32_bytes = 4 * sum(m for m, tiny in zip(layout.shards, layout.small) if tiny) * n
        self.counts = dict(elements=rows.numel(), payload_bytes=send.numel() - fp32_bytes,
                           bytes_sent=send.numel() - layout.row_bytes, wait_seconds=seconds)
        return source_rows.sum(0).div_(divisor)
