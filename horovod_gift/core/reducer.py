"""The bucketed reduction of Horovod's and DDP's compressed gradients (GiftCore's step): each
gradient transformed with its error feedback folded in, a bucket's quantized reduction started
over the Topology once all its members are in, the reduced u mapped back, and the residuals kept
where they are read: in the coordinates of the current transforms, in the GradScaler's units,
and, per rank, in checkpoints (the PerRankState of GiftCore).
"""
from __future__ import annotations

import functools

import torch

from ..reduce.collective import fill_buckets
from ..reduce.feedback import ErrorFeedback, scrub
from ..reduce.pipeline import StagePipeline
from ..reduce.topology import owned_pieces
from .state_base import PerRankState


class BucketReducer(PerRankState):
    """params: name -> parameter; compressed: the names that go through the codec, in backward
    order (they fill the buckets); plan: the TransformPlan of every parameter."""

    def __init__(self, params, compressed, config, codec, plan, telemetry):
        self.params, self.codec, self.plan, self.telemetry = params, codec, plan, telemetry
        self.buckets = fill_buckets(compressed, {n: params[n].numel() for n in compressed},
                                    config.bucket_elements)
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self.feedback = (ErrorFeedback(params, self.buckets, codec.align, config.residual_dtype)
                         if config.error_feedback else None)
        self.topology = None        # the frontend's Topology, chosen before the first step
        self.average = True         # a sum when False
        self.grad_scale = None      # the GradScaler's scale the residuals are in

    # ---------------------------------------------------------------- one step
    def new_pipeline(self):
        return StagePipeline(self.buckets, self.telemetry)

    def take(self, step, name, g):
        """u = T(g) (flat fp32, over g's storage where it can be) into step (a StepState);
        returns g's bucket if it was the last member missing, else None."""
        self.plan.record(name, g, self.codec)
        if (self.feedback and self.feedback.dtype == torch.float32 and self.topology.folds
                and self.plan.folds(name, g)):
            # the rotation adds r1 in its own pass and gives its pieces' amax bits
            step.u[name], step.maxima[name] = self.plan.forward_folded(
                name, g, *self.feedback.residual_pieces(name, self.topology.comm.size))
        else:
            u = step.u[name] = self.plan.forward(name, g, in_place=True)
            # an r1 with values outside this rank's part goes into the node's sum (two_hop.py)
            spread = self.feedback.take_spread(name) if self.feedback else None
            if spread is not None and not self.topology.folds:
                u.add_(spread)
                spread.zero_()
        bucket = self.bucket_of[name]
        return bucket if all(n in step.u for n in self.buckets[bucket]) else None

    def start(self, step, bucket, count):
        """The bucket's quantized reduction started in step's pipeline (members not handed over
        this step take zeros); count: the step's number (stochastic rounding's seed)."""
        names = self.buckets[bucket]
        flats = [step.u[n] if n in step.u else
                 torch.zeros(self.params[n].numel(), dtype=torch.float32,
                             device=self.params[n].device)
                 for n in names]
        residual1 = residual2 = None
        if self.feedback:
            residual1 = self.feedback.first_stage(names)
            owned = self.topology.owned_pieces([f.numel() for f in flats], self.codec)
            residual2 = self.feedback.second_stage(bucket, sum(hi - lo for _, lo, hi in owned),
                                                   flats[0].device)
        self.telemetry.add(payload_bytes=sum(self.codec.payload_bytes(f.numel()) for f in flats))
        step.pipeline.start(bucket, self.topology.reduction(
            f"gift.b{bucket}", flats, self.codec, residual1, residual2, self.average, count,
            [step.maxima.get(n) for n in names], bucket))

    def start_the_rest(self, step, count):
        """Every bucket with a member this step whose reduction never started (the engine did
        not hand over all of its members)."""
        for bucket, names in enumerate(self.buckets):
            if bucket not in step.pipeline.reductions and any(n in step.u for n in names):
                self.start(step, bucket, count)

    def result(self, name, u, shape, dtype):
        """The averaged gradient of name from its reduced u (overwritten)."""
        return self.plan.inverse(name, u, in_place=True).view(shape).to(dtype)

    def scrub(self, pipeline):
        """Residuals made non-finite by this step's gradients back to zero: one verdict for every
        bucket of the step (one host sync on a GPU), before the next step reads them."""
        if self.feedback:
            scrub(*pipeline.residuals())

    # ---------------------------------------------------------------- the residuals' upkeep
    def change_transforms(self, change):
        """Run change() (new whitening factors, or new transform choices), which returns the old
        inverse map of each tensor it changed, and keep the residuals in step: stage 2 folded
        into stage 1 before (it lives in the old coordinates of a whole bucket), each changed
        tensor's stage 1 re-expressed in its new coordinates after."""
        if self.feedback:
            self.feedback.fold(functools.partial(self.topology.owned_pieces, codec=self.codec),
                               self.topology.comm.size if self.average else 1)
        for name, old_inverse in change().items():
            if self.feedback:
                self.feedback.convert(name, old_inverse, functools.partial(self.plan.forward, name))

    def follow_scale(self, scale):
        """The residuals hold gradients in the GradScaler's units: when its scale changes (growth,
        or backoff after a step it skipped), rescale them with it. Every rank reads the same
        scale: the scaler judges the averaged gradients, identical on every rank."""
        if self.feedback and self.grad_scale is not None and scale != self.grad_scale:
            self.feedback.rescale(scale / self.grad_scale)
        self.grad_scale = scale

    # ---------------------------------------------------------------- PerRankState
    def state(self):
        return {"feedback": (self.feedback.state_dict() if self.feedback
                             else ErrorFeedback.empty_state()),
                "grad_scale": self.grad_scale,          # the residuals' units
                # what r2 covers, and its scale when folded into r1 (None: no step yet, no r2)
                "topology": self.topology.description if self.topology else None,
                "average": self.average}

    def restore(self, saved):
        self.grad_scale = saved["grad_scale"]
        if not self.feedback:
            return
        feedback, topology = saved["feedback"], saved.get("topology", ("flat",))
        if topology not in (None, self.topology.description):   # r2 covers other parts
            me, n = self.topology.comm.rank, self.topology.comm.size
            feedback = self.feedback.fold_saved(
                feedback, lambda sizes: owned_pieces(topology, sizes, me, n, self.codec),
                n if saved.get("average", True) else 1)
        self.feedback.load_state_dict(feedback, lambda k: self.params[self.buckets[k][0]].device)

    def forget(self):
        if self.feedback:
            self.feedback.reset()
        self.grad_scale = None

    def tensors(self):
        return self.feedback.tensors() if self.feedback else []
