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

import functools
import time
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from horovod_gift.kernels.fp8 import FORMATS as FP8_FORMATS
from horovod_gift.kernels.nvfp4 import TENSOR_SCALE_DIVISOR

from .config import check_codec
from .formats import dequantize, payload_layout, quantize, quantize_folded, sum_quantize
from .workspaces import workspace


@dataclass(frozen=True)
class Codec:
    format: str = "nvfp4"
    block_size: Optional[int] = None
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self):
        check_codec(self.format, self.block_size, self.rounding, where="Codec")

    @property
    def align(self):
        """Chunk boundaries fall on multiples of this, so no scale block straddles two owners."""
        return 32 if self.format == "nvfp4" else max(32, self.block_size or 1)

    def layout(self, m):
        """Byte sizes (codes, scales, tensor scale) of an m-element piece."""
        return payload_layout(self.format, self.block_size, m)

    def payload_bytes(self, m):
        return sum(self.layout(m)) if m else 0

    def encode(self, flat, residual=None, seed=0, folded_bits=None, out=None):
        """flat fp32 -> uint8 payload (written into out, payload_bytes of uint8, if given);
        residual (same size, fp32 or bf16) is updated in place. The kernels update fp32
        residuals: a bf16 one goes through an fp32 workspace and back (round to nearest even,
        the same on every device). folded_bits: flat already holds x + residual, summed
        natively, with this largest magnitude_bits (quantize_folded)."""
        m = flat.numel()
        payload = self._payload(m, flat.device, out)
        if m == 0:
            return payload
        fmt, block, stochastic = self.format, self.block_size, self.rounding == "stochastic"
        if folded_bits is None:
            def quantizer(wide):
                return quantize(flat, fmt, block, stochastic, seed, wide, payload=payload)
        else:
            def quantizer(wide):
                return quantize_folded(flat, folded_bits, wide, fmt, block, stochastic, seed,
                                       payload)
        return self._with_fp32_residual(residual, m, flat.device, quantizer, payload)

    def reduce_encode(self, payloads, m, divisor, residual=None, seed=0, sum_out=None, out=None):
        """The payload (into out, as in encode) of the fp32 sum of the payloads of an m-element
        piece (the rows of payloads, uint8 (k, payload_bytes(m)), in their order) divided by
        divisor, encoded with residual as encode does; sum_out: m fp32 elements of workspace
        for the sum."""
        codes, scales, tensor_scales = self.split_rows(payloads, m)
        stochastic = self.rounding == "stochastic"
        payload = self._payload(m, codes.device, out)
        return self._with_fp32_residual(
            residual, m, codes.device,
            lambda wide: sum_quantize(codes, scales, tensor_scales, m, self.format,
                                      self.block_size, divisor, stochastic, seed, wide, sum_out,
                                      payload),
            payload,
        )

    def _payload(self, m, device, out):
        if out is None:
            return torch.empty(self.payload_bytes(m), dtype=torch.uint8, device=device)
        size = self.payload_bytes(m)
        if (out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous()
                or out.device != device):
            raise ValueError(f"Codec: out must be {size} contiguous uint8 elements on {device} "
                             f"for {m} values, got {out.dtype} {tuple(out.shape)} on {out.device}")
        return out

    @staticmethod
    def _with_fp32_residual(residual, m, device, quantizer, payload):
        """payload, holding quantizer(an fp32 residual or None)'s codes and scales: a narrow
        residual is widened into a workspace and rounded back after. Parts the native kernels
        wrote in place are not copied."""
        narrow = residual is not None and residual.dtype != torch.float32
        wide = workspace(m, device, "residual").copy_(residual) if narrow else residual
        codes, scales, tensor_scale = quantizer(wide)
        if narrow:
            residual.copy_(wide)
        position = 0
        for part in (codes, scales, tensor_scale):
            if part is None:
                continue
            data = part.reshape(-1).view(torch.uint8)
            target = payload[position : position + data.numel()]
            if data.data_ptr() != target.data_ptr():
                target.copy_(data)
            position += data.numel()
        return payload

    def split(self, payload, m):
        """(codes, scales, tensor_scale) views of a payload of an m-element piece."""
        c, s, t = self.layout(m)
        codes = payload[:c]
        # pieces start at any byte offset; fp32 views need 4-byte alignment, hence the copies
        if self.format == "nvfp4":
            return codes, payload[c : c + s], payload[c + s : c + s + t].clone().view(torch.float32)
        return codes, payload[c : c + s].clone().view(torch.float32), None

    def split_rows(self, payloads, m):
        """split() of every row of payloads (k, payload_bytes(m)): codes (k, c), scales (k, ...)
        and NVFP4's tensor scales (k,), or None."""
        c, s, t = self.layout(m)
        codes = payloads[:, :c]
        if self.format == "nvfp4":
            tensor_scales = payloads[:, c + s : c + s + t].contiguous().view(torch.float32)
            return codes, payloads[:, c : c + s], tensor_scales.reshape(-1)
        return codes, payloads[:, c : c + s].contiguous().view(torch.float32), None

    def amax_bound(self, payload, m):
        """The largest magnitude the payload's m-element piece held, to within rounding, read
        from its scales (a one-element fp32 tensor on the payload's device, no host sync); not
        finite when the piece was not. It also bounds every value the payload decodes to.
        NVFP4: the tensor scale times 6 * 448; FP8: the largest scale times the format's
        largest value."""
        _, scales, tensor_scale = self.split(payload, m)
        if self.format == "nvfp4":
            return tensor_scale * TENSOR_SCALE_DIVISOR
        return scales.max().reshape(1) * FP8_FORMATS[self.format].max

    def decode(self, payload, m, out=None):
        """The m fp32 values of a payload, into out (m contiguous fp32 elements) if given."""
        if m == 0:
            return (
                torch.empty(0, dtype=torch.float32, device=payload.device) if out is None else out
            )
        return dequantize(*self.split(payload, m), m, self.format, self.block_size, out=out)


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
            # the tensors overlapping [start, end): a scan from the first that ends after start
            first = next((i for i in range(len(sizes)) if offsets[i + 1] > start), len(sizes))
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
        # Horovod reads the splits on the host, whatever the payload's device
        self.splits = torch.tensor(self.chunk_bytes, dtype=torch.int32, device="cpu")
        self.slot = max(self.chunk_bytes)

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


