"""Whitening statistics: a Nystrom sketch of A = E[x x^T] of the input of every trained linear
module (linear_layers.py: nn.Linear, transformers' Conv1D, registered classes; sketch.py), summed
over ranks, and factors that are bit-identical on every rank (each statistic's
factors are computed by one rank and broadcast).

Every step's forward pass adds its activations' sketch to a per-step EMA kept on each rank:
    history <- decay * history + [sketch sums of this step's tokens, token count]
with decay = 1 - 1 / window (bias-corrected: the statistic is the ratio of the two parts). Every
`refresh_every` steps, at the step's first gradient, the histories are summed over ranks and the
factors recomputed from steps before this one: the factors never fit the batch they compress, as
in every step between refreshes, so what "auto" measures on a refresh step holds for the others
(benchmarks/results/fidelity.md: the gain with a one-step-old statistic and with this EMA).

Layers that read the same input tensor (q/k/v of attention read one normed hidden state, gate/up
of an MLP another) have the same A: they share one statistic and one set of factors. Sharing is
found by the forward pre-hooks at the first statistics step: a layer whose first input of the step
is a tensor an earlier layer read (same device, data pointer, shape, strides and dtype, and that
tensor still alive, so its memory was not reused) shares the statistic of that layer, the owner
(the first by forward order). The first refresh settles it: every rank reports what it saw, a
layer takes the owner any rank saw it share (one no rank saw running owns its own), and ranks
that saw the same layer share with different owners raise. Collective names derive from the
owners, so they are identical on every rank.

Activation checkpointing runs a layer's forward again inside backward. Each call is counted once:
a forward inside backward is skipped when the same module's forward was counted before it and
not yet replayed (torch.utils.checkpoint's default, non-reentrant, runs the first forward with
grad), and counted when it was not (reentrant checkpointing runs the first forward without grad;
its statistics then land in the next step's sums, still from earlier batches at every refresh).
"""
import logging
import weakref

import torch

from .linear_layers import linear_readers
from .whitening import IDENTITY_FACTORS, InputWhitening


