"""GIFT: a horovod.torch Compressor that sends gradients as FP8 or NVFP4.

    compression = gift.GIFT(model, format="nvfp4", transform="auto", error_feedback=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)

Per step and parameter g (Horovod calls compress(g) when g is ready, decompress(out, ctx) in
synchronize()):
    u = T(g)                  T: K-FAC input whitening for linear weights, randomized Hadamard
                              rotation, both, or neither (see TRANSFORMS)
    sum or avg(u) over ranks  quantized reduce-scatter + allgather of buckets (collective.py),
                              with error feedback on both quantization stages
    g_avg = T^{-1}(avg(u))    identical bytes, scales and T on every rank: bit-identical result
compress returns a one-element placeholder for Horovod's own allreduce and launches the bucket's
first stage once all its members are in; each later compress moves every bucket whose collective
has arrived to its next stage (reduce/pipeline.py: stage 2 and decoding inside backward, never
waiting; Horovod matches collectives by name, so the order may differ across ranks), and the
first decompress of a step starts the rest's second stages. Tensors under `min_elements`, sparse
gradients and steps in which a rank has called hvd.join() take Horovod's own fp32 reduction.
The state and step logic are the engine-neutral core's (core/gift_core.py, core/reducer.py).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from ..config import GiftConfig, with_options
from ..core.gift_core import (
    GiftCore,
    StepState,
    is_nonfinite,
    nonfinite_error,
    sparse_gradient_parameters,
)
from ..hvd import internals as internals
from .comm import HorovodCommunicator, horovod_topology

HOROVOD_DTYPES = (torch.float16, torch.float32, torch.float64)


@dataclass
class HorovodStep(StepState):
    """The step in flight, as Horovod hands it over."""
    outstanding: int = 0                  # tensors handed to Horovod and not yet decompressed
    sent: set = field(default_factory=set)           # names of the parameters compressed
    joined: bool = False                  # a rank is in hvd.join(): every tensor goes fp32
    plain: bool = False                   # every tensor takes Horovod's fp32 path (join, warm-up)
    shapes: dict = field(default_factory=dict)       # name -> (shape, dtype) of the gradient


class GIFT(GiftCore, Compressor):
    """The Horovod frontend of GIFT (see the module docstring); every option but process_set is
    a GiftConfig field (config.py documents each, with the measurements behind the advice).

    process_set: None (the default) takes the process set of the Horovod optimizer that uses this
    compressor; a set given here must be that optimizer's, or every rank raises at the first step.
    topology: "two-hop" needs Horovod process sets for the nodes: GIFT adds them when Horovod was
    started with hvd.init(process_sets="dynamic"); under "auto" a warning says why it takes the
    flat reduction when only the process sets are missing. node_size: None takes Horovod's local
    size. Warm-up steps (start_step) take Horovod's fp32 path.
    """
    step_kind = HorovodStep

    @with_options()
    def __init__(self, model: torch.nn.Module, *, process_set: Optional[hvd.ProcessSet] = None,
                 config: Optional[GiftConfig] = None, **options) -> None:
        if not hvd.is_initialized():
            raise RuntimeError("GIFT: call hvd.init() before creating GIFT(model, ...)")
        self.requested_process_set = process_set
        self.process_set = process_set or hvd.global_process_set
        super().__init__(model, HorovodCommunicator(self.process_set), config,
                         uncompressed=sparse_gradient_parameters(model), **options)
        # with no process set given, chosen for the optimizer's set at the first step: only its
        # ranks may be making this GIFT
        if process_set is not None:
            self.choose_topology(lambda: horovod_topology(
                self.config.topology, self.config.node_size, process_set))
        self._optimizer = None          # weak reference to the Horovod optimizer served
        # Parameters frozen now and trained later take an fp32 path: buckets must not wait for them.
        self.unhooked = internals.UnhookedParameters(self.params, self.config.verbose)
        self.grad_names = internals.GradientNames(self.params)
        internals.refuse_other_optimizers(self, GIFT)
        weakref.finalize(self, self.statistics.remove_hooks)

    # ---------------------------------------------------------------- Horovod's interface
    def compress(self, tensor=None):
        _check_instance(self)
        optimizer, hooked = internals.calling_optimizer(self)
        self._bind(optimizer)
        with self.telemetry.timed("compress"):
            return self._compress(tensor, hooked)

    def decompress(self, tensor=None, ctx=None):
        _check_instance(self)
        if ctx is None:     # a sparse gradient: Horovod reduced it itself, compress never saw it
            return tensor
        with self.telemetry.timed("decompress"):
            return self._decompress(tensor, ctx)

    def _bind(self, optimizer):
        """Take the process set and op of the Horovod optimizer calling compress, the first time;
        refuse what GIFT cannot honour. Every rank of the set raises the same error, before any
        collective of GIFT's, so none waits for the others."""
        if optimizer is None or (self._optimizer is not None and self._optimizer() is optimizer):
            return
        serving = (self.process_set, self.reducer.average) if self._optimizer is not None else None
        internals.check_optimizer(optimizer, self.requested_process_set, serving)
        self.process_set = optimizer.process_set
        self.set_comm(HorovodCommunicator(self.process_set))
        if (self.reducer.topology is None or self.reducer.topology.comm.process_set.process_set_id
                != self.process_set.process_set_id):
            self.reducer.topology = horovod_topology(self.config.topology,
                                                     self.config.node_size, self.process_set)
        self.reducer.average = optimizer.op == hvd.Average
        self._optimizer = weakref.ref(optimizer)

    def _compress(self, tensor, hooked):
        name = self.grad_names(tensor, hooked)
        if not self.current.in_step:
            self._begin_step(tensor.device)
        self.current.outstanding += 1
        self.current.sent.add(name)
        self.telemetry.add(elements=tensor.numel())
        if self.current.plain or name not in self.reducer.bucket_of:
            self.telemetry.add(uncompressed_elements=tensor.numel(),
                               payload_bytes=4 * tensor.numel())
            plain = tensor if tensor.dtype in HOROVOD_DTYPES else tensor.to(torch.float32)
            self.current.pipeline.progress()
            return plain, ("plain", name, tensor.dtype)
        self.current.shapes[name] = (tensor.shape, tensor.dtype)
        complete = self.reducer.take(self.current, name, tensor)
        if complete is not None:
            self.reducer.start(self.current, complete, self.step)
        self.current.pipeline.progress()
        # on the gradient's device: Horovod's grouped allreduce (groups=) wants one device a group
        return torch.zeros(1, device=tensor.device), ("gift", name, tensor.dtype)

    def _decompress(self, tensor, ctx):
        kind, name, dtype = ctx
        if kind == "plain":
            result = tensor.to(dtype)
        else:
            self._second_stage()
            shape, dtype = self.current.shapes[name]
            u = self.current.pipeline.finish(self.reducer.bucket_of[name]).pop(name)
            result = self.reducer.result(name, u, shape, dtype)
        if is_nonfinite(self.config, result):    # the same bytes on every rank: every rank raises
            self.abandon_step()
            raise nonfinite_error(name)
        self.current.outstanding -= 1
        if self.current.outstanding == 0:
            self._end_step()
        return result

    # ---------------------------------------------------------------- one step
    def _begin_step(self, device):
        self.current.in_step = True
        t0 = time.perf_counter()
        everyone, largest_step = internals.roll_call(self.comm, self.step, device)
        self.telemetry.add(wait_seconds=time.perf_counter() - t0)   # for the slowest rank
        self.current.joined = not everyone
        if self.current.joined:     # every tensor takes Horovod's fp32 path; nothing else runs
            self.telemetry.add(joined_steps=1)
            self.current.plain = True
            self.apply_loaded()
            self.statistics.advance()
            return
        self.current.plain = not self.begin_step(largest_step)

    def _second_stage(self):
        pipeline = self.current.pipeline
        if pipeline.exchanged:
            return
        # buckets with members Horovod never sent
        self.reducer.start_the_rest(self.current, self.step)
        pipeline.exchange_all()
        self.plan.start_vote()

    def _end_step(self):
        reduced = self.unhooked.average(self.current.sent, self.reducer.average, self.process_set)
        nonfinite = next((name for name, g in reduced if is_nonfinite(self.config, g)), None)
        self.end_step(voted=not self.current.joined)
        if nonfinite is not None:   # the step ended on every rank alike: every rank raises
            raise nonfinite_error(nonfinite)

    def reset_rank_state(self) -> None:
        """GiftCore's; the Horovod optimizer is bound again at the next step."""
        super().reset_rank_state()
        self._optimizer = None


def _check_instance(obj):
    # Horovod calls compression.compress(grad): with the class itself, grad lands in `self`
    if not isinstance(obj, GIFT):
        raise TypeError("compression=GIFT passes the class; pass an instance made for your model: "
                        "compression=gift.GIFT(model, format='nvfp4')")
