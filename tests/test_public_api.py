"""The public API is typed: every parameter of what users call, and what it returns."""
import inspect

import pytest

import horovod_gift as gift
from horovod_gift.core.state_base import GiftStateBase
from horovod_gift.fsdp.state import FsdpGiftState
from horovod_gift.integrations.torchft import GiftDiLoCo

ENTRY_POINTS = [gift.GiftState, gift.gift_hook, gift.attach, gift.GIFT, gift.allreduce,
                gift.encode, gift.decode, gift.register_linear, gift.use_kernels, GiftDiLoCo,
                GiftStateBase.state_dict, GiftStateBase.load_state_dict, GiftStateBase.stats,
                gift.GiftState.reset_rank_state, GiftDiLoCo.state_dict, GiftDiLoCo.load_state_dict,
                GiftDiLoCo.stats, FsdpGiftState.stats]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.__qualname__)
def test_every_parameter_and_the_result_is_annotated(entry):
    signature = inspect.signature(entry.__init__ if inspect.isclass(entry) else entry)
    untyped = [name for name, p in signature.parameters.items()
               if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
               and p.annotation is p.empty]
    assert not untyped, f"{entry.__qualname__}: {untyped} have no annotation"
    assert signature.return_annotation is not signature.empty, entry.__qualname__


def test_the_ddp_hooks_annotations_are_the_ones_ddp_accepts():
    """DDP's register_comm_hook refuses a hook whose bucket or result annotation is anything but
    dist.GradBucket and Future[Tensor] (a string annotation included)."""
    import torch
    import torch.distributed as dist
    signature = inspect.signature(gift.gift_hook)
    assert signature.parameters["bucket"].annotation is dist.GradBucket
    assert signature.return_annotation == torch.futures.Future[torch.Tensor]
