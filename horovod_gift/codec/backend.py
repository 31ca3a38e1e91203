"""Which implementation runs the codec, and the codec's own names (formats, roundings) and
argument check.

CUDA tensors run the compiled Triton kernels; CPU tensors run the native kernels (numba,
kernels/native.py; the Triton interpreter is 100-1000x slower). `HOROVOD_GIFT_KERNELS=triton` or
`use_kernels("triton")` forces the Triton kernels for every tensor (tests run them in the
interpreter with TRITON_INTERPRET=1); `"native"` the native kernels for CPU tensors; `"torch"`
the plain-torch references, which every other implementation matches bit for bit.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

FORMATS = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int3")
# the formats whose scale block is fixed: block_size may only name it (or be None)
FIXED_BLOCKS = {"nvfp4": 16, "int3": 32}
ROUNDINGS = ("nearest", "stochastic")
BACKENDS = ("auto", "triton", "native", "torch")

_backend = os.environ.get("HOROVOD_GIFT_KERNELS", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"HOROVOD_GIFT_KERNELS={_backend!r}: expected one of {BACKENDS}")


def runs_triton(tensor):
    return _backend == "triton" or (_backend == "auto" and tensor.is_cuda)


def runs_native(tensor):
    return _backend in ("auto", "native") and tensor.device.type == "cpu"


@contextlib.contextmanager
def use_kernels(backend: str = "triton") -> Iterator[None]:
    """Run the codec with `backend` ("auto", "triton", "native" or "torch") inside the block."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"use_kernels({backend!r}): expected one of {BACKENDS}")
    previous, _backend = _backend, backend
    try:
        yield
    finally:
        _backend = previous


def check_codec(format, block_size, rounding, where="encode"):
    """Raise ValueError naming the bad argument; returns nothing."""
    if format not in FORMATS:
        raise ValueError(f"{where}: unknown format {format!r}; expected one of {FORMATS}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"{where}: unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    if format in FIXED_BLOCKS:
        if block_size not in (None, FIXED_BLOCKS[format]):
            raise ValueError(
                f"{where}: {format} has fixed {FIXED_BLOCKS[format]}-element blocks; "
                f"got block_size={block_size!r}"
            )
    elif block_size is not None and (
        not isinstance(block_size, int)
        or block_size < 1
        or block_size & (block_size - 1)
        or block_size > 4096
    ):
        raise ValueError(
            f"{where}: block_size must be None (one scale per tensor) or a power of two "
            f"from 1 to 4096; got {block_size!r}"
        )
