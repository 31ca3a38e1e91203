"""GIFT on a model a trainer has already wrapped, whatever the trainer: install() recognizes the
engine, check_engaged() catches a hook the engine never called, and RankFiles keeps each rank's
GIFT state beside the trainer's checkpoint."""
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..ddp import GiftState, gift_hook
from ..fsdp import attach

logger = logging.getLogger("horovod_gift")

# engines that wrap a model in a way GIFT cannot serve, by class name (their packages are not
# imported here), with what to use instead
REFUSED = {
    "FullyShardedDataParallel": "FSDP1: GIFT takes FSDP2 (fully_shard; Accelerate's "
                                "fsdp_version=2)",
    "DeepSpeedEngine": "DeepSpeed reduces gradients itself: GIFT takes DDP or FSDP2",
    "DataParallel": "DataParallel runs in one process: use DistributedDataParallel",
}


def install(model, config=None, **options):
    """GIFT on model as an engine wrapped it (config: a GiftConfig, options: fields of it):
    DistributedDataParallel gets GiftState and gift_hook, a model holding fully_shard modules
    gets fsdp.attach. Returns the state (GiftState or FsdpGiftState). Collective: every rank
    calls it, after the engine wrapped the model and before the first backward. In a single
    process (nothing to reduce) it warns and returns None; any other model raises, naming its
    type."""
    kind = type(model).__name__
    if kind in REFUSED:
        raise TypeError(f"GIFT: the model is a {kind}; {REFUSED[kind]}")
    if isinstance(model, DistributedDataParallel):
        state = GiftState(model, config=config, **options)
        try:
            model.register_comm_hook(state, gift_hook)
        except RuntimeError as error:       # DDP takes one hook, and says so in its own words
            raise RuntimeError("GIFT: this DistributedDataParallel model already has a comm "
                               "hook (a trainer's own: fp16, bf16, PowerSGD ...); GIFT replaces "
                               "it: remove that option") from error
        return state
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return attach(model, config, **options)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        logger.warning("GIFT: one process, nothing to reduce: training runs without GIFT")
        return None
    raise TypeError(f"GIFT: the model is a {kind} on {dist.get_world_size()} ranks, neither "
                    "DistributedDataParallel nor fully_shard'ed: GIFT cannot reduce its "
                    "gradients (wrap it first, or install GIFT after the trainer has)")


def check_engaged(state, optimizer_steps):
    """Raise if the optimizer has stepped but the engine never ran GIFT (its step count is
    still 0): the gradients were reduced without it. Call it after the first optimizer step."""
    if state is not None and optimizer_steps > 0 and state.step == 0:
        raise RuntimeError(f"GIFT was installed, but after {optimizer_steps} optimizer step(s) "
                           "the engine has not called it once: the gradients were reduced "
                           "without GIFT (did the trainer replace the model or its hook?)")


class RankFiles:
    """Each rank's GIFT state_dict in a file of its own in a checkpoint's folder (as the
    transformers Trainer keeps each rank's RNG state): gift-rank{rank}.pt."""

    def __init__(self, state):
        self.state = state

    def path(self, folder):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return os.path.join(folder, f"gift-rank{rank}.pt")

    def save(self, folder):
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), self.path(folder))

    def load(self, folder):
        """Load this rank's file from folder; without one, warn: GIFT restarts its statistics
        and residuals (training goes on, not bit for bit)."""
        path = self.path(folder)
        if not os.path.exists(path):
            logger.warning("GIFT: no %s in the checkpoint; GIFT's statistics and error-feedback "
                           "residuals restart from zero", os.path.basename(path))
            return
        self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
