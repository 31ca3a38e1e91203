"""DiLoCo's pseudo-gradients through GIFT's codec: one fragment's state, and one sync.

A pseudo-gradient (the last global weights minus the local ones after H inner steps) is reduced
as a gradient is (reduce/collective.py, or reduce/two_hop.py when the ranks of a replica group
hold copies of it): transformed, quantized with the stage-1 residual, summed in fp32 by each
chunk's owner, re-quantized with the stage-2 residual, gathered and decoded: the same bits on
every replica. Tensors under min_elements travel in fp32 (reduce.collective.Fp32Reduction).
What differs from a gradient's step:
- the outer step can be discarded (torchft: a failed collective, should_commit() false): what a
  sync writes into the residuals is kept only once its step commits (commit / rollback);
- the sum is divided by the participants (a healing replica sends zeros), not the ranks;
- the replicas, and this one's rank among them, change between syncs (quorums): before a sync
  laid out otherwise, r2 (laid out by the old ranks) is folded into r1, which is per parameter.
- a collective across replicas can fail on one rank of a replica group and not on the others
  (torchft then discards the outer step): with two hops, the group's ranks still run every
  collective inside the group, in the same order, and agree at the end (failed_locals), so
  every rank of the group raises and none waits for a peer that left the sync.
Memory: r1 a parameter's elements, r2 1/ranks of each bucket, in residual_dtype; during a sync,
a copy of both (the rollback's).
"""
import math

import torch

from ..codec.rotation import HadamardRotation
from ..codec.tensor_codec import Codec
from ..reduce.collective import Fp32Reduction, fill_buckets, mix_seed
from ..reduce.feedback import ErrorFeedback, fold_into
from ..reduce.topology import owned_pieces


def failed_locals(node, failed, device):
    """The local ranks of the replica group (node, a Communicator) whose `failed` is true: one
    allgather of a byte a rank, read on the host (once a sync)."""
    mine = torch.tensor([1 if failed else 0], dtype=torch.uint8, device=device)
    flags = node.allgather_async(mine, "gift.diloco.failed").wait()
    return [local for local, flag in enumerate(flags.tolist()) if flag]


