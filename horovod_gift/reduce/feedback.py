"""Error feedback (the "memory" of GRACE): what each quantization stage lost, added back next step.

Stage 1 (every rank, per parameter): the residual r1 of the rank's own transformed gradient u,
    payload = Q(u + r1),  r1 <- (u + r1) - D(payload)
Stage 2 (the owner of a chunk, per bucket): the residual r2 of the re-quantized fp32 sum s,
    payload = Q(s + r2),  r2 <- (s + r2) - D(payload)
r1 lives in the coordinates of the parameter's current transform; r2 in those of the owner's
chunk of the bucket. In a two-hop reduction (two_hop.py) stage 1 quantizes a node's sum, and each
rank's r1 is that sum's residual on the part of the bucket the rank sums. Before a transform
changes, r2 is folded into r1 (fold) and r1 is mapped to the new coordinates (convert), so no
error is lost or counted in the wrong basis.
Memory: r1 has a parameter's elements, r2 a 1/ranks share of each bucket: (1 + 1/n) elements per
parameter element, in `dtype` (fp32, or bf16 for half of it).
"""
import math

import torch

from .collective import bucket_pieces

# Below this bound on a quantized piece's magnitudes, its residual is finite in fp32 and bf16
# (both overflow near 2**128; a residual is at most about twice the bound).
FINITE_AMAX = 2.0 ** 125


class ErrorFeedback:
    """params: name -> parameter; buckets: the parameter names of each bucket; align: the codec's
    chunk alignment (collective.bucket_pieces)."""

    def __init__(self, params, buckets, align, dtype=torch.float32):
        self.params, self.buckets, self.align, self.dtype = params, buckets, align, dtype
        self._ends = {}     # (name, ranks) -> the ends of the name's pieces in its bucket
        self.reset()

    def reset(self):
        """Forget every residual (they restart at zero)."""
        self.stage1, self.stage2 = {}, {}      # parameter name -> r1; bucket index -> r2
        # names whose r1 may hold values outside the part this rank's encodes write: a two-hop
        # reduction adds such an r1 to u before the node's sum (take_spread)
        self.spread = set()

    def take_spread(self, name):
        """The r1 of name if it may hold values outside this rank's part, zeroed once read by the
        caller (who adds it to u); else None."""
        if name not in self.spread:
            return None
        self.spread.discard(name)
        return self.stage1.get(name)

    def _zeros(self, numel, device):
        return torch.zeros(numel, dtype=self.dtype, device=device)

    def first_stage(self, names):
        """The r1 of these parameters, made (zero, on the parameter's device) the first time."""
        for n in names:
            if n not in self.stage1:
                self.stage1[n] = self._zeros(self.params[n].numel(), self.params[n].device)
        return [self.stage1[n] for n in names]

    def residual_pieces(self, name, n):
        """(r1 of name, the ends of name's pieces in its bucket's n chunks): for a rotation that
        adds r1 in its own pass (TransformPlan.forward_folded; fp32 residuals only)."""
        if (name, n) not in self._ends:
            names = next(b for b in self.buckets if name in b)
            index = names.index(name)
            pieces = bucket_pieces([self.params[m].numel() for m in names], n, self.align)
            self._ends[name, n] = [hi for chunk in pieces for i, _, hi in chunk if i == index]
        return self.first_stage([name])[0], self._ends[name, n]

    def second_stage(self, bucket, owned, device):
        """The r2 of this rank's chunk of a bucket (owned elements)."""
        if bucket not in self.stage2:
            self.stage2[bucket] = self._zeros(owned, device)
        return self.stage2[bucket]

    def fold(self, owned, scale):
        """Move each r2 into the r1 of its parameters, so both live in per-parameter coordinates.
        owned(sizes): the (tensor, lo, hi) parts of a bucket of tensors with these sizes that r2
        covers, in its order (Topology.owned_pieces); scale: the ranks for an average (stage 1
        is summed, then averaged), else 1."""
        for bucket, r2 in self.stage2.items():
            fold_into(self.first_stage(self.buckets[bucket]), r2,
                      owned([self.params[name].numel() for name in self.buckets[bucket]]), scale)
            r2.zero_()

    def rescale(self, factor):
        """Multiply every residual by factor (the gradients' units changed: a GradScaler's
        scale)."""
        for r in self.tensors():
            r.mul_(factor)

    def convert(self, name, old_inverse, new_forward):
        """Re-express r1 of `name` in new coordinates, in place: r1 <- F_new(F_old^-1(r1)).
        old_inverse and new_forward (TransformPlan's, with in_place=) map an fp32 r1 over itself
        and a bf16 one over its fp32 copy: no other temporary the tensor's size."""
        if name in self.stage1:
            residual = self.stage1[name]
            wide = residual.to(torch.float32)
            g = old_inverse(wide, in_place=True).view(self.params[name].shape)
            new = new_forward(g, in_place=True)
            if new.untyped_storage().data_ptr() != residual.untyped_storage().data_ptr():
                residual.copy_(new)
            self.spread.add(name)

    def state_dict(self):
        """Host copies: gathered from every rank, GPU tensors would be unpickled onto the GPU
        each came from, on every rank."""
        return {"residual1": {n: r.to("cpu", copy=True) for n, r in self.stage1.items()},
                "residual2": {k: r.to("cpu", copy=True) for k, r in self.stage2.items()},
                "spread": sorted(self.spread)}

    @staticmethod
    def empty_state():
        """The state_dict of no error feedback (a new one each call: callers may modify it)."""
        return {"residual1": {}, "residual2": {}, "spread": []}

    def load_state_dict(self, state, bucket_device):
        """Residuals back on their parameters' devices (a checkpoint loaded with
        map_location="cpu" onto a model on the GPU)."""
        self.stage1 = {n: r.to(self.params[n].device, self.dtype, copy=True)
                       for n, r in state["residual1"].items()}
        self.stage2 = {k: r.to(bucket_device(k), self.dtype, copy=True)
                       for k, r in state["residual2"].items()}
        self.spread = set(state.get("spread", self.stage1))

    def fold_saved(self, state, owned, scale):
        """A state_dict() with its r2 folded into its r1 (owned and scale: the saving topology's,
        as in fold), for a job that lays the buckets out otherwise; the state given is not
        modified."""
        stage1 = {n: r.clone() for n, r in state["residual1"].items()}
        for bucket, r2 in state["residual2"].items():
            sizes = [self.params[n].numel() for n in self.buckets[bucket]]
            for n, size in zip(self.buckets[bucket], sizes):
                stage1.setdefault(n, torch.zeros(size, dtype=r2.dtype, device=r2.device))
            fold_into([stage1[n] for n in self.buckets[bucket]], r2, owned(sizes), scale)
        return {"residual1": stage1, "residual2": {}, "spread": sorted(stage1)}

    def tensors(self):
        return list(self.stage1.values()) + list(self.stage2.values())