class WhiteningStatistics:
    """Forward pre-hooks on the linear modules (linear_layers.py) whose weights are trained: the
    owners' hooks sum their sketches over each step's forward passes, advance() folds them into
    the history, and refresh() turns the histories into factors. whitening maps every weight name
    to its InputWhitening (one object for the layers that share an input, once sharing is
    settled); transposed holds the names of weights stored (in, out)."""

    def __init__(self, model, params, whitening_rank, damping, refresh_every, window, comm):
        self.refresh_every, self.damping = refresh_every, damping
        self.whitening_rank = whitening_rank     # eigenpairs kept per input statistic
        self.window, self.decay = window, 1.0 - 1.0 / window
        self.comm = comm     # a Communicator; may be replaced before the first refresh
        self.whitening, self._handles = {}, []
        self._weights, self._in_features, self.transposed = {}, {}, set()
        self.readers = {}        # weight name -> names of the modules whose inputs it is fed
        self.borrowed = {}       # weight name -> reader modules it is not the attribute of (tied)
        self._sums = {}          # owner -> this step's [sketch sums, tokens], activations' device
        self._history = {}       # owner -> EMA of earlier steps' sums (module docstring)
        self._owner = None       # weight name -> owner weight name, once settled
        self._first_owner = {}   # until settled: weight name -> owner, from the layer's first input
        self._readers = {}       # until settled: input key -> (weak reference to the input, owner)
        for name, modules in linear_readers(model, params).items():
            shapes = {(layout.layout, layout.in_features(params[name]))
                      for _, _, layout in modules}
            if len(shapes) > 1:
                raise ValueError(f"GIFT: the modules {[m for m, _, _ in modules]} read {name} "
                                 f"as linear layers of different layouts {sorted(shapes)}")
            (layout, in_features), = shapes
            self._weights[name], self._in_features[name] = params[name], in_features
            if layout == "in_out":
                self.transposed.add(name)
            self.readers[name] = [module_name for module_name, _, _ in modules]
            borrowed = [module_name for module_name, _, layout in modules
                        if _attribute_path(module_name, layout.weight) != name]
            if borrowed:
                self.borrowed[name] = borrowed
            for _, module, layout in modules:
                self._handles.append(module.register_forward_pre_hook(
                    self._hook(name, layout, shared_weight=len(modules) > 1), with_kwargs=True))
        self._share(None)

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()

    def _hook(self, name, layout, shared_weight):
        # forwards counted outside backward and not yet replayed by activation checkpointing
        pending = [0]

        # run as Python under torch.compile: its side effects (the sums, the first reader's
        # weak reference) are not traceable, and the input must be the real tensor
        @torch.compiler.disable
        def collect(module, args, kwargs):
            if not (module.training and torch.is_grad_enabled()):
                return
            if _in_backward():
                # a checkpointed layer recomputing its forward: count it only if its first
                # forward was not (reentrant checkpointing runs that one without grad)
                if pending[0] > 0:
                    pending[0] -= 1
                    return
            else:
                pending[0] += 1
            x = layout.activations(module, args, kwargs)
            if self._owner is not None:
                owner = self._owner[name]
            else:
                # a weight read by several modules sees several inputs: it owns its statistic
                owner = (self._first_owner.setdefault(name, name) if shared_weight
                         else self._first_reader(name, x))
            if owner != name:
                return                       # the owner's hook sums this very input
            statistic = self.whitening[name].statistic
            x = x.detach().reshape(-1, x.shape[-1]).to(statistic.dtype)
            sums = self._sums.get(name)
            if sums is None:
                sums = self._sums[name] = torch.zeros(statistic.numel + 1, dtype=statistic.dtype,
                                                      device=x.device)
            # under autocast x @ Omega would come out bf16 and miss the fp32 sums' dtype
            with torch.autocast(x.device.type, enabled=False):
                statistic.accumulate(x, sums[:-1])
            sums[-1] += x.shape[0]
        return collect

    def _first_reader(self, name, x):
        """The owner of `name`'s statistic, decided by the first input it reads while unsettled."""
        if name not in self._first_owner:
            key = (x.device, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
            reader = self._readers.get(key)
            # A dead reference: that tensor is gone and its memory may hold another one now.
            if reader is not None and reader[0]() is not None:
                self._first_owner[name] = reader[1]
            else:
                self._first_owner[name] = name
                self._readers[key] = (weakref.ref(x), name)
        return self._first_owner[name]

    def _share(self, owner_of):
        """Make every weight name map to its owner's InputWhitening (fresh objects: statistics are
        folded in only by refresh); owner_of None: each layer its own, sharing still unsettled."""
        self._owner, self._first_owner, self._readers = owner_of, {}, {}
        owners = {}
        for name in self._weights:
            owner = name if owner_of is None else owner_of[name]
            if owner not in owners:
                # ema 0: the statistic is replaced by each refresh's (the EMA is the history)
                owners[owner] = InputWhitening(self._in_features[name], rank=self.whitening_rank,
                                               damping=self.damping, ema=0.0)
            self.whitening[name] = owners[owner]

    def _settle_sharing(self):
        """Agree with the other ranks on who shares (module docstring); False if no rank has seen
        a layer run yet (then sharing stays unsettled)."""
        names = sorted(self._weights)
        index = {name: i for i, name in enumerate(names)}
        seen = [index[self._first_owner[name]] if name in self._first_owner else -1
                for name in names]
        # One max over ranks gives the largest owner index seen and (negated) the smallest.
        votes = torch.tensor(seen + [-i if i >= 0 else -len(names) for i in seen],
                             dtype=torch.int64, device="cpu")
        votes = self.comm.allreduce(votes, "max", "gift.sharing").tolist()
        largest, smallest = votes[:len(names)], [-v for v in votes[len(names):]]
        if max(largest) < 0:
            return False
        disputed = [name for name, hi, lo in zip(names, largest, smallest)
                    if hi >= 0 and hi != lo]
        if disputed:
            raise RuntimeError(f"WhiteningStatistics: ranks saw {', '.join(disputed)} read the "
                               "input of different layers at the first statistics step; sharing "
                               "must be the same on every rank")
        self._share({name: names[hi] if hi >= 0 else name for name, hi in zip(names, largest)})
        return True

    def due(self, step):
        return bool(self._weights) and step % self.refresh_every == 0

    def advance(self):
        """Fold this step's sums into the history (local: no collective). Call it once a step,
        after any refresh of that step."""
        owners = None if self._owner is None else set(self._owner.values())
        for owner, history in list(self._history.items()):
            if owners is not None and owner not in owners:
                del self._history[owner]     # keyed by an owner sharing settled otherwise
            else:
                history.mul_(self.decay)
        for owner, sums in self._sums.items():
            if owners is not None and owner not in owners:
                continue
            if owner in self._history:
                self._history[owner].add_(sums)
            else:
                self._history[owner] = sums
        self._sums = {}

    def refresh(self):
        """Sum the histories over ranks, make them every statistic's value, compute its factors on
        rank (owner index mod ranks) and broadcast them. Returns {weight name: previous factors}
        for every layer whose factors changed (all the layers sharing a statistic)."""
        if self._owner is None and not self._settle_sharing():
            return {}
        owners = sorted(set(self._owner.values()))
        device = self._weights[owners[0]].device
        lengths = [self.whitening[owner].statistic.numel + 1 for owner in owners]
        # every history in one allreduce, one name (a name per layer would thrash engines'
        # response caches at 8B shapes); never run here: add nothing (zeros)
        histories = [self._history[owner].to(device) if owner in self._history
                     else torch.zeros(length, dtype=torch.float32, device=device)
                     for owner, length in zip(owners, lengths)]
        # not in place: the histories go on decaying here
        summed = self.comm.allreduce(torch.cat(histories), "sum", "gift.stats")
        n, me = self.comm.size, self.comm.rank
        factors = {}            # root rank -> [(owner, flat factors)], broadcast by that root
        for i, (owner, sums) in enumerate(zip(owners, torch.split(summed, lengths))):
            sums = sums.to(self._weights[owner].device)      # back to its layer's
            tokens, w = float(sums[-1]), self.whitening[owner]
            if tokens == 0:
                continue
            if not torch.isfinite(sums).all():      # identical verdict on every rank
                # a non-finite activation would stay in the history for good: start it afresh
                self._history.pop(owner, None)
                logging.getLogger("horovod_gift").warning(
                    "whitening statistics of %s were not finite; they restart from the next step "
                    "(the factors stay as they were)", owner)
                continue
            root = i % n
            w.fold(sums[:-1].div(tokens), refresh=False)
            flat = (_factors_or_nan(w, sums.device).to(device) if root == me
                    else torch.empty(w.factor_numel(), dtype=torch.float32, device=device))
            factors.setdefault(root, []).append((owner, flat))
        # one broadcast per computing rank: at most min(ranks, statistics) names
        handles = [(root, self.comm.broadcast_async_(torch.cat([f for _, f in group]), root,
                                                     f"gift.factors.{root}"))
                   for root, group in sorted(factors.items())]
        broadcasts = []
        for root, handle in handles:
            group = factors[root]
            parts = torch.split(handle.wait(), [f.numel() for _, f in group])
            broadcasts.extend((owner, part.to(self._weights[owner].device))
                              for (owner, _), part in zip(group, parts))
        changed, failed = {}, []
        for owner, flat in broadcasts:
            w = self.whitening[owner]
            if not torch.isfinite(flat).all():        # the same verdict on every rank
                failed.append(owner)
                continue
            previous, w.factors = w.factors, w.factors_from_tensor(flat)
            # residuals made before the first refresh are in unwhitened coordinates
            previous = IDENTITY_FACTORS if previous is None else previous
            changed.update({name: previous for name, o in self._owner.items() if o == owner})
        if failed:
            raise FloatingPointError(f"WhiteningStatistics: the whitening factors of "
                                     f"{', '.join(failed)} could not be computed from a finite "
                                     "statistic (see the computing rank's log)")
        return changed

    def describe(self, params, compressed):
        """The weights whitened as linear modules' (linear_layers.py), those read by a module
        they do not belong to (a tied LM head), and the 2-D weights among compressed (names)
        that no linear module reads."""
        text = f"{len(self.readers)} weights of linear modules"
        if self.transposed:
            text += f" ({len(self.transposed)} stored in x out)"
        if self.borrowed:
            text += ", read through another module: " + "; ".join(
                f"{name} by {', '.join(modules)}" for name, modules in self.borrowed.items())
        other = [name for name in compressed
                 if params[name].dim() == 2 and name not in self.readers]
        if other:
            shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
            text += f"; 2-D weights no linear module reads (not whitened): {shown}"
        return text

    def local_state_dict(self):
        """This rank's histories (host copies): part of the per-rank state, like the residuals."""
        return {owner: h.to("cpu", copy=True) for owner, h in self._history.items()}

    def load_local_state_dict(self, state):
        self._history = {owner: h.to(self._weights[owner].device, copy=True)
                         for owner, h in state.items()}

    def state_dict(self):
        """The owners (None while unsettled) and each distinct statistic's state, by owner."""
        owner_of = self._owner or {name: name for name in self.whitening}
        return {"owner": self._owner,
                "whitening": {name: w.state_dict() for name, w in self.whitening.items()
                              if owner_of[name] == name}}

    def load_state_dict(self, state):
        self._share(state["owner"])
        for name, w_state in state["whitening"].items():
            device = self._weights[name].device
            self.whitening[name].load_state_dict(w_state, device)


def _factors_or_nan(whitening, device):
    """The factors as one flat tensor, or NaNs if they cannot be computed: the other ranks wait in
    the broadcast, so the error must travel with it and be raised on every rank."""
    try:
        return whitening.factors_to_tensor(whitening.compute_factors())
    except (ValueError, RuntimeError) as error:     # torch.linalg's errors are RuntimeErrors
        logging.getLogger("horovod_gift").error("whitening factors failed: %s", error)
        return torch.full((whitening.factor_numel(),), float("nan"), device=device)


def _in_backward():
    """Whether autograd's engine is running this thread's code: a forward inside backward is
    activation checkpointing's recomputation (torch.utils.checkpoint asks the same way)."""
    return torch._C._current_graph_task_id() != -1


def _attribute_path(module_name, attribute):
    return f"{module_name}.{attribute}" if module_name else attribute
