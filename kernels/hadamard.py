"""Randomized Hadamard rotation of a flat tensor: kernel and reference.

    forward:  y = H_B (D x) / sqrt(B)     inverse:  x = D (H_B y) / sqrt(B)
on consecutive blocks of B (a power of two) elements; D holds seeded random signs, one per
element index, the same on every rank. A tail shorter than B is rotated in the power-of-two
blocks of its binary decomposition (tail 37 with B 128: 32, 4, 1), so the map is orthonormal and
exactly invertible at every size. The butterfly adds in the same order on both sides.
"""
import math

import numpy as np
import torch
import triton
import triton.language as tl

from .rounding import EXACT_ARITHMETIC, uniform_hash, uniform_hash_torch


def normalizer(block):
    """1/sqrt(block) rounded once to fp32, so kernel and reference multiply by the same number."""
    return float(np.float32(1.0 / math.sqrt(block)))


@triton.jit
def random_signs(seed, offs):
    return tl.where(uniform_hash(seed, offs) < 0.5, -1.0, 1.0)


@triton.jit
def hadamard_tile(x, ROWS: tl.constexpr, HB: tl.constexpr, LOG2_HB: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform along axis 1 of a (ROWS, HB) tile."""
    for st in tl.static_range(LOG2_HB):
        y = tl.permute(tl.reshape(x, (ROWS, HB // (2 << st), 2, 1 << st)), (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (ROWS, HB))
    return x


@triton.jit
def hadamard_kernel(x_ptr, out_ptr, start, n, seed, norm, INVERSE: tl.constexpr,
                    ROWS: tl.constexpr, HB: tl.constexpr, LOG2_HB: tl.constexpr):
    """Rotates elements [start, start + n) of x, n a multiple of HB."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = start + rows[:, None] * HB + tl.arange(0, HB)[None, :]
    mask = (rows < n // HB)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    signs = random_signs(seed, offs)
    if INVERSE:
        y = hadamard_tile(x, ROWS, HB, LOG2_HB) * norm * signs
    else:
        y = hadamard_tile(x * signs, ROWS, HB, LOG2_HB) * norm
    tl.store(out_ptr + offs, y, mask=mask)


def segments(n, block):
    """(start, length, block) pieces covering n elements: whole blocks, then the tail's powers of two."""
    whole = n // block * block
    pieces = [(0, whole, block)] if whole else []
    start, size = whole, block // 2
    while start < n:
        if n - start >= size:
            pieces.append((start, size, size))
            start += size
        size //= 2
    return pieces


def hadamard_triton(x, block, seed, inverse=False, out=None):
    """out may be x itself: each program loads its blocks whole before it stores them."""
    out = torch.empty_like(x) if out is None else out
    for start, length, b in segments(x.numel(), block):
        rows = max(1, min(64, 4096 // b))
        grid = (triton.cdiv(length // b, rows),)
        hadamard_kernel[grid](x, out, start, length, seed, normalizer(b), **EXACT_ARITHMETIC, INVERSE=inverse,
                              ROWS=rows, HB=b, LOG2_HB=b.bit_length() - 1)
    return out


# ---------------------------------------------------------------- torch reference (the CPU path)
def butterfly(items):
    """Walsh-Hadamard butterflies over a list of 2**k tensors: strides 1, 2, 4, ... in that order."""
    h = 1
    while h < len(items):
        items = [items[i - h] - items[i] if i & h else items[i] + items[i + h] for i in range(len(items))]
        h *= 2
    return items


def hadamard_rows_torch(x, norm=1.0, signs=None):
    """Walsh-Hadamard transform of each row of a (rows, B) tensor, in the kernel's order, times norm,
    then times signs (x's shape) if given. Two spellings of the same operations, so the same bits:
    eager torch pays per op, so it runs one op per level on the whole tensor; compiled code runs
    index arithmetic per element for that, so it gets lists of strided views instead."""
    if torch.compiler.is_compiling():
        return _hadamard_rows_listed(x, norm, signs)
    rows, b = x.shape
    h = 1
    while h < b:
        y = x.view(rows, b // (2 * h), 2, h)
        x = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).view(rows, b)
        h *= 2
    x = x * norm
    return x if signs is None else x * signs


def _hadamard_rows_listed(x, norm, signs):
    """Each stage runs four levels on a list of 16 strided views, which Inductor keeps in registers:
    elementwise ops on whole views, no index arithmetic (15 -> 3-5 ns an element). The last stage
    scales before it stacks: Inductor cannot fuse a multiply into the stack's producers."""
    rows, b = x.shape
    stride = 1
    while True:
        group = min(16, b // stride)
        shape = (rows, b // (stride * group), group, stride)
        items = butterfly(list(x.reshape(shape).unbind(2)))
        stride *= group
        if stride >= b:
            items = [item * norm for item in items]
            if signs is not None:
                items = [item * sign for item, sign in zip(items, signs.reshape(shape).unbind(2))]
            return torch.stack(items, dim=2).reshape(rows, b)
        x = torch.stack(items, dim=2).reshape(rows, b)


def random_signs_torch(seed, start, length, device):
    """+-1 as int8: a quarter of the memory traffic of fp32 signs, and x * sign is exact either way."""
    u = uniform_hash_torch(seed, torch.arange(start, start + length, device=device))
    return torch.where(u < 0.5, -1, 1).to(torch.int8)


def hadamard_torch(x, block, seed, inverse=False, signs=None):
    """signs: random_signs_torch(seed, 0, x.numel()) when the caller already has them."""
    if signs is None:
        signs = random_signs_torch(seed, 0, x.numel(), x.device)
    pieces = [hadamard_blocks_torch(x[start:start + length], signs[start:start + length], b, inverse)
              for start, length, b in segments(x.numel(), block)]
    return torch.cat(pieces) if len(pieces) > 1 else (pieces[0] if pieces else x.clone())


def hadamard_blocks_torch(x, signs, block, inverse=False):
    """The rotation of flat x, whose length is a multiple of block, with its signs."""
    if inverse:
        y = hadamard_rows_torch(x.view(-1, block), normalizer(block), signs.view(-1, block))
    else:
        y = hadamard_rows_torch((x * signs).view(-1, block), normalizer(block))
    return y.reshape(-1)
