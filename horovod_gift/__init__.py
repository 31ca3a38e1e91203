"""horovod-gift: low-precision (FP8 / NVFP4) gradient communication for Horovod + PyTorch.

The codec (formats, collective, transforms, ...) imports no engine; `GIFT` and `allreduce`, the
Horovod frontend, import horovod.torch when first used.
"""

__version__ = "0.3.0"

from .codec.formats import Encoded, decode, encode
from .codec.rotation import HadamardRotation
from .config import FORMATS, ROUNDINGS, GiftConfig, use_kernels
from .geometry.linear_layers import register_linear
from .geometry.whitening import InputWhitening

# name -> module of the Horovod frontend (imported on first use)
_HOROVOD_NAMES = {"GIFT": "hvd.compressor", "allreduce": "hvd.comm"}

__all__ = [
    "__version__",
    "GIFT",
    "allreduce",
    "GiftConfig",
    "FORMATS",
    "ROUNDINGS",
    "use_kernels",
    "Encoded",
    "encode",
    "decode",
    "HadamardRotation",
    "InputWhitening",
    "register_linear",
]


def __getattr__(name):
    if name not in _HOROVOD_NAMES:
        raise AttributeError(f"module 'horovod_gift' has no attribute {name!r}")
    try:
        import horovod.torch  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"horovod_gift.{name} needs horovod.torch (Horovod built with PyTorch support): "
            "install Horovod 0.28.1 first (on a fresh machine `make setup` builds it), then "
            "`pip install .`; the codec (horovod_gift.formats, .collective) works without it"
        ) from error
    import importlib

    return getattr(importlib.import_module(f".{_HOROVOD_NAMES[name]}", __name__), name)
