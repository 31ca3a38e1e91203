"""GIFT's engine-neutral core: the state and step logic every frontend shares.

A frontend (hvd.compressor.GIFT for Horovod, ddp.GiftState for a DDP communication hook)
makes a GiftCore over a Communicator (reduce/communicator.py), sets the Topology its reducer
reduces over (reduce/topology.py; choose_topology), and per step:
    begin_step()                     first gradient of a step: rank check, warm-up, whitening
                                     refresh
    reducer.take(current, n, g)      u = T(g) with error feedback folded in where it can be;
                                     the bucket when it was the last member missing
    reducer.start(current, b, step)  the bucket's quantized reduction
    reducer.result(n, u, ...)        T^-1 of the reduced u, in the gradient's shape and dtype
    end_step()                       scrub non-finite residuals, the "auto" vote, step += 1, a
                                     new step state (abandon_step(): a step that raised midway,
                                     not counted)
The reductions of a step live in a StagePipeline (reduce/pipeline.py); when each moves to its next
stage is the frontend's choice (Horovod matches collectives by name, torch.distributed by call
order). The reducer (reducer.py, as DDP's Reducer buckets DDP's gradients) holds the buckets and
the error-feedback residuals; this class, the step's life and checkpoints.
"""
from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from horovod_gift.kernels.hadamard import LANES

from ..codec.rotation import HadamardRotation
from ..config import REFRESH_EVERY, STAT_WINDOW, GiftConfig  # noqa: F401 (benchmarks read them)
from ..geometry.linear_layers import linear_readers
from ..geometry.transforms import WHITENING_TRANSFORMS, TransformPlan
from ..kernels.native import CompileCount
from .reducer import BucketReducer
from .state_base import GiftStateBase, fingerprint


@dataclass
class StepState:
    """What GIFT knows about the step in flight; a frontend starts a new one each step (a
    subclass of it adds what its engine needs)."""
    in_step: bool = False                 # the step's first gradient has arrived
    pipeline: object = None               # the step's bucket reductions (a StagePipeline)
    u: dict = field(default_factory=dict)            # name -> transformed flat gradient
    maxima: dict = field(default_factory=dict)       # name -> its pieces' amax bits, if folded


def is_nonfinite(config, average):
    """Under nonfinite="raise", whether an averaged gradient (the same bytes on every rank) must
    raise."""
    return config.nonfinite == "raise" and not bool(torch.isfinite(average).all())


def nonfinite_error(name):
    return FloatingPointError(f"GIFT: the averaged gradient of {name} is not finite "
                              "(a rank's gradient held NaN or Inf)")


