"""horovod-gift: low-precision (FP8 / NVFP4) gradient communication for Horovod + PyTorch."""
from .config import FORMATS, ROUNDINGS, use_kernels
from .formats import Encoded, decode, encode
from .geometry import HadamardRotation, InputWhitening

__all__ = ["FORMATS", "ROUNDINGS", "use_kernels", "Encoded", "encode", "decode", "HadamardRotation",
           "InputWhitening"]
