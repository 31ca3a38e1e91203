"""Codec: a format's payloads of flat fp32 pieces, with error feedback, as the reduction sends them.

A payload is one piece's bytes (formats.payload_layout): codes, scales, and NVFP4's or INT3's
tensor scale.
encode / reduce_encode / decode handle one piece; encode_pieces / decode_pieces every piece of
one tensor at once (a bucket cuts each tensor into a piece per rank it spans): one native call
on the CPU (kernels/native_pieces.py), one or two Triton launches on a GPU (kernels/pieces.py),
whatever the number of pieces, the same bits as a call per piece.
"""
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from horovod_gift.kernels import int3, native, native_pieces, nvfp4
from horovod_gift.kernels.fp8 import FORMATS as FP8_FORMATS
from horovod_gift.kernels.pieces import decode_pieces_triton, quantize_pieces_triton

from .backend import check_codec, runs_native, runs_triton
from .formats import dequantize, payload_layout, quantize, quantize_folded, sum_quantize
from .workspaces import workspace

# The largest magnitude a tensor scale stands for: the grid's largest value times E4M3's (448)
TENSOR_SCALE_DIVISORS = {"nvfp4": nvfp4.TENSOR_SCALE_DIVISOR, "int3": int3.TENSOR_SCALE_DIVISOR}


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
        """Chunk boundaries fall on multiples of this, so no scale block (nor INT3's 8-code
        group) straddles two owners."""
        return 32 if self.format in TENSOR_SCALE_DIVISORS else max(32, self.block_size or 1)

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
        codes, scales, tensor_scales = self.split_rows(payload[None], m)
        return codes[0], scales[0], tensor_scales

    def split_rows(self, payloads, m):
        """The (codes, scales, tensor scale) of every row of payloads (k, payload_bytes(m)):
        codes (k, c), scales (k, ...) and NVFP4's or INT3's tensor scales (k,), or None."""
        c, s, t = self.layout(m)
        # pieces start at any byte offset; fp32 views need 4-byte alignment, hence the copies
        def fp32(part):
            return part.clone(memory_format=torch.contiguous_format).view(torch.float32)

        if self.format in TENSOR_SCALE_DIVISORS:
            tensor_scales = fp32(payloads[:, c + s : c + s + t])[:, 0]
            return payloads[:, :c], payloads[:, c : c + s], tensor_scales
        return payloads[:, :c], fp32(payloads[:, c : c + s]), None

    def amax_bound(self, payload, m):
        """The largest magnitude the payload's m-element piece held, to within rounding, read
        from its scales (a one-element fp32 tensor on the payload's device, no host sync); not
        finite when the piece was not. It also bounds every value the payload decodes to (the
        piece's own amax, which encode_pieces reports, does so to within rounding).
        NVFP4: the tensor scale times 6 * 448, INT3: times 3 * 448; FP8: the largest scale
        times the format's largest value."""
        _, scales, tensor_scale = self.split(payload, m)
        if self.format in TENSOR_SCALE_DIVISORS:
            return tensor_scale * TENSOR_SCALE_DIVISORS[self.format]
        return scales.max().reshape(1) * FP8_FORMATS[self.format].max

    def decode(self, payload, m, out=None):
        """The m fp32 values of a payload, into out (m contiguous fp32 elements) if given."""
        if m == 0:
            return (
                torch.empty(0, dtype=torch.float32, device=payload.device) if out is None else out
            )
        return dequantize(*self.split(payload, m), m, self.format, self.block_size, out=out)


    def encode_pieces(self, flat, residual, pieces, out, seed, maxima=None):
        """encode() of every piece p of flat (pieces: TensorPieces), flat[starts[p]:ends[p]]
        with the same slice of residual and (folded_bits) maxima[p], into out[offsets[p]:];
        each piece's rounding seed is piece_seeds(seed, ...) of its chunk. Returns tensors of
        bounds on the pieces' magnitudes (their amax, or amax_bound; not finite for a piece that
        was not), for feedback.scrub. One native call on the CPU, with an fp32 residual or
        none (large pieces apart when several threads can share each), one or two Triton
        launches on a GPU; a call per piece otherwise."""
        count = len(pieces.starts)
        fp32_residual = residual is None or residual.dtype == torch.float32
        stochastic = self.rounding == "stochastic"
        if count and runs_triton(flat) and fp32_residual and maxima is None:
            for what, t in (("out", out), ("residual", residual)):
                if t is not None and t.device != flat.device:
                    raise ValueError(f"Codec.encode_pieces: {what} is on {t.device}, the "
                                     f"gradient on {flat.device}")
            starts, sizes, offsets, chunks = pieces.on(flat.device)
            amax = quantize_pieces_triton(flat, residual, starts, sizes, offsets,
                                          piece_seeds(seed, chunks, pieces.tensor),
                                          int(pieces.sizes.max()), out, self.format,
                                          self.block_size, stochastic)
            return [] if residual is None else [amax]
        seeds = piece_seeds(seed, pieces.chunks, pieces.tensor)
        if runs_native(flat) and fp32_residual:
            alone = (np.flatnonzero(pieces.sizes >= native.THREAD_MIN_ELEMENTS)
                     if torch.get_num_threads() > 1 else np.zeros(0, np.int64))
        else:
            alone = np.arange(count)
        bounds = []
        if len(alone) < count:
            batched = np.setdiff1d(np.arange(count), alone)
            found = native_pieces.encode_pieces(
                flat.numpy(), None if residual is None else residual.numpy(),
                pieces.starts[batched], pieces.ends[batched], out.numpy(),
                pieces.offsets[batched], seeds[batched],
                None if maxima is None else np.asarray(maxima, np.int32)[batched],
                self.format, self.block_size, stochastic)
            # its own bound is not finite where the piece was not
            bounds.append(torch.from_numpy(found.view(np.float32)))
            # such a piece goes to the reference, with its NaN rules
            for p in batched[found >= native.INF_BITS].tolist():
                self._encode_piece(flat, residual, pieces, p, seeds, maxima, out)
        for p in alone.tolist():
            payload = self._encode_piece(flat, residual, pieces, p, seeds, maxima, out)
            bounds.append(self.amax_bound(payload, int(pieces.sizes[p])))
        return bounds

    def _encode_piece(self, flat, residual, pieces, p, seeds, maxima, out):
        lo, hi, start = int(pieces.starts[p]), int(pieces.ends[p]), int(pieces.offsets[p])
        return self.encode(flat[lo:hi], None if residual is None else residual[lo:hi],
                           int(seeds[p]), None if maxima is None else int(maxima[p]),
                           out[start : start + self.payload_bytes(hi - lo)])

    def decode_pieces(self, buffer, pieces, out):
        """decode() of every piece p's payload at buffer[offsets[p]:] into
        out[starts[p]:ends[p]]: one native call on the CPU, one Triton launch on a GPU."""
        if len(pieces.starts) and runs_triton(buffer):
            starts, sizes, offsets, _ = pieces.on(buffer.device)
            return decode_pieces_triton(buffer, starts, sizes, offsets, int(pieces.sizes.max()),
                                        out, self.format, self.block_size)
        if runs_native(buffer):
            native_pieces.decode_pieces(buffer.numpy(), pieces.offsets, pieces.starts,
                                        pieces.ends, out.numpy(), self.format, self.block_size)
            return out
        for lo, hi, start in zip(pieces.starts.tolist(), pieces.ends.tolist(),
                                 pieces.offsets.tolist()):
            self.decode(buffer[start : start + self.payload_bytes(hi - lo)], hi - lo,
                        out=out[lo:hi])
        return out