class PseudoGradientState:
    """GIFT's state for one set of tensors synchronized together (a DiLoCo fragment). tensors:
    name -> a tensor of each pseudo-gradient's size, dtype and device (the fragment's local
    parameters); config: a GiftConfig (transform "none" or "hadamard"); key: an integer that
    sets this state's buckets apart in the stochastic rounding's seeds."""

    def __init__(self, tensors, config, key=0, min_bucket=0):
        """min_bucket: buckets of fewer elements travel in fp32 (a two-hop reduction needs
        node size x the codec's alignment: every rank of a node must own a chunk)."""
        self.config, self.key = config, key
        self.codec = Codec(config.format, config.block_size, config.rounding, config.seed)
        self.rotation = (HadamardRotation(config.hadamard_block, config.seed)
                         if config.transform == "hadamard" else None)
        sizes = {name: t.numel() for name, t in tensors.items()}
        self.small = [n for n in tensors if sizes[n] < config.min_elements]
        compressed = [n for n in tensors if sizes[n] >= config.min_elements]
        self.buckets = []
        for names in fill_buckets(compressed, sizes, config.bucket_elements):
            if sum(sizes[n] for n in names) >= min_bucket:
                self.buckets.append(names)
            else:
                self.small += names
        self.sizes = sizes
        self.feedback = (ErrorFeedback(tensors, self.buckets, self.codec.align,
                                       config.residual_dtype)
                         if config.error_feedback else None)
        # (topology description, rank, ranks, divisor) of the residuals' r2, once one is kept
        self.layout = None
        self._saved = None      # the residuals and layout before the sync in flight

    def prepare(self, grads, topology, cross, participants, step, use_residuals=True):
        """The sync of grads (name -> pseudo-gradient, written over by its finish()) over
        topology (reduce.topology.Flat, or TwoHop whose nodes are replica groups), made but not
        started (it has issued no collective); cross: the communicator across replicas (the
        fp32 tensors'); participants: the replicas whose pseudo-gradients are averaged (the
        others send zeros). use_residuals: False for a replica that does not take part (zeros
        without its residuals)."""
        feedback = self.feedback if use_residuals else None
        # a two-hop reduction sums the L copies a replica group holds: its sum is L times over
        divisor = participants * (topology.comm.size // cross.size)
        layout = (topology.description, topology.comm.rank, topology.comm.size, divisor)
        if feedback is not None:
            self._saved = ({n: r.clone() for n, r in feedback.stage1.items()},
                           {k: r.clone() for k, r in feedback.stage2.items()}, self.layout)
            if self.layout is not None and self.layout != layout:
                self._fold(self.layout)
            self.layout = layout
        return PseudoGradientSync(self, grads, topology, cross, divisor, participants, step,
                                  feedback)

    def _fold(self, layout):
        """r2 into r1 (their sum's error is the same in every layout's r1), under the layout
        that r2 was written in."""
        description, rank, ranks, divisor = layout
        for bucket, r2 in self.feedback.stage2.items():
            names = self.buckets[bucket]
            parts = owned_pieces(description, [self.sizes[n] for n in names], rank, ranks,
                                 self.codec)
            fold_into(self.feedback.first_stage(names), r2, parts, divisor)
        self.feedback.stage2 = {}

    def commit(self):
        """The sync's step was taken: keep what it wrote into the residuals."""
        self._saved = None

    def rollback(self):
        """The sync's step was discarded: the residuals as they were before it."""
        if self._saved is not None:
            self.feedback.stage1, self.feedback.stage2, self.layout = self._saved
            self._saved = None

    def reset(self):
        """Residuals restart at zero."""
        if self.feedback is not None:
            self.feedback.reset()
        self.layout, self._saved = None, None

    def residual_bytes(self):
        return sum(r.numel() * r.element_size() for r in self.feedback.tensors()) \
            if self.feedback is not None else 0

    def state_dict(self):
        """This rank's residuals (host copies) and the layout their r2 was written in; during a
        sync not yet committed, those from before it (torchft's global weights are still the
        previous step's)."""
        if self.feedback is None:
            return dict(ErrorFeedback.empty_state(), layout=None)
        if self._saved is None:
            return dict(self.feedback.state_dict(), layout=self.layout)
        stage1, stage2, layout = self._saved
        return {"residual1": {n: r.to("cpu", copy=True) for n, r in stage1.items()},
                "residual2": {k: r.to("cpu", copy=True) for k, r in stage2.items()},
                "spread": sorted(self.feedback.spread), "layout": layout}

    def load_state_dict(self, state):
        if self.feedback is None:
            return
        self.feedback.load_state_dict(state, lambda bucket: self._device(bucket))
        self.layout = state["layout"]

    def _device(self, bucket):
        return self.feedback.params[self.buckets[bucket][0]].device


class PseudoGradientSync:
    """One sync: made by PseudoGradientState.prepare (no collective issued: a rank that fails
    here can tell its replica group before any of them has started), start() issues every
    bucket's first collective, finish() drives the rest, in the same order on every rank. An
    error across replicas is kept, not raised, until finish() has run every collective inside
    the replica group (errors)."""

    def __init__(self, state, grads, topology, cross, divisor, participants, step, feedback):
        self.state, self.grads, self.node = state, grads, topology.node
        self.errors = []
        codec = state.codec
        self.flats = {}
        for names in state.buckets:
            for name in names:
                # an fp32 pseudo-gradient is its own flat: finish() decodes over it (its values
                # are sent by then), and no copy of the fragment is made
                flat = grads[name].detach().reshape(-1).to(torch.float32)
                self.flats[name] = (state.rotation.apply(flat) if state.rotation is not None
                                    else flat)
        self.reductions = []
        for k, names in enumerate(state.buckets):
            residual1 = residual2 = None
            flats = [self.flats[n] for n in names]
            if feedback is not None:
                residual1 = feedback.first_stage(names)
                owned = topology.owned_pieces([f.numel() for f in flats], codec)
                residual2 = feedback.second_stage(k, sum(hi - lo for _, lo, hi in owned),
                                                  flats[0].device)
            reduction = topology.reduction(f"gift.diloco.b{k}", flats, codec, residual1,
                                           residual2, True, step, None,
                                           mix_seed(state.key, k), divisor)
            self.reductions.append(reduction)
        self.small = None
        if state.small:
            flat = torch.cat([grads[n].detach().reshape(-1).to(torch.float32)
                              for n in state.small])
            self.small = Fp32Reduction("gift.diloco.fp32", flat, cross, participants)
        self.device = next(iter(grads.values())).device
        self.bytes_sent = 0
        # of those, what the quantized reductions sent across replicas (a two-hop reduction's
        # other bytes stay inside the replica group)
        self.cross_bytes = 0

    def start(self):
        """Issue every bucket's first collective (a reduction whose start raised is dropped,
        its error kept); returns self."""
        self.reductions = [self._started(r) for r in self.reductions]
        if self.small is not None:
            self.small = self._started(self.small)
        return self

    def _started(self, reduction):
        """reduction.start(), or None where it raised (kept in errors)."""
        try:
            return reduction.start()
        except Exception as error:
            self.errors.append(error)
            return None

    def _finished(self, reduction, **kwargs):
        """reduction's result, driven to its end, or None where it raised (kept in errors)."""
        try:
            while reduction.stage < reduction.final_stage:
                reduction.exchange()
            return reduction.finish(**kwargs)
        except Exception as error:
            self.errors.append(error)
            return None

    def _raise_errors(self):
        """This rank's first error, or, with two hops, the failure of a peer in the replica
        group: every rank of the group raises (none goes on to commit what a peer lacks)."""
        try:
            failed = (failed_locals(self.node, bool(self.errors), self.device)
                      if self.node is not None else [])
        except Exception as error:
            raise error from (self.errors[0] if self.errors else None)
        if self.errors:
            raise self.errors[0]
        if failed:
            raise RuntimeError(f"GIFT: the sync across replicas failed on local rank(s) "
                               f"{failed} of this replica group (their own error says why)")

    def finish(self):
        """Write the averages over grads; returns the names whose average is not finite (the
        same on every rank: the averages are)."""
        out = {}
        for names, reduction in zip(self.state.buckets, self.reductions):
            finished = None if reduction is None else self._finished(reduction,
                                                                      over_inputs=True)
            if finished is None:
                continue
            for name, u in zip(names, finished):
                out[name] = u
            self.bytes_sent += reduction.bytes_sent
            self.cross_bytes += reduction.bytes_sent - getattr(reduction, "node_bytes_sent", 0)
        flat = None if self.small is None else self._finished(self.small)
        self._raise_errors()    # before any write: a failed sync leaves grads to its caller
        for name, u in out.items():
            g = self.grads[name]
            if self.state.rotation is not None:
                u = self.state.rotation.apply(u, inverse=True, out=u)
            g.copy_(u.view(g.shape))
        if flat is not None:
            n, chunk = self.small.comm.size, self.small.chunk
            self.bytes_sent += 2 * (n - 1) * chunk * 4     # its alltoall's and allgather's
            offset = 0
            for name in self.state.small:
                g = self.grads[name]
                g.copy_(flat[offset : offset + g.numel()].view(g.shape))
                offset += g.numel()
        names = list(self.grads)
        # one host sync for the verdict: a sum is non-finite where any element is
        sums = torch.stack([self.grads[n].sum(dtype=torch.float32) for n in names]).tolist()
        return [n for n, total in zip(names, sums) if not math.isfinite(total)]
