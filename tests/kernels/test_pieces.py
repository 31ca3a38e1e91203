"""A tensor's pieces in one call (Codec.encode_pieces / decode_pieces, on the native drivers of
kernels/native_pieces.py and the Triton kernels of kernels/pieces.py) give the bits of a call per
piece on the torch references:
every format, nearest and stochastic, no feedback, fp32 and bf16 residuals, folded maxima, a
piece that is not finite, pieces at any byte offset of a buffer."""
import numpy as np
import pytest
import torch

import horovod_gift as gift
from horovod_gift.codec.tensor_codec import Codec, TensorPieces, piece_seeds
from horovod_gift.kernels import native

CODECS = [("nvfp4", None), ("int3", None), ("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", 32),
          ("fp8_e5m2", 8)]
ENDS = [37, 1024, 1056, 5000, 9001, 9002, 20_000]


def layout(codec, ends, gap=3):
    """Pieces ending at ends, their payloads in order with `gap` bytes between them."""
    starts = [0] + ends[:-1]
    offsets, position = [], 5
    for lo, hi in zip(starts, ends):
        offsets.append(position)
        position += codec.payload_bytes(hi - lo) + gap
    arrays = [np.array(v, np.int64) for v in (starts, ends, offsets)]
    return TensorPieces(*arrays, np.arange(len(ends), dtype=np.int64)), position


def per_piece(codec, flat, residual, pieces, size, seed, maxima=None):
    """The payload buffer and residual after codec.encode of each piece (torch references)."""
    seeds = piece_seeds(seed, pieces.chunks, pieces.tensor)
    out = torch.full((size,), 0xA5, dtype=torch.uint8)
    residual = None if residual is None else residual.clone()
    with gift.use_kernels("torch"):
        for p, (lo, hi, start) in enumerate(zip(pieces.starts, pieces.ends, pieces.offsets)):
            codec.encode(flat[lo:hi], None if residual is None else residual[lo:hi],
                         int(seeds[p]), None if maxima is None else int(maxima[p]),
                         out[start : start + codec.payload_bytes(hi - lo)])
    return out, residual


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("fmt,block", CODECS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("feedback", [None, torch.float32, torch.bfloat16])
def test_one_call_for_every_piece_gives_the_bits_of_a_call_each(backend, fmt, block, rounding,
                                                                 feedback):
    """The native drivers, and the Triton kernels (in the interpreter here), against a call per
    piece on the torch references."""
    codec = Codec(fmt, block, rounding)
    g = torch.Generator().manual_seed(3)
    n = ENDS[-1]
    flat = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    flat[6000] = float("nan")       # poisons piece 4 only
    flat[1024:1056] = 0.0           # a piece of zeros
    residual = (None if feedback is None
                else (torch.randn(n, generator=g) * 0.1).to(feedback))
    pieces, size = layout(codec, ENDS)
    expected, expected_residual = per_piece(codec, flat, residual, pieces, size, 7919)
    out = torch.full((size,), 0xA5, dtype=torch.uint8)
    got_residual = None if residual is None else residual.clone()
    with gift.use_kernels(backend):
        bounds = codec.encode_pieces(flat, got_residual, pieces, out, 7919)
    assert torch.equal(out, expected), "payload bytes differ (or bytes between them written)"
    if residual is not None:
        assert torch.equal(got_residual.view(torch.uint8), expected_residual.view(torch.uint8))
    if residual is not None:
        finite = torch.cat([b.reshape(-1) for b in bounds]).isfinite()
        assert int((~finite).sum()) == 1, "exactly the NaN piece's bound is not finite"
    decoded, reference = torch.full((n,), 7.0), torch.full((n,), 7.0)
    with gift.use_kernels(backend):
        codec.decode_pieces(out, pieces, decoded)
    with gift.use_kernels("torch"):
        codec.decode_pieces(out, pieces, reference)
    assert torch.equal(decoded.view(torch.int32), reference.view(torch.int32))


@pytest.mark.parametrize("fmt,block", [("nvfp4", None), ("int3", None), ("fp8_e4m3", None),
                                       ("fp8_e5m2", 32)])
def test_folded_maxima_give_the_bits_of_a_call_each(fmt, block):
    """flat already holds u + r (a folded rotation) with each piece's largest magnitude_bits:
    one call gives what encode(folded_bits=...) of each piece gives, a non-finite piece too."""
    codec = Codec(fmt, block)
    g = torch.Generator().manual_seed(4)
    n = ENDS[-1]
    flat = torch.randn(n, generator=g)
    flat[9001] = float("inf")       # piece 5 (one element)
    pieces, size = layout(codec, ENDS)
    maxima = np.array([int((flat[lo:hi].abs().max()).view(torch.int32))
                       if bool(flat[lo:hi].isfinite().all()) else int(native.INF_BITS)
                       for lo, hi in zip(pieces.starts, pieces.ends)], np.int32)
    residual = torch.zeros(n)
    seeds = piece_seeds(0, pieces.chunks, pieces.tensor)
    with gift.use_kernels("native"):
        expected, expected_residual = torch.full((size,), 0xA5, dtype=torch.uint8), residual.clone()
        for p, (lo, hi, start) in enumerate(zip(pieces.starts, pieces.ends, pieces.offsets)):
            codec.encode(flat[lo:hi], expected_residual[lo:hi], int(seeds[p]), int(maxima[p]),
                         expected[start : start + codec.payload_bytes(hi - lo)])
        out = torch.full((size,), 0xA5, dtype=torch.uint8)
        codec.encode_pieces(flat, residual, pieces, out, 0, maxima)
    assert torch.equal(out, expected)
    assert torch.equal(residual.view(torch.int32), expected_residual.view(torch.int32))


def test_large_pieces_go_to_the_threaded_kernels_with_the_same_bits():
    """With several threads, a piece of 2**18 elements or more is encoded alone (the kernels
    split it across threads) and the others in one call: the same bits as one thread."""
    codec = Codec("nvfp4")
    n = (1 << 18) + 3000
    flat = torch.randn(n, generator=torch.Generator().manual_seed(5))
    pieces, size = layout(codec, [1000, 1000 + (1 << 18), n])
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, residual = torch.zeros(size, dtype=torch.uint8), torch.zeros(n)
            with gift.use_kernels("native"):
                codec.encode_pieces(flat, residual, pieces, out, 3)
            results.append((out, residual))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
