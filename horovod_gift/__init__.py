"""horovod-gift: low-precision (FP8 / NVFP4) gradient communication for Horovod + PyTorch."""

from .config import FORMATS, ROUNDINGS, use_kernels
from .collective import allreduce
from .compression import GIFT
from .formats import Encoded, decode, encode
from .geometry import HadamardRotation, InputWhitening

__all__ = [
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
