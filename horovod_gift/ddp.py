"""GIFT as a PyTorch DDP communication hook.

    from horovod_gift.ddp import GiftState, gift_hook
    model = DistributedDataParallel(model)
    model.register_comm_hook(GiftState(model, format="nvfp4"), gift_hook)

DDP calls gift_hook(state, bucket) for each of its gradient buckets as backward fills them, in
the same order on every rank, and waits for the returned futures at the end of backward. GIFT
keeps buckets of its own (core.reducer.BucketReducer: the same on every rank, whatever DDP's
buckets are and however DDP rebuilds them after the first step): a GIFT bucket's reduction starts
once DDP has handed over all its members. torch.distributed matches collectives by call order, so
the reductions advance by a fixed rule rather than by what has arrived: at each hook, every
reduction started at an earlier hook moves one stage on (its stage-2 allgather is issued a hook
after its alltoall, decoded a hook after that), and the last bucket's hook finishes the rest.
A DDP bucket's future is set once every GIFT bucket holding its parameters is decoded; the
results are written over the bucket's buffer. Parameters under `min_elements` are averaged in
fp32 by one allreduce per DDP bucket in the same hook.

Under DDP's join() a rank that ran out of data replays the hook on zero buckets: it runs the
same collectives, contributing zeros (and what its residuals still owe); the average stays over
every rank, as DDP's own with divide_by_initial_world_size=True. no_sync() accumulates
gradients locally: the hook runs on the synchronized backward only.
"""
import weakref
from dataclasses import dataclass, field
from typing import Optional, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .config import GiftConfig, with_options
from .core.gift_core import (
    GiftCore,
    StepState,
    is_nonfinite,
    nonfinite_error,
    sparse_gradient_parameters,
)
from .reduce.collective import Fp32Reduction
from .torch_comm import TorchCommunicator, torch_topology


@dataclass
class _Bucket:
    """A DDP bucket handed to the hook this step, until its future is set."""
    future: torch.futures.Future
    buffer: torch.Tensor
    compressed: list              # (name, the gradient's view in the buffer)
    small: list                   # (name, view) averaged in fp32
    small_reduction: object = None      # an Fp32Reduction of the small ones


@dataclass
class DdpStep(StepState):
    """The step in flight, as DDP's hooks hand it over."""
    compressing: bool = False
    started_at: dict = field(default_factory=dict)  # GIFT bucket -> hook count when started
    hooks: int = 0
    waiting: list = field(default_factory=list)    # _Buckets whose future is not set yet
    nonfinite: list = field(default_factory=list)  # names whose average is not finite


