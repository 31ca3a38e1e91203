"""horovod-gift: low-precision (FP8 / NVFP4) gradient communication for Horovod + PyTorch."""

__version__ = "0.2.0"

try:
    import horovod.torch  # noqa: F401
except ImportError as error:
    raise ImportError(
        "horovod_gift needs horovod.torch (Horovod built with PyTorch support): install Horovod "
        "0.28.1 first (on a fresh machine `make setup` builds it), then `pip install .`"
    ) from error

from .config import FORMATS, ROUNDINGS, use_kernels
from .collective import allreduce
from .compression import GIFT
from .formats import Encoded, decode, encode
from .geometry import InputWhitening
from .rotation import HadamardRotation

__all__ = [
    "__version__",
    "GIFT",
    "allreduce",
    "FORMATS",
    "ROUNDINGS",
    "use_kernels",
    "Encoded",
    "encode",
    "decode",
    "HadamardRotation",
    "InputWhitening",
]