def scrub(residuals, amax_bounds):
    """A non-finite gradient must not poison later steps through its residual. amax_bounds:
    bounds on the magnitudes of every encode that updated these residuals (its input's amax, or
    Codec.amax_bound: the largest code times the largest scale). A residual is its encode's input
    less a dequantized value, both at most about the bound, so when every bound is under
    FINITE_AMAX every residual is finite and none is read. Otherwise each is summed: a sum is
    non-finite if any element is (or on overflow, where scrubbing changes nothing), and 30x
    cheaper than isfinite. One verdict for all of them (one host sync on a GPU)."""
    residuals = [r for r in residuals if r is not None and r.numel()]
    if not residuals:
        return
    if amax_bounds and bool((torch.cat(amax_bounds) < FINITE_AMAX).all()):
        return
    sums = torch.stack([r.sum(dtype=torch.float32) for r in residuals])
    if bool(torch.isfinite(sums).all()):
        return
    for r, total in zip(residuals, sums.tolist()):
        if not math.isfinite(total):
            r.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def fold_into(r1s, r2, parts, scale):
    """r1s[i][lo:hi] += scale * r2's next hi - lo values, for each (i, lo, hi) of parts."""
    offset = 0
    for i, lo, hi in parts:
        r1s[i][lo:hi].add_(r2[offset:offset + hi - lo], alpha=scale)
        offset += hi - lo