class GiftState(GiftCore):
    """The state of gift_hook for one DDP model: GIFT's core, whose options are GiftConfig's
    fields (config.py: format, transform, error_feedback, residual_dtype, start_step, ...).

    model: the DistributedDataParallel module (or the module it wraps); parameter names and
    checkpoints are those of the wrapped module, so a GIFT state_dict() moves between Horovod
    and DDP jobs of the same model. process_group: the DDP model's by default. Warm-up steps
    (start_step) run DDP's own allreduce on the bucket, bit for bit as without a hook.
    nonfinite="raise": a non-finite average raises from backward on every rank once the step's
    collectives are done (the next step is unaffected); DDP re-raises the hook's
    FloatingPointError as a RuntimeError whose message holds GIFT's ("the averaged gradient of
    <name> is not finite").
    Made on every rank of the group, in the same order as the group's other collectives (with
    topology "auto" or "two-hop" it gathers the ranks' placement and may make node groups).
    """
    step_kind = DdpStep

    @with_options()
    def __init__(self, model: torch.nn.Module, *,
                 process_group: Optional[dist.ProcessGroup] = None,
                 config: Optional[GiftConfig] = None, **options) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GiftState: call torch.distributed.init_process_group() before "
                               "creating GiftState(model, ...)")
        wrapped = isinstance(model, DistributedDataParallel)
        # nn.Module's __getattr__ types DDP's attributes as Tensor | Module
        module = cast(torch.nn.Module, model.module) if wrapped else model
        if process_group is None and wrapped:
            process_group = cast(dist.ProcessGroup, model.process_group)
        sparse = sparse_gradient_parameters(module)
        if sparse:
            raise ValueError(f"GiftState: {', '.join(sorted(sparse))} has sparse gradients, "
                             "which a DDP communication hook cannot take; make the embedding "
                             "with sparse=False")
        self.process_group = process_group
        # where metadata travels under NCCL: the gradients' GPU, not whichever is current
        self.device = next(p.device for p in module.parameters())
        ignored = set(getattr(model, "parameters_to_ignore", ()))    # DDP never reduces them
        super().__init__(module, TorchCommunicator(process_group, self.device), config,
                         uncompressed=ignored, **options)
        self.choose_topology(self._topology)
        self.name_of = {id(p): n for n, p in self.params.items()}
        # DDP reduces the parameters that train when it wraps the model, and never another
        self.frozen_at_wrap = [n for n, p in self.params.items()
                               if not p.requires_grad and n not in ignored]
        weakref.finalize(self, self.statistics.remove_hooks)

    def _topology(self):
        return torch_topology(self.config.topology, self.config.node_size, self.process_group,
                              self.device)

    def reset_rank_state(self) -> None:
        """GiftCore's (call it on every rank when the number of ranks changes), and the
        nodes chosen again now: collective over the group."""
        super().reset_rank_state()
        self.set_comm(TorchCommunicator(self.process_group, self.device))
        self.reducer.topology = self._topology()

    # ---------------------------------------------------------------- the hook
    def hook(self, bucket):
        with self.telemetry.timed("ddp_hook"):
            return self._hook(bucket)

    def _hook(self, bucket):
        step = self.current
        if not step.in_step:
            self._refuse_unfrozen()
            step.compressing = self.begin_step()    # raises on every rank, or on none
            step.in_step = True
        step.hooks += 1
        buffer = bucket.buffer()
        self.telemetry.add(elements=buffer.numel())
        if not step.compressing:    # warm-up: DDP's own allreduce of the bucket
            self.telemetry.add(uncompressed_elements=buffer.numel(),
                               payload_bytes=buffer.element_size() * buffer.numel())
            buffer.mul_(1.0 / self.comm.size)       # as DDP's own reducer scales a bucket
            future = dist.all_reduce(buffer, group=self.process_group,
                                     async_op=True).get_future().then(lambda f: f.value()[0])
            if bucket.is_last():
                self.end_step()
            return future
        entry = self._take(bucket)
        self._advance_earlier()
        for gift_bucket in sorted({self.reducer.bucket_of[n] for n, _ in entry.compressed}):
            names = self.reducer.buckets[gift_bucket]
            if all(n in step.u for n in names):
                self._start(gift_bucket)
        step.waiting.append(entry)
        self._resolve()
        if bucket.is_last():
            error = self._finish_step()
            if error is not None:   # DDP raises it from backward, where it waits for the futures
                failed = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
                failed.set_exception(error)
                return failed
        return entry.future

    def _refuse_unfrozen(self):
        """A parameter frozen when DDP wrapped the model and trained now would keep each rank's
        own gradient (DDP never reduces it): raise, naming it, before this step's collectives."""
        unfrozen = [n for n in self.frozen_at_wrap if self.params[n].requires_grad]
        if unfrozen:
            raise ValueError(f"GiftState: {', '.join(unfrozen)} trains now but was frozen when "
                             "DDP wrapped the model: DDP never reduces its gradient, which would "
                             "differ across ranks; wrap the model in DDP (and make GiftState) "
                             "after unfreezing it")

    def _take(self, bucket):
        """Transform this DDP bucket's compressed gradients (over the buffer) and start the fp32
        allreduce of its small ones."""
        buffer = bucket.buffer()
        # on CUDA the future records the current stream, which DDP's wait then waits for
        future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        entry = _Bucket(future, buffer, [], [])
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            name = self.name_of.get(id(p))
            if name is None:
                raise ValueError("gift_hook: DDP reduces a parameter the model given to "
                                 "GiftState(model) does not have; pass the DDP model itself")
            compressed = name in self.reducer.bucket_of
            (entry.compressed if compressed else entry.small).append((name, grad))
        if entry.small:
            flat = torch.cat([g.reshape(-1).to(torch.float32) for _, g in entry.small])
            entry.small_reduction = Fp32Reduction("gift.small", flat, self.comm,
                                                  self.comm.size).start()
            self.telemetry.add(uncompressed_elements=flat.numel(), payload_bytes=4 * flat.numel())
        for name, grad in entry.compressed:
            self.reducer.take(self.current, name, grad)
        return entry

    def _start(self, bucket):
        self.reducer.start(self.current, bucket, self.step)
        self.current.started_at[bucket] = self.current.hooks

    def _advance_earlier(self):
        """Every reduction started at an earlier hook and not finished moves one stage on, in
        bucket order, then the fp32 ones of earlier DDP buckets: the same collectives in the
        same order on every rank."""
        step = self.current
        for bucket in sorted(step.pipeline.in_flight):
            if step.started_at[bucket] < step.hooks:
                step.pipeline.advance(bucket)
        for entry in step.waiting:      # DDP buckets of earlier hooks
            if entry.small_reduction is not None and entry.small_reduction.stage == 1:
                entry.small_reduction.exchange()

    def _resolve(self, everything=False):
        """Set the future of every waiting DDP bucket whose GIFT buckets are decoded (all of
        them with everything=True: the step's last hook)."""
        step = self.current
        for entry in list(step.waiting):
            buckets = {self.reducer.bucket_of[n] for n, _ in entry.compressed}
            small_sent = entry.small_reduction is None or entry.small_reduction.stage == 2
            if not everything and (not small_sent
                                   or any(b not in step.pipeline.results for b in buckets)):
                continue
            for name, grad in entry.compressed:
                u = step.pipeline.finish(self.reducer.bucket_of[name]).pop(name)
                result = self.reducer.result(name, u, grad.shape, grad.dtype)
                grad.copy_(result)
                self._note_finite(name, result)
            if entry.small:
                reduced = entry.small_reduction.finish()
                offset = 0
                for name, grad in entry.small:
                    part = reduced[offset:offset + grad.numel()]
                    grad.copy_(part.view(grad.shape))
                    self._note_finite(name, part)
                    offset += grad.numel()
            step.waiting.remove(entry)
            entry.future.set_result(entry.buffer)

    def _note_finite(self, name, result):
        if is_nonfinite(self.config, result):
            self.current.nonfinite.append(name)

    def _finish_step(self):
        """The last bucket's hook: start what never started (members DDP did not hand over take
        zeros), move every reduction to its end in bucket order, set every future. Returns the
        FloatingPointError of a non-finite average under nonfinite="raise", else None."""
        step = self.current
        self.reducer.start_the_rest(self.current, self.step)
        for bucket in sorted(step.pipeline.in_flight):
            while bucket in step.pipeline.in_flight:
                step.pipeline.advance(bucket)
        self.plan.start_vote()
        self._resolve(everything=True)
        nonfinite = step.nonfinite
        self.end_step()
        return nonfinite_error(nonfinite[0]) if nonfinite else None


# evaluated annotations (no `from __future__ import annotations` here): DDP's
# register_comm_hook compares them with dist.GradBucket and Future[Tensor], and refuses others
def gift_hook(state: "GiftState",
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: register it with model.register_comm_hook(GiftState(model),
    gift_hook). Returns the future of the bucket's averaged gradients."""
    if not isinstance(state, GiftState):
        raise TypeError("gift_hook: register it with the state made for the model: "
                        "model.register_comm_hook(GiftState(model, ...), gift_hook)")
    return state.hook(bucket)