class BucketReduction:
    """One quantized reduction of a list of flat fp32 tensors over comm (a Communicator):
    start() -> exchange() -> finish(). key: an integer naming the bucket in the stochastic
    rounding's seeds (every bucket draws its own noise)."""

    def __init__(self, name, flats, codec, comm, residual1=None, residual2=None, average=True,
                 step=0, maxima=None, key=0):
        self.name, self.flats, self.codec, self.comm = name, flats, codec, comm
        self.residual1, self.residual2, self.average = residual1, residual2, average
        self.step, self.key = step, key
        # per flat, None or its pieces' largest magnitude_bits: the flat then holds u + r1
        # (TransformPlan.forward_folded), and r1 is only written
        self.maxima = maxima or [None] * len(flats)
        self.n, self.rank = comm.size, comm.rank
        self.layout = BucketLayout.of(tuple(f.numel() for f in flats), self.n, codec.align, codec)
        self.pieces = self.layout.pieces
        self.bytes_sent = 0
        self.wait_seconds = 0.0  # blocked waiting for the communicator
        self.amax_bounds = []  # Codec.amax_bound of each piece encoded with a residual
        self.stage = 0          # 1: the alltoall is in flight; 2: the allgather

    def _wait(self, handle):
        t0 = time.perf_counter()
        out = handle.wait()
        self.wait_seconds += time.perf_counter() - t0
        return out

    def _bound(self, payload, m, residual):
        if residual is not None and m:
            self.amax_bounds.append(self.codec.amax_bound(payload, m))
        return payload

    def start(self):
        layout = self.layout
        send = torch.empty(layout.chunk_starts[-1], dtype=torch.uint8, device=self.flats[0].device)
        encoded = [0] * len(self.flats)   # pieces of each flat so far
        for k, chunk in enumerate(layout.chunks):
            base = layout.chunk_starts[k]
            for piece in chunk:
                i, lo, hi = piece.tensor, piece.lo, piece.hi
                residual = None if self.residual1 is None else self.residual1[i][lo:hi]
                maxima = self.maxima[i]
                payload = self.codec.encode(
                    self.flats[i][lo:hi],
                    residual,
                    mix_seed(self.codec.seed, self.step, self.rank, self.key, k, i, 1),
                    folded_bits=None if maxima is None else int(maxima[encoded[i]]),
                    out=send[base + piece.start : base + piece.end],
                )
                encoded[i] += 1
                self._bound(payload, hi - lo, residual)
        self.bytes_sent += layout.chunk_starts[-1] - layout.chunk_bytes[self.rank]
        self._handle = self.comm.alltoall_async(send, layout.splits, f"{self.name}.reduce_scatter")
        self.stage = 1
        return self

    def ready(self):
        """True when the step's next call (exchange() in stage 1) would not wait."""
        return self._handle.poll()

    def exchange(self):
        received, _ = self._wait(self._handle)
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
                self.n if self.average else 1,
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

    def finish(self, over_inputs=False):
        """The reduced tensors, flat fp32, identical on every rank. over_inputs: written over the
        input tensors, whose values start() has sent, instead of new ones: on CPU a new tensor of
        over 32 MB costs a page fault per 4 KB (finish() of a 2**24-element tensor on 2 ranks:
        80 -> 28 ms)."""
        gathered = self._wait(self._handle).view(self.n, -1)
        out = self.flats if over_inputs else [torch.empty_like(f) for f in self.flats]
        for k, chunk in enumerate(self.layout.chunks):
            for piece in chunk:
                self.codec.decode(gathered[k, piece.start : piece.end], piece.hi - piece.lo,
                                  out=out[piece.tensor][piece.lo : piece.hi])
        return out
