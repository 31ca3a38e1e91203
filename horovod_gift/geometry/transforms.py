"""Which transform each gradient takes, and applying it.

"none", "hadamard" (randomized Hadamard rotation of the flattened tensor), "whiten" (input
whitening of the weights of linear modules, linear_layers.py; other tensors take "none") and
"whiten+hadamard" (other tensors take "hadamard"). "auto" starts every tensor at "none" and, on
each refresh step after the first, re-picks per tensor the candidate with the smallest round-trip
error on that step's gradients summed over ranks (so every rank picks the same). The factors of a
refresh step come from earlier batches only, as on the steps that follow it, so the vote measures
what they will get. GiftConfig.transform's comment (config.py) says when to use which
(benchmarks/results/fidelity.md).
"""

import functools

import torch

from ..codec.backend import runs_native

# The transforms that may whiten: the statistics and their forward hooks exist only under them.
WHITENING_TRANSFORMS = ("auto", "whiten", "whiten+hadamard")


class TransformPlan:
    def __init__(self, params, transform, statistics, rotation):
        """rotation: the HadamardRotation of the "hadamard" transforms."""
        self.params, self.transform, self.statistics = params, transform, statistics
        self.rotation = rotation
        self.evaluating, self._errors, self._vote = False, {}, None
        self.choice = {}
        for name in params:
            linear = name in statistics.whitening
            if transform == "auto":
                self.choice[name] = "none"
            elif transform.startswith("whiten") and not linear:
                self.choice[name] = "hadamard" if transform.endswith("hadamard") else "none"
            else:
                self.choice[name] = transform

    def candidates(self, name):
        if name in self.statistics.whitening:
            return ("none", "hadamard", "whiten", "whiten+hadamard")
        return ("none", "hadamard")

    def forward(self, name, g, plan=None, in_place=False):
        """Flat fp32 transformed gradient; in_place: g is not needed afterwards and may be
        overwritten (a gradient of over 32 MB rotated into a new tensor costs a page fault per
        4 KB on CPU)."""
        plan = plan or self.choice[name]
        flat, out = self._before_rotation(name, g, plan, in_place)
        return self.rotation.apply(flat, out=out) if plan.endswith("hadamard") else flat

    def folds(self, name, g):
        """Whether forward_folded applies: a native CPU rotation ends name's transform."""
        return self.choice[name].endswith("hadamard") and runs_native(g)

    def forward_folded(self, name, g, residual, ends):
        """(forward(name, g, in_place=True) + residual, each piece's largest magnitude_bits) with
        the residual (fp32) added in the rotation's pass (HadamardRotation.apply_folded), where
        folds(name, g)."""
        flat, out = self._before_rotation(name, g, self.choice[name], in_place=True)
        return out, self.rotation.apply_folded(flat, residual, ends, out)

    def _before_rotation(self, name, g, plan, in_place):
        """The flat fp32 gradient before its rotation (whitened under "whiten"), and where the
        rotation may write it: itself when it may be overwritten, else None (a new tensor)."""
        def writable(t):  # g given up, or a copy of it (a dtype change, a non-contiguous gradient)
            return in_place or t.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()

        x = g.detach().to(torch.float32)
        if plan.startswith("whiten"):
            rows = self._rows(name, x)
            over_rows = writable(rows) and (rows.is_contiguous() or rows.t().is_contiguous())
            x = self._from_rows(name, self.statistics.whitening[name].forward(
                rows, out=rows if over_rows else None))
        flat = x.reshape(-1).contiguous()
        return flat, flat if writable(flat) else None

    def inverse(self, name, u, plan=None, factors=None, in_place=False):
        """Flat fp32 gradient from flat fp32 u; in_place: u is not needed afterwards and may be
        overwritten."""
        plan = plan or self.choice[name]
        x = u
        if plan.endswith("hadamard"):
            x = self.rotation.apply(u, inverse=True, out=u if in_place else None)
        if plan.startswith("whiten"):
            rows = self._rows(name, x)
            x = self._from_rows(name, self.statistics.whitening[name].inverse(
                rows, factors=factors, out=rows if in_place else None)).reshape(-1)
        return x

    def _rows(self, name, x):
        """x (the weight's shape, or flat) as the (out, in) matrix the whitening acts on: a view
        of x's storage, transposed for a weight stored (in, out) (transformers' Conv1D)."""
        in_features = self.statistics.whitening[name].in_features
        if name in self.statistics.transposed:
            return x.reshape(in_features, -1).t()
        return x.reshape(-1, in_features)

    def _from_rows(self, name, rows):
        """The inverse of _rows' view: back to the weight's own layout (a copy if it was new)."""
        return rows.t() if name in self.statistics.transposed else rows

    def record(self, name, g, codec):
        """On a refresh step under "auto": this rank's round-trip error of each candidate
        (local)."""
        if self.transform != "auto" or not self.evaluating:
            return
        flat = g.detach().reshape(-1).to(torch.float32)
        errors = [self._round_trip_error(name, g, flat, plan, codec)
                  for plan in self.candidates(name)]
        errors += [errors[0].new_zeros(())] * (4 - len(errors))
        self._errors[name] = torch.stack(errors)    # on the device: no host sync per tensor

    def _round_trip_error(self, name, g, flat, plan, codec):
        """||T^-1(D(Q(T(g)))) - g||^2 for the candidate plan, with one temporary the tensor's
        size (its own function: a candidate's tensors are freed before the next one's)."""
        u = self.forward(name, g, plan)
        # decoded over u, which is not read again (unless u is the gradient itself: "none")
        mine = u.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        back = codec.decode(codec.encode(u), u.numel(), out=u if mine else None)
        return squared_distance(self.inverse(name, back, plan, in_place=True), flat)

    def start_vote(self):
        """Sum every recorded error over ranks: one collective, started once every rank has sent
        every gradient (a collective inside compress could deadlock: ranks call it in different
        orders)."""
        if self._errors:
            names = sorted(self._errors)
            # host metadata: one copy off the device for every tensor's errors
            errors = torch.stack([self._errors[n] for n in names]).to("cpu")
            self._vote = (names, self.statistics.comm.allreduce_async(errors, "sum", "gift.auto"))

    def finish_vote(self):
        """Apply the vote after the step's results were mapped back with the old transforms.
        Returns the old inverse map of each tensor whose transform changed (name -> callable)."""
        if self._vote is None:
            return {}
        names, handle = self._vote
        totals = handle.wait().nan_to_num(nan=float("inf"))
        old_inverses = {}
        for name, total in zip(names, totals):
            candidates = self.candidates(name)
            best = candidates[int(torch.argmin(total[: len(candidates)]))]
            if best != self.choice[name]:
                old_inverses[name] = functools.partial(self.inverse, name, plan=self.choice[name])
                self.choice[name] = best
        return old_inverses

    def begin_step(self, evaluating):
        """evaluating: this step's gradients are judged for the "auto" vote (a refresh step)."""
        self.evaluating, self._errors, self._vote = evaluating, {}, None

    def end_step(self):
        self.begin_step(evaluating=False)

    def counts(self, compressed):
        out = {}
        for name, plan in self.choice.items():
            key = plan if name in compressed else "fp32 (small)"
            out[key] = out.get(key, 0) + 1
        return out

    def state_dict(self):
        return dict(self.choice)

    def load_state_dict(self, state):
        self.choice = dict(state)


# Elements per fp64 block of squared_distance: a temporary of 8 MB, whatever the tensor's size.
DISTANCE_BLOCK = 1 << 20


def squared_distance(a, b):
    """||a - b||^2 summed in fp64 (a 0-d tensor on a's device), a overwritten with a - b: no
    temporary the size of the tensor (a round trip's error is small against a large gradient,
    and the vote compares sums of millions of squares)."""
    diff = a.sub_(b)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, diff.numel(), DISTANCE_BLOCK):
        total += diff[start : start + DISTANCE_BLOCK].double().square().sum()
    return total
