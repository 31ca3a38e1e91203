"""horovod-gift: low-precision (FP8 / NVFP4) gradient communication for data-parallel PyTorch.

Three frontends over one engine-neutral core: `GiftState` + `gift_hook` (a DDP communication
hook), `attach` (FSDP2's reduce-scatter, HSDP included) and `GIFT` (a Horovod Compressor). Each
is imported when first used: only `GIFT` and `allreduce` need horovod.torch. The layers below
them (codec/, geometry/, reduce/, core/) import no engine.
"""

__version__ = "0.3.0"

import importlib

from .codec.formats import Encoded, decode, encode
from .codec.rotation import HadamardRotation
from .codec.backend import FORMATS, ROUNDINGS, use_kernels
from .config import GiftConfig
from .geometry.linear_layers import register_linear
from .geometry.whitening import InputWhitening

# name -> the frontend's module, imported on first use (Horovod's need horovod.torch)
_FRONTENDS = {"GiftState": "ddp", "gift_hook": "ddp", "attach": "fsdp",
              "GIFT": "hvd.compressor", "allreduce": "hvd.comm"}

__all__ = [
    # the frontends: DDP's communication hook, FSDP2's reduce-scatter, Horovod's compressor
    "GiftState", "gift_hook", "attach", "GIFT", "allreduce",
    # every option of every frontend, and what they accept by name
    "GiftConfig", "FORMATS", "ROUNDINGS", "use_kernels",
    # the codec and the transforms on their own
    "Encoded", "encode", "decode", "HadamardRotation", "InputWhitening", "register_linear",
    "__version__",
]


def __getattr__(name):
    if name not in _FRONTENDS:
        raise AttributeError(f"module 'horovod_gift' has no attribute {name!r}")
    if _FRONTENDS[name].startswith("hvd."):
        try:
            import horovod.torch  # noqa: F401
        except ImportError as error:
            raise ImportError(
                f"horovod_gift.{name} needs horovod.torch (Horovod built with PyTorch support): "
                "install Horovod 0.28.1 first (on a fresh machine `make setup` builds it), then "
                "`pip install .`; DDP's GiftState and FSDP's attach work without it"
            ) from error
    return getattr(importlib.import_module(f".{_FRONTENDS[name]}", __name__), name)
