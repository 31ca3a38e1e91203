"""GIFT's engine-neutral core: the state and step logic every frontend shares.

A frontend (hvd.compressor.GIFT for Horovod, ddp.GiftState for a DDP communication hook)
makes a GiftCore over a Communicator (reduce/communicator.py) and a Topology
(reduce/topology.py), and per step:
    begin_step()            first gradient of a step: rank check, warm-up, whitening refresh
    transformed(name, g)    u = T(g) with error feedback folded in where it can be
    start(bucket)           the bucket's quantized reduction, once all its members are in
    result(name)            T^-1 of the reduced u, in the gradient's shape and dtype
    end_step()              scrub non-finite residuals, the "auto" vote, step += 1, a new step
                            state (abandon_step(): a step that raised midway, not counted)
The reductions of a step live in a StagePipeline (reduce/pipeline.py); when each moves to its next
stage is the frontend's choice (Horovod matches collectives by name, torch.distributed by call
order).
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
from ..reduce.collective import fill_buckets
from ..reduce.feedback import ErrorFeedback, scrub
from ..reduce.pipeline import StagePipeline
from ..reduce.topology import owned_pieces
from .state_base import GiftStateBase, fingerprint


@dataclass
class StepState:
    """What GIFT knows about the step in flight; a frontend starts a new one each step (a
    subclass of it adds what its engine needs)."""
    in_step: bool = False                 # the step's first gradient has arrived
    pipeline: object = None               # the step's bucket reductions (a StagePipeline)
    u: dict = field(default_factory=dict)            # name -> transformed flat gradient
    maxima: dict = field(default_factory=dict)       # name -> its pieces' amax bits, if folded


class GiftCore(GiftStateBase):
    """The state of the low-precision gradient exchange for one model and its step logic (the
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
        self.topology = None            # the frontend's Topology, chosen before the first step
        self.average = True             # a sum when False
        # the linear layers found, whatever the transform: ranks must agree on them
        self.linear_layers = sorted(
            (name, [(module_name, layout.layout) for module_name, _, layout in modules])
            for name, modules in linear_readers(model, self.params).items())
        self.plan = TransformPlan(self.params, config.transform, self.statistics,
                                  HadamardRotation(config.hadamard_block, config.seed))
        self.buckets = fill_buckets(compressed, {n: self.params[n].numel() for n in compressed},
                                    config.bucket_elements)
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self.feedback = (ErrorFeedback(self.params, self.buckets, self.codec.align,
                                       config.residual_dtype) if config.error_feedback else None)
        self._scale = None              # the GradScaler's scale the residuals are in
        self._compiles_seen = CompileCount.count
        self.current = None             # the step in flight (a step_kind)
        self.reset_step()

    def choose_topology(self, make):
        """self.topology = make(); if it raises (a topology the job cannot have), the statistics'
        hooks leave the model first, as if this GIFT had never been made."""
        try:
            self.topology = make()
        except Exception:
            self.statistics.remove_hooks()
            raise

    # ---------------------------------------------------------------- one step
    def new_pipeline(self):
        return StagePipeline(self.buckets, self.telemetry)

    def reset_step(self):
        """A new step state (the frontend's step_kind) for the next step: after a step ends or
        is abandoned, and after a checkpoint loads."""
        self.current = self.step_kind(pipeline=self.new_pipeline())

    def abandon_step(self):
        """A step that raised midway (every rank raises alike): residuals it made non-finite
        scrubbed, and a fresh step state; the step is not counted."""
        self.scrub(self.current.pipeline)
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
        self._follow_grad_scaler()
        # "auto" judges the candidates on refresh steps (factors from earlier batches only, as on
        # the steps that follow); step 0 has no earlier batch
        self.plan.begin_step(evaluating=compressing and self.step >= 1
                             and self.statistics.due(self.step))
        self.refresh_statistics()
        return compressing

    def _refresh(self):
        self._change_transforms(lambda: {
            name: functools.partial(self.plan.inverse, name, factors=old_factors)
            for name, old_factors in self.statistics.refresh().items()})

    def _follow_grad_scaler(self):
        """The residuals hold gradients in the GradScaler's units: when its scale changes (growth,
        or backoff after a step it skipped), rescale them with it. Every rank reads the same
        scale: the scaler judges the averaged gradients, identical on every rank."""
        if self.config.grad_scaler is None:
            return
        scale = float(self.config.grad_scaler.get_scale())
        if self.feedback and self._scale is not None and scale != self._scale:
            self.feedback.rescale(scale / self._scale)
        self._scale = scale

    def transformed(self, name, g):
        """(u = T(g), flat fp32, over g's storage where it can be; its pieces' amax bits when the
        rotation folded r1 in, else None)."""
        self.plan.record(name, g, self.codec)
        if (self.feedback and self.feedback.dtype == torch.float32 and self.topology.folds
                and self.plan.folds(name, g)):
            return self.plan.forward_folded(
                name, g, *self.feedback.residual_pieces(name, self.comm.size))
        u = self.plan.forward(name, g, in_place=True)
        # an r1 with values outside this rank's part goes into the node's sum (reduce/two_hop.py)
        spread = self.feedback.take_spread(name) if self.feedback else None
        if spread is not None and not self.topology.folds:
            u.add_(spread)
            spread.zero_()
        return u, None

    def take(self, name, g):
        """g's transformed u into the step (self.current); starts its bucket if it was the
        last member missing."""
        step = self.current
        step.u[name], maxima = self.transformed(name, g)
        if maxima is not None:
            step.maxima[name] = maxima
        bucket = self.bucket_of[name]
        return bucket if all(n in step.u for n in self.buckets[bucket]) else None

    def start(self, bucket):
        """The bucket's reduction started in the step's pipeline (members the engine did not
        hand over this step take zeros)."""
        step = self.current
        names = self.buckets[bucket]
        flats = [step.u[n] if n in step.u else self.zeros(n) for n in names]
        step.pipeline.start(bucket, self.reduction(bucket, flats,
                                                   [step.maxima.get(n) for n in names]))

    def start_the_rest(self):
        """Every bucket with a member this step whose reduction never started (the engine did
        not hand over all of its members)."""
        for bucket, names in enumerate(self.buckets):
            if (bucket not in self.current.pipeline.reductions
                    and any(n in self.current.u for n in names)):
                self.start(bucket)

    def reduction(self, bucket, flats, maxima):
        """The bucket's quantized reduction (not started): flats, its members' u in bucket
        order (zeros for one not sent); maxima: their amax bits or None."""
        names = self.buckets[bucket]
        residual1 = residual2 = None
        if self.feedback:
            residual1 = self.feedback.first_stage(names)
            owned = self.topology.owned_pieces([f.numel() for f in flats], self.codec)
            residual2 = self.feedback.second_stage(bucket, sum(hi - lo for _, lo, hi in owned),
                                                   flats[0].device)
        self.telemetry.add(payload_bytes=sum(self.codec.payload_bytes(f.numel()) for f in flats))
        return self.topology.reduction(f"gift.b{bucket}", flats, self.codec, residual1,
                                       residual2, self.average, self.step, maxima, bucket)

    def zeros(self, name, dtype=torch.float32):
        """A flat zero tensor of a parameter's size on that parameter's device."""
        p = self.params[name]
        return torch.zeros(p.numel(), dtype=dtype, device=p.device)

    def result(self, name, u, shape, dtype):
        """The averaged gradient of name from its reduced u (overwritten)."""
        return self.plan.inverse(name, u, in_place=True).view(shape).to(dtype)

    def is_nonfinite(self, result):
        """Under nonfinite="raise", whether an averaged gradient (the same bytes on every rank)
        must raise."""
        return self.config.nonfinite == "raise" and not bool(torch.isfinite(result).all())

    @staticmethod
    def nonfinite_error(name):
        return FloatingPointError(f"GIFT: the averaged gradient of {name} is not finite "
                                  "(a rank's gradient held NaN or Inf)")

    def scrub(self, pipeline):
        """Residuals made non-finite by this step's gradients back to zero: one verdict for every
        bucket of the step (one host sync on a GPU), before the next step reads them."""
        if self.feedback:
            scrub(*pipeline.residuals())

    def end_step(self, voted=True):
        """After every result of the step was read, on every rank: residuals made non-finite
        scrubbed, the "auto" vote applied (voted: it was started, plan.start_vote), the step
        counted, and a fresh step state."""
        self.scrub(self.current.pipeline)
        if self.plan.evaluating and voted:
            with record_function("horovod_gift.vote"):
                self._change_transforms(self.plan.finish_vote)
        self.count_step()
        self.plan.end_step()
        self._collect_after_compiles()
        self.reset_step()

    def _transform_counts(self):
        return self.plan.counts(self.bucket_of)

    def _collect_after_compiles(self):
        """A step in which numba compiled a kernel (the first, a refresh step's first round
        trips) leaves its frames in a reference cycle with every gradient they held (native.py's
        CompileCount): without a collection here they lived on into later steps, up to 1x the
        parameters' bytes, until Python's cycle collector happened to run."""
        if CompileCount.count != self._compiles_seen:
            self._compiles_seen = CompileCount.count
            gc.collect()

    # ---------------------------------------------------------------- residuals
    def _change_transforms(self, change):
        """Run change() (new whitening factors, or new transform choices), which returns the old
        inverse map of each tensor it changed, and keep the residuals in step: stage 2 folded
        into stage 1 before (it lives in the old coordinates of a whole bucket), each changed
        tensor's stage 1 re-expressed in its new coordinates after."""
        if self.feedback:
            self.feedback.fold(functools.partial(self.topology.owned_pieces, codec=self.codec),
                               self.comm.size if self.average else 1)
        for name, old_inverse in change().items():
            if self.feedback:
                self.feedback.convert(name, old_inverse, functools.partial(self.plan.forward, name))


    # ---------------------------------------------------------------- what it says of itself
    def describe(self):
        counts = self.plan.counts(self.bucket_of)
        block = f" (block {self.codec.block_size})" if self.codec.block_size else ""
        plans = ", ".join(f"{v} tensors {k}" for k, v in sorted(counts.items()))
        linear = (self.statistics.describe(self.params, self.bucket_of) + "; "
                  if self.config.transform in WHITENING_TRANSFORMS else "")
        return (f"GIFT {self.codec.format}{block}, transform={self.config.transform}: {plans}; "
                f"{linear}{len(self.buckets)} buckets, "
                f"{self.topology.describe() if self.topology else 'topology at the first step'}; "
                f"tensors under {self.config.min_elements} elements go fp32")

    def _residual_tensors(self):
        return self.feedback.tensors() if self.feedback else []

    # ---------------------------------------------------------------- checks and checkpoints
    def topology_description(self):
        return self.topology.description

    def agreed(self):
        # the rotation's layout too: saved residuals live in the rotated space, and ranks must
        # agree on it
        shapes = [(n, tuple(p.shape)) for n, p in self.params.items()]
        return dict(super().agreed(), hadamard_block=self.plan.rotation.block_size,
                    hadamard_interleave=LANES, nonfinite=self.config.nonfinite,
                    start_step=self.config.start_step, model=fingerprint((self.buckets, shapes)),
                    linear=fingerprint(self.linear_layers))

    def shared_state(self):
        return dict(super().shared_state(), plan=self.plan.state_dict())

    def _rank_state(self):
        """Error-feedback residuals and statistics histories, 1 + 1/n elements per parameter
        element, with the rank and the number of ranks."""
        return {"rank": self.comm.rank, "ranks": self.comm.size,
                "feedback": (self.feedback.state_dict() if self.feedback
                             else ErrorFeedback.empty_state()),
                "statistics": self.statistics.local_state_dict(),
                "grad_scale": self._scale,          # the residuals' units
                # what r2 covers, and its scale when folded into r1 (None: no step yet, no r2)
                "topology": self.topology.description if self.topology else None,
                "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        """The shared part now; the per-rank part if this rank saved it in a job of this size
        (now, or at the first step once the process set is known), else the residuals restart
        at zero with one warning."""
        super().load_state_dict(state)
        self.plan.load_state_dict(state["plan"])
        if self.topology is not None:
            self.apply_loaded()
        self.reset_step()

    def _restore_rank_state(self, saved):
        n, me = self.comm.size, self.comm.rank
        self.statistics.load_local_state_dict(saved["statistics"])
        self._scale = saved["grad_scale"]
        if self.feedback:
            feedback, topology = saved["feedback"], saved.get("topology", ("flat",))
            if topology not in (None, self.topology.description):   # r2 covers other parts
                feedback = self.feedback.fold_saved(
                    feedback, lambda sizes: owned_pieces(topology, sizes, me, n, self.codec),
                    n if saved.get("average", True) else 1)
            self.feedback.load_state_dict(feedback,
                                          lambda k: self.params[self.buckets[k][0]].device)

    def reset_rank_state(self) -> None:
        """Forget what belongs to this rank in this job (error-feedback residuals, statistics
        histories, the GradScaler scale they are in) and check the ranks agree at the next step:
        call it on every rank when the number of ranks changes (hvd.elastic's on_state_reset).
        The nodes and their process sets are chosen again at the next step."""
        self._forget_rank_state()
        self.topology = None

    def _forget_rank_state(self):
        super()._forget_rank_state()
        if self.feedback:
            self.feedback.reset()
        self._scale = None


def sparse_gradient_parameters(model):
    """Names of the weights of embeddings made with sparse=True (their gradients are sparse: no
    bucket may wait for them)."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            names.add(f"{module_name}.weight" if module_name else "weight")
    return names
