"""Randomized Hadamard rotation of a flat tensor: kernel and reference.

    forward:  y = H_B (D x) / sqrt(B)     inverse:  x = D (H_B y) / sqrt(B)
on blocks of B (a power of two) elements; D holds seeded random signs, one per element index, the
same on every rank. The blocks interleave: each span of LANES * B consecutive elements holds LANES
blocks, block j taking elements j, j + LANES, j + 2 LANES, ... of the span. Every butterfly then
adds whole LANES-wide vectors, so vectorized CPU code (kernels/native.py) needs no shuffles within
a vector. On the example model's real
gradients the change moved the energy-weighted round-trip error by -7 % to +3 % per codec,
transform and step, the worst layer's by -17 % to +14 % (benchmarks/results/fidelity*.md).
The remainder, shorter than a span, is rotated in contiguous blocks of B and its tail in the
power-of-two blocks of the tail's binary decomposition (tail 37 with B 128: 32, 4, 1), so the map
is orthonormal and exactly invertible at every size. The butterfly adds in the same order on
both sides.
"""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from .rounding import EXACT_ARITHMETIC, uniform_hash, uniform_hash_torch

LANES = 16


# 1/sqrt(block) rounded once to fp32, so every kernel and the reference multiply by the same number.
NORMALIZERS = {1 << k: float(np.float32(1.0 / math.sqrt(1 << k))) for k in range(63)}


def normalizer(block):
    return NORMALIZERS[block]


@triton.jit
def random_signs(seed, offs):
    return tl.where(uniform_hash(seed, offs) < 0.5, -1.0, 1.0)


@triton.jit
def hadamard_tile(
    x,                          # (ROWS, HB * COLUMNS) fp32 tile
    ROWS: tl.constexpr,         # rows of the tile
    HB: tl.constexpr,           # rotation block
    LOG2_HB: tl.constexpr,      # log2(HB): butterfly stages
    COLUMNS: tl.constexpr,      # blocks side by side in a row
):
    """Unnormalized Walsh-Hadamard transforms of a (ROWS, HB * COLUMNS) tile whose element
    (r, i * COLUMNS + c) is entry i of block c of row r."""
    for st in tl.static_range(LOG2_HB):
        y = tl.permute(tl.reshape(x, (ROWS, HB // (2 << st), 2, COLUMNS << st)), (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, HB * COLUMNS))
    return x


@triton.jit
def hadamard_kernel(
    x_ptr,              # flat fp32 input
    out_ptr,            # out: flat fp32 (may be x_ptr: a program loads its blocks before storing)
    start,              # first element of the segment rotated
    n,                  # elements of the segment, a multiple of HB * LANES
    seed,               # the signs' seed
    norm,               # 1 / sqrt(HB)
    INVERSE: tl.constexpr,      # undo the rotation (signs after the transform)
    ROWS: tl.constexpr,         # tile rows per program
    HB: tl.constexpr,           # rotation block
    LOG2_HB: tl.constexpr,      # log2(HB): butterfly stages
    LANES: tl.constexpr,        # blocks interleaved in a span
    COLUMNS: tl.constexpr,      # of those, blocks in one tile row
):
    """Rotates elements [start, start + n) of x, n a multiple of HB * LANES. A row of the tile is
    COLUMNS of the LANES interleaved blocks of one span (all of them when they fit a tile)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    span, first = rows // (LANES // COLUMNS), rows % (LANES // COLUMNS) * COLUMNS
    within = tl.arange(0, HB * COLUMNS)
    lane_offs = within // COLUMNS * LANES + within % COLUMNS
    offs = (start + span * (HB * LANES) + first)[:, None] + lane_offs[None, :]
    mask = (rows < n // (HB * COLUMNS))[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    signs = random_signs(seed, offs)
    if INVERSE:
        y = hadamard_tile(x, ROWS, HB, LOG2_HB, COLUMNS) * norm * signs
    else:
        y = hadamard_tile(x * signs, ROWS, HB, LOG2_HB, COLUMNS) * norm
    tl.store(out_ptr + offs, y, mask=mask)


def segments(n, block):
    """(start, length, block, lanes) pieces covering n elements: whole spans of LANES interleaved
    blocks, then the remainder's contiguous blocks (lanes 1), then its tail's powers of two."""
    span = LANES * block
    head = n // span * span
    whole = n // block * block
    pieces = [(0, head, block, LANES)] if head else []
    if whole > head:
        pieces.append((head, whole - head, block, 1))
    start, size = whole, block // 2
    while start < n:
        if n - start >= size:
            pieces.append((start, size, size, 1))
            start += size
        size //= 2
    return pieces


TILE = 4096


def hadamard_triton(x, block, seed, inverse=False, out=None):
    """out may be x itself: each program loads its blocks whole before it stores them."""
    out = torch.empty_like(x) if out is None else out
    for start, length, b, lanes in segments(x.numel(), block):
        columns = max(1, min(lanes, TILE // b))
        rows = max(1, min(64, TILE // (b * columns)))
        grid = (triton.cdiv(length // (b * columns), rows),)
        hadamard_kernel[grid](x, out, start, length, seed, normalizer(b), **EXACT_ARITHMETIC,
                              INVERSE=inverse, ROWS=rows, HB=b, LOG2_HB=b.bit_length() - 1,
                              LANES=lanes, COLUMNS=columns)
    return out


# ---------------------------------------------------------------- torch reference
def hadamard_rows_torch(x, norm=1.0, signs=None):
    """Walsh-Hadamard transforms along axis 1 of a (rows, B, lanes) tensor, in the kernel's order,
    times norm, then times signs (x's shape) if given: one op per level on the whole tensor."""
    rows, b, lanes = x.shape
    h = 1
    while h < b:
        y = x.view(rows, b // (2 * h), 2, h, lanes)
        x = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        x = x.view(rows, b, lanes)
        h *= 2
    x = x * norm
    return x if signs is None else x * signs


def random_signs_torch(seed, start, length, device):
    """+-1 as int8: a quarter of the memory traffic of fp32 signs, and x * sign is exact either
    way."""
    u = uniform_hash_torch(seed, torch.arange(start, start + length, device=device))
    return torch.where(u < 0.5, -1, 1).to(torch.int8)


def hadamard_torch(x, block, seed, inverse=False, signs=None):
    """signs: random_signs_torch(seed, 0, x.numel()) when the caller already has them."""
    if signs is None:
        signs = random_signs_torch(seed, 0, x.numel(), x.device)
    pieces = []
    for start, length, b, lanes in segments(x.numel(), block):
        part = slice(start, start + length)
        pieces.append(hadamard_blocks_torch(x[part].view(-1, b, lanes),
                                            signs[part].view(-1, b, lanes), b, inverse).reshape(-1))
    return torch.cat(pieces) if len(pieces) > 1 else (pieces[0] if pieces else x.clone())


def hadamard_blocks_torch(x, signs, block, inverse=False):
    """The rotation of x shaped (rows, block, lanes), with its signs (the same shape)."""
    norm = normalizer(block)
    return hadamard_rows_torch(x, norm, signs) if inverse else hadamard_rows_torch(x * signs, norm)