class GiftCore(GiftStateBase):
    """The state of the low-precision gradient exchange for one model and its step's life (the
    module docstring); every option is a GiftConfig field (config.py says what each does and
    the measurements behind its default), read as self.config.<field>."""
    step_kind = StepState       # what reset_step makes; a frontend's subclass adds its engine's

    def __init__(self, model, comm, config=None, uncompressed=(), **options):
        """comm: the Communicator of the ranks that reduce; config: a GiftConfig (None: the
        defaults), options: fields of it to replace; uncompressed: names of parameters the
        engine reduces itself (no bucket may wait for them)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"GIFT: expected the torch.nn.Module being trained, "
                            f"got {type(model).__name__}")
        config = GiftConfig.of(config, GiftConfig, options)
        config.refuse_param_format("GIFT")
        params = list(model.named_parameters())
        trainable = [(n, p) for n, p in params if p.requires_grad]
        if not trainable:
            raise ValueError("GIFT: the model has no trainable parameters")
        compressed = [n for n, p in reversed(trainable)           # backward order
                      if p.numel() >= config.min_elements and n not in uncompressed]
        # only tensors that are compressed can be whitened
        whitenable = ({n: dict(params)[n] for n in compressed}
                      if config.transform in WHITENING_TRANSFORMS else {})
        super().__init__(model, config, whitenable, comm)
        # the linear layers found, whatever the transform: ranks must agree on them
        self.linear_layers = sorted(
            (name, [(module_name, layout.layout) for module_name, _, layout in modules])
            for name, modules in linear_readers(model, self.params).items())
        self.plan = TransformPlan(self.params, config.transform, self.statistics,
                                  HadamardRotation(config.hadamard_block, config.seed))
        self.reducer = BucketReducer(self.params, compressed, config, self.codec, self.plan,
                                     self.telemetry)
        self.own = self.reducer         # its residuals are this rank's own state
        self._compiles_seen = CompileCount.count
        self.current = None             # the step in flight (a step_kind)
        self.reset_step()

    def choose_topology(self, make):
        """The reducer's topology = make(); if it raises (a topology the job cannot have), the
        statistics' hooks leave the model first, as if this GIFT had never been made."""
        try:
            self.reducer.topology = make()
        except Exception:
            self.statistics.remove_hooks()
            raise

    # ---------------------------------------------------------------- one step
    def reset_step(self):
        """A new step state (the frontend's step_kind) for the next step: after a step ends or
        is abandoned, and after a checkpoint loads."""
        self.current = self.step_kind(pipeline=self.reducer.new_pipeline())

    def abandon_step(self):
        """A step that raised midway (every rank raises alike): residuals it made non-finite
        scrubbed, and a fresh step state; the step is not counted."""
        self.reducer.scrub(self.current.pipeline)
        self.reset_step()

    def begin_step(self, largest_step=None):
        """At a step's first gradient, on every rank: whether this step compresses (False during
        the warm-up). Collective at the first step (the ranks' configurations) and on refresh
        steps. largest_step: the largest step count among the ranks, where the engine learns it
        (ranks back from hvd.join() take it)."""
        if not self.settle_ranks() and largest_step is not None:
            self.step = largest_step    # a mismatch before the first check is that check's error
        # warm-up: the engine's fp32 path, while the statistics gather (the factors are ready when
        # compression starts, and the residuals start at zero then)
        compressing = self.step >= self.config.start_step
        self.telemetry.add(warmup_steps=int(not compressing))
        if self.config.grad_scaler is not None:
            self.reducer.follow_scale(float(self.config.grad_scaler.get_scale()))
        # "auto" judges the candidates on refresh steps (factors from earlier batches only, as on
        # the steps that follow); step 0 has no earlier batch
        self.plan.begin_step(evaluating=compressing and self.step >= 1
                             and self.statistics.due(self.step))
        self.refresh_statistics()
        return compressing

    def _refresh(self):
        self.reducer.change_transforms(lambda: {
            name: functools.partial(self.plan.inverse, name, factors=old_factors)
            for name, old_factors in self.statistics.refresh().items()})

    def end_step(self, voted=True):
        """After every result of the step was read, on every rank: residuals made non-finite
        scrubbed, the "auto" vote applied (voted: it was started, plan.start_vote), the step
        counted, and a fresh step state."""
        self.reducer.scrub(self.current.pipeline)
        if self.plan.evaluating and voted:
            with record_function("horovod_gift.vote"):
                self.reducer.change_transforms(self.plan.finish_vote)
        self.count_step()
        self.plan.end_step()
        # A step in which numba compiled a kernel (the first, a refresh step's first round trips)
        # leaves its frames in a reference cycle with every gradient they held (native.py's
        # CompileCount): without a collection here they lived on into later steps, up to 1x the
        # parameters' bytes, until Python's cycle collector happened to run.
        if CompileCount.count != self._compiles_seen:
            self._compiles_seen = CompileCount.count
            gc.collect()
        self.reset_step()

    def _transform_counts(self):
        return self.plan.counts(self.reducer.bucket_of)

    # ---------------------------------------------------------------- what it says of itself
    def describe(self):
        reducer = self.reducer
        block = f" (block {self.codec.block_size})" if self.codec.block_size else ""
        plans = ", ".join(f"{v} tensors {k}" for k, v in sorted(self._transform_counts().items()))
        linear = (self.statistics.describe(self.params, reducer.bucket_of) + "; "
                  if self.config.transform in WHITENING_TRANSFORMS else "")
        topology = (reducer.topology.describe() if reducer.topology
                    else "topology at the first step")
        return (f"GIFT {self.codec.format}{block}, transform={self.config.transform}: {plans}; "
                f"{linear}{len(reducer.buckets)} buckets, {topology}; "
                f"tensors under {self.config.min_elements} elements go fp32")

    # ---------------------------------------------------------------- checks and checkpoints
    def agreed(self):
        # the rotation's layout too: saved residuals live in the rotated space, and ranks must
        # agree on it
        shapes = [(n, tuple(p.shape)) for n, p in self.params.items()]
        return dict(super().agreed(), hadamard_block=self.plan.rotation.block_size,
                    hadamard_interleave=LANES, nonfinite=self.config.nonfinite,
                    start_step=self.config.start_step,
                    model=fingerprint((self.reducer.buckets, shapes)),
                    linear=fingerprint(self.linear_layers))

    def state_dict(self, rank_state: bool = True) -> dict:
        """GiftStateBase's, and the transforms' choices (the "auto" vote's)."""
        return dict(super().state_dict(rank_state), plan=self.plan.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """The shared part now; the per-rank part if this rank saved it in a job of this size
        (now, or at the first step once the process set is known), else the residuals restart
        at zero with one warning."""
        super().load_state_dict(state)
        self.plan.load_state_dict(state["plan"])
        if self.reducer.topology is not None:
            self.apply_loaded()
        self.reset_step()

    def reset_rank_state(self) -> None:
        """Forget what belongs to this rank in this job (error-feedback residuals, statistics
        histories, the GradScaler scale they are in) and check the ranks agree at the next step:
        call it on every rank when the number of ranks changes (hvd.elastic's on_state_reset).
        The nodes and their process sets are chosen again at the next step."""
        self._forget_rank_state()
        self.reducer.topology = None


def sparse_gradient_parameters(model):
    """Names of the weights of embeddings made with sparse=True (their gradients are sparse: no
    bucket may wait for them)."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            names.add(f"{module_name}.weight" if module_name else "weight")
    return names
