"""Which implementation runs the codec, and the names and arguments the public API accepts.

CUDA tensors run the compiled Triton kernels; CPU tensors run the native kernels (numba,
kernels/native.py; the Triton interpreter is 100-1000x slower). `HOROVOD_GIFT_KERNELS=triton` or
`use_kernels("triton")` forces the Triton kernels for every tensor (tests run them in the
interpreter with TRITON_INTERPRET=1); `"native"` the native kernels for CPU tensors; `"torch"`
the plain-torch references, which every other implementation matches bit for bit.
"""

import contextlib
import os

import torch

FORMATS = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
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
def use_kernels(backend="triton"):
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
    if format == "nvfp4":
        if block_size not in (None, 16):
            raise ValueError(
                f"{where}: nvfp4 has fixed 16-element blocks; got block_size={block_size!r}"
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


RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)


def check_arguments(model, format, block_size, rounding, transform, nonfinite, damping,
                    start_step, grad_scaler, residual_dtype, topology, node_size, **positive_ints):
    """GIFT's arguments, each refused by name with what it accepts."""
    from .topology import TOPOLOGIES
    from .transforms import TRANSFORMS     # transforms imports this module

    if topology not in TOPOLOGIES:
        raise ValueError(f"GIFT: unknown topology {topology!r}; expected one of {TOPOLOGIES}")
    if node_size is not None and (not isinstance(node_size, int) or node_size < 1):
        raise ValueError(f"GIFT: node_size must be None (Horovod's local size) or a positive "
                         f"int, got {node_size!r}")

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"GIFT: expected the torch.nn.Module being trained, "
                        f"got {type(model).__name__}")
    check_codec(format, block_size, rounding, where="GIFT")
    if transform not in TRANSFORMS:
        raise ValueError(f"GIFT: unknown transform {transform!r}; expected one of {TRANSFORMS}")
    if nonfinite not in ("nan", "raise"):
        raise ValueError(f"GIFT: nonfinite must be 'nan' or 'raise', got {nonfinite!r}")
    for what, value in positive_ints.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"GIFT: {what} must be a positive int, got {value!r}")
    if not damping > 0:
        raise ValueError(f"GIFT: damping must be positive, got {damping!r}")
    if not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"GIFT: start_step must be a non-negative int, got {start_step!r}")
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(f"GIFT: grad_scaler must be a torch.amp.GradScaler, "
                        f"got {type(grad_scaler).__name__}")
    if residual_dtype not in RESIDUAL_DTYPES:
        raise ValueError(f"GIFT: residual_dtype must be one of {RESIDUAL_DTYPES}, "
                         f"got {residual_dtype!r}")