@dataclass(frozen=True)
class TensorPieces:
    """The pieces of tensor `tensor` of a bucket (numpy int64 arrays): piece p is elements
    [starts[p], ends[p]) of chunk chunks[p], and its payload lies at offsets[p] of a byte
    buffer. on(device) gives the tables as tensors there, copied once."""
    starts: np.ndarray
    ends: np.ndarray
    offsets: np.ndarray
    chunks: np.ndarray
    tensor: int = 0
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sizes(self):
        return self.ends - self.starts

    def on(self, device):
        """(starts, sizes, offsets, chunks) as int64 tensors on device (kept: a copy from
        pageable host memory waits for the device's queue)."""
        if device not in self._tables:
            self._tables[device] = tuple(torch.from_numpy(np.ascontiguousarray(v)).to(device)
                                         for v in (self.starts, self.sizes, self.offsets,
                                                   self.chunks))
        return self._tables[device]


def piece_seeds(base, chunks, tensor):
    """31-bit rounding seeds of the pieces (chunks: their chunk numbers, numpy or a tensor) of
    tensor `tensor` of a bucket whose seed is base (collective.mix_seed of the codec's seed,
    step, rank and bucket): distinct for every chunk of a tensor, the same in every process
    and on every device (int64 arithmetic without overflow: base, chunk < 2**31)."""
    if isinstance(chunks, np.ndarray):
        chunks = chunks.astype(np.int64, copy=False)
    return (base + chunks * 0x9E3779B1 + tensor * 0x85EBCA77) & 0x7FFFFFFF
