"""GIFT on a model a trainer has already wrapped, whatever the trainer: install() recognizes the
engine and watches that it calls GIFT (EngagementCheck); RankFiles keeps each rank's GIFT state
beside the trainer's checkpoint."""
import logging
import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

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


def install(model, config=None, grad_scaler=None, **options):
    """GIFT on model as an engine wrapped it (config: a GiftConfig, options: fields of it):
    DistributedDataParallel gets GiftState and gift_hook, a model holding fully_shard modules
    gets fsdp.attach; a torch.compile'd model, the model it compiled. grad_scaler: the trainer's
    fp16 GradScaler, given to DDP's GIFT unless options name one (FSDP2 takes none). Returns the
    state (GiftState or FsdpGiftState), whose EngagementCheck raises at the first optimizer step
    over the model's parameters if the engine never called GIFT. Collective: every rank calls
    it, after the engine wrapped the model and before the first backward. In a single process
    (nothing to reduce) it warns and returns None; any other model raises, naming its type."""
    model = getattr(model, "_orig_mod", model)         # torch.compile's OptimizedModule
    kind = type(model).__name__
    if kind in REFUSED:
        raise TypeError(f"GIFT: the model is a {kind}; {REFUSED[kind]}")
    if isinstance(model, DistributedDataParallel):
        if grad_scaler is not None and config is None:
            options.setdefault("grad_scaler", grad_scaler)
        state = GiftState(model, config=config, **options)
        try:
            model.register_comm_hook(state, gift_hook)
        except RuntimeError as error:       # DDP takes one hook, and says so in its own words
            raise RuntimeError("GIFT: this DistributedDataParallel model already has a comm "
                               "hook (a trainer's own: fp16, bf16, PowerSGD ...); GIFT replaces "
                               "it: remove that option") from error
    elif any(isinstance(m, FSDPModule) for m in model.modules()):
        state = attach(model, config, **options)
    elif not dist.is_initialized() or dist.get_world_size() == 1:
        logger.warning("GIFT: one process, nothing to reduce: training runs without GIFT")
        return None
    else:
        raise TypeError(f"GIFT: the model is a {kind} on {dist.get_world_size()} ranks, neither "
                        "DistributedDataParallel nor fully_shard'ed: GIFT cannot reduce its "
                        "gradients (wrap it first, or install GIFT after the trainer has)")
    state.engagement = EngagementCheck(state, model.parameters())
    return state


class EngagementCheck:
    """At the end of the first optimizer step over the model's parameters with a gradient (any
    optimizer's: a global post-step hook, removed then), raise unless GIFT has handled a
    gradient in this process: an engine that dropped GIFT's hook would otherwise train in fp32
    without a word.
    Trainers skip optimizer.step on gradient accumulation's micro-steps and on a GradScaler's
    overflow, so a step here always had a synchronized backward before it."""

    def __init__(self, state, params):
        # weak references: the hook is global and must neither keep a model alive nor mistake
        # a later model's parameters (at a freed one's address) for this one's
        self.state = weakref.ref(state)
        self.params = {id(p): weakref.ref(p) for p in params}
        self.handle = register_optimizer_step_post_hook(self)
        weakref.finalize(state, self.handle.remove)

    def holds(self, param):
        ref = self.params.get(id(param))
        return ref is not None and ref() is param

    def __call__(self, optimizer, args, kwargs):
        state = self.state()
        mine = [p for group in optimizer.param_groups for p in group["params"] if self.holds(p)]
        # a step over zero gradients is not training's: torch.distributed.checkpoint steps once
        # so to build an optimizer's state before loading it
        if state is None or not any(_nonzero(p.grad) for p in mine):
            return
        self.handle.remove()
        if state.telemetry.counters["elements"] == 0:
            raise RuntimeError(f"GIFT was installed, but {type(optimizer).__name__} stepped "
                               "before the engine called GIFT once: the gradients were reduced "
                               "without it (did the trainer replace the model or its hook?)")


def _nonzero(grad):
    """Whether this rank holds a non-zero part of grad (its shard, for a DTensor): no
    collective, one host sync."""
    if grad is None:
        return False
    return bool((grad.to_local() if hasattr(grad, "to_local") else grad).any())


class RankFiles:
    """Each rank's GIFT state_dict in a file of its own in a checkpoint's folder (as the
    transformers Trainer keeps each rank's RNG state): gift-rank{rank}.pt."""

    def __init__(self, state):
        self.state = state

    @staticmethod
    def path(folder, rank=None):
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        return os.path.join(folder, f"gift-rank{rank}.pt")

    def save(self, folder):
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), self.path(folder))

    def load(self, folder):
        """Load this rank's file from folder. A rank the saving job did not have takes rank 0's:
        its shared part (statistics, factors, step) the same on every rank, its residuals
        restarting at zero (GIFT warns). Without any file, warn: GIFT restarts its statistics
        and residuals (training goes on, not bit for bit)."""
        path = self.path(folder)
        if not os.path.exists(path):
            path = self.path(folder, rank=0)
        if not os.path.exists(path):
            logger.warning("GIFT: no %s in %s; GIFT's statistics and error-feedback residuals "
                           "restart from zero", os.path.basename(self.path(folder)), folder)
            return
        self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
