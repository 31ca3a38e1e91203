"""What GIFT relies on in Horovod 0.28.1's DistributedOptimizer beyond the Compressor interface.

Horovod calls `compress(p.grad)` and nothing else tells the compressor which optimizer it serves.
GIFT needs that optimizer's process set and op, so it reads them from the calling frame:
- `_DistributedOptimizer._allreduce_grad_async(self, p)` and `_grouped_allreduce_grad_async(self,
  ps)` call `self._compression.compress(...)`; `self.process_set` and `self.op` are attributes of
  that optimizer (horovod/torch/optimizer.py).
- `_DistributedAdasumOptimizer` compresses parameter deltas and has `_starting_models`.
- Sparse gradients (without sparse_as_dense) skip `compress` and reach `decompress(out, None)`;
  with sparse_as_dense, `compress` gets `p.grad.to_dense()`, a new tensor, from a frame whose
  local `p` is the parameter.
- `synchronize()` sets `p.grad.set_(decompress(output, ctx))`.
- `compress` receives `p.grad` itself (GradientNames finds the parameter by identity).
- A rank in `hvd.join()` contributes zeros to allreduces, the only collective join supports
  (its alltoall and allgather crash): roll_call tells every rank whether all are in the step.
- The optimizer hooks only the parameters that require grad when it is built: parameters
  unfrozen later are never compressed nor reduced (UnhookedParameters reduces them).
mpi_tests/test_horovod_options.py fails if Horovod changes any of these.
"""
import logging
import os
import sys
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.common import process_sets
from torch.optim.optimizer import register_optimizer_step_pre_hook

logger = logging.getLogger("horovod_gift")

# compress() <- _allreduce_grad_async, or <- a list comprehension <- _grouped_allreduce_grad_async
SEARCH_DEPTH = 6


def _frames(frame, depth):
    while frame is not None and depth > 0:
        yield frame
        frame, depth = frame.f_back, depth - 1


def calling_optimizer(compressor):
    """(the Horovod optimizer whose hook is calling `compressor.compress` now, or None for a
    direct call; that hook's parameter `p`, or None). Found by the `self` of the calling frames:
    only an optimizer holds `_compression`. With sparse_as_dense the tensor compressed is
    `p.grad.to_dense()`, a new tensor: `p` names it."""
    for frame in _frames(sys._getframe(2), SEARCH_DEPTH):
        caller = frame.f_locals.get("self")
        if caller is not None and getattr(caller, "_compression", None) is compressor:
            return caller, frame.f_locals.get("p")
    return None, None


def is_adasum(optimizer):
    return hasattr(optimizer, "_starting_models")


def describe_process_set(ps):
    return f"process set {ps.process_set_id} (ranks {ps.ranks})"


# GIFT instances in use: an optimizer stepping their parameters must use one
_LIVE: weakref.WeakSet = weakref.WeakSet()
_WARNED: weakref.WeakSet = weakref.WeakSet()
_GUARD: list = []


def refuse_other_optimizers(gift, compressor_class):
    """Before an optimizer steps a GIFT model's parameters, check that it averages them: a plain
    optimizer would leave every rank stepping with its own gradient, so it raises. A Horovod
    optimizer with other compression averages them (a legitimate split, e.g. a second optimizer for
    some parameters), so it only warns that GIFT does not compress what it steps. Horovod's
    optimizers are recognised by their `_compression` attribute."""
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: _check_optimizer(optimizer, compressor_class)))
    _LIVE.add(gift)


def _check_optimizer(optimizer, compressor_class):
    if optimizer in _WARNED or isinstance(getattr(optimizer, "_compression", None),
                                          compressor_class):
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in stepped for gift in list(_LIVE) for p in gift.params.values()):
        return
    kind = type(optimizer).__name__
    advice = ("wrap it as hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), "
              "compression=<that GIFT instance>)")
    if not hasattr(optimizer, "_compression"):
        raise RuntimeError(f"GIFT: {kind}.step() updates the parameters of a model given to "
                           "GIFT(model) with no Horovod wrapper: their gradients are not averaged "
                           "across ranks; " + advice)
    warnings.warn(f"GIFT: {kind}.step() updates parameters of a model given to GIFT(model) "
                  "through Horovod with a different compression: GIFT does not compress them; "
                  "to compress, " + advice, stacklevel=4)
    _WARNED.add(optimizer)

def check_optimizer(optimizer, requested_process_set, serving):
    """Refuse, on every rank of the set and before any collective of GIFT's, what GIFT cannot
    honour in the Horovod optimizer calling it: Adasum, ops other than Average and Sum, another
    process set than the one GIFT was made with, or a second optimizer with another set or op
    (serving: the (process set, average) GIFT already serves, or None)."""
    if is_adasum(optimizer):
        raise ValueError("GIFT does not support op=hvd.Adasum (it compresses parameter "
                         "deltas, not averaged gradients); use op=hvd.Average")
    if optimizer.op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"GIFT supports op=hvd.Average and op=hvd.Sum in "
                         f"hvd.DistributedOptimizer, got op={optimizer.op!r}")
    ps = optimizer.process_set
    if (requested_process_set is not None
            and ps.process_set_id != requested_process_set.process_set_id):
        mine, theirs = map(describe_process_set, (requested_process_set, ps))
        raise ValueError(f"GIFT was made with {mine} but hvd.DistributedOptimizer reduces "
                         f"over {theirs}; pass the optimizer's process set to "
                         "GIFT(..., process_set=...) or leave it out")
    if serving is not None and (ps.process_set_id != serving[0].process_set_id
                                or (optimizer.op == hvd.Average) != serving[1]):
        raise ValueError("GIFT: this instance already serves a Horovod optimizer with another "
                         "process set or op; make one GIFT per optimizer")


def roll_call(comm, step, device):
    """(every rank of the communicator is in this step, the largest step count among them): one
    allreduce of two numbers with Min, (present, -step), to which a rank in hvd.join()
    contributes zeros, so present's minimum is 0 if any rank joined. Ranks that joined early come
    back with fewer steps; all take the largest count, so seeds, refreshes and collective names
    stay in step. It lives on the gradients' device, where a joined rank makes its zeros
    (hvd.join(device)); its size does not grow with the ranks."""
    roll = torch.tensor([1.0, -float(step)], dtype=torch.float64, device=device)
    present, negative_step = comm.allreduce(roll, "min", "gift.roll_call").tolist()
    return present == 1, int(-negative_step)


class GradientNames:
    """The parameter a gradient handed to compress() belongs to. Horovod passes p.grad itself,
    with no name; after zero_grad() sets it to None, p.grad is a new tensor every step, so the
    map from id(p.grad) is rebuilt whenever a lookup misses."""

    def __init__(self, params):
        self.params, self._names = params, {}

    def __call__(self, tensor, hooked=None):
        """hooked: the parameter Horovod's hook compresses, or None; when its gradient is sparse,
        tensor is a dense copy of it (sparse_as_dense)."""
        name = self._names.get(id(tensor))
        if name is not None and self.params[name].grad is tensor:
            return name
        self._names = {id(p.grad): n for n, p in self.params.items() if p.grad is not None}
        name = self._names.get(id(tensor))
        if name is not None:
            return name
        grad = getattr(hooked, "grad", None)
        if grad is not None and grad.is_sparse and grad.shape == tensor.shape:
            name = self._names.get(id(grad))
            if name is not None:
                return name
        raise ValueError(f"GIFT.compress got a tensor of shape {tuple(tensor.shape)} that is not "
                         "the .grad of a parameter of the model given to GIFT(model); pass the "
                         "same model's named_parameters() to hvd.DistributedOptimizer")


class UnhookedParameters:
    """Parameters frozen when the optimizer was wrapped and trainable later: Horovod hooks only
    the parameters trainable at construction, so GIFT averages these itself at the end of a step."""

    def __init__(self, params, verbose):
        self.params, self.verbose = params, verbose
        self.frozen_at_start = sorted(n for n, p in params.items() if not p.requires_grad)
        self._late_reported = []

    def average(self, sent, average, process_set):
        """Reduce, in fp32, the gradients of parameters that were frozen when the optimizer was
        wrapped and are trainable now: Horovod hooks only the parameters trainable at
        construction, so without this each rank would step with its own gradient. Returns
        (name, reduced flat gradient) of each."""
        late = [n for n in self.frozen_at_start
                if self.params[n].requires_grad and n not in sent]
        if not late:
            return []
        if late != self._late_reported and self.verbose and hvd.rank() == 0:
            logger.warning("parameters trainable since the optimizer was wrapped, reduced in fp32 "
                           "by GIFT: %s", ", ".join(late))
        self._late_reported = late
        grads = []
        for n in late:
            p = self.params[n]
            if p.grad is None:          # as Horovod does: another rank may have a gradient for it
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to(torch.float32).reshape(-1))
        # one name for every step: ranks back from hvd.join() may count steps differently
        reduced = hvd.grouped_allreduce(grads, name="gift.unhooked",
                                        op=hvd.Average if average else hvd.Sum,
                                        process_set=process_set)
        for n, avg in zip(late, reduced):
            p = self.params[n]
            p.grad.copy_(avg.view(p.shape))
        return list(zip(late, reduced))


def node_process_sets(groups):
    """A Horovod process set for each list of ranks in groups, found among those Horovod has or
    added in that order (hvd.add_process_set, collective: every rank adds the same sets in the
    same order); None where some are missing and Horovod was not started with dynamic process
    sets. Horovod refuses a set added twice: a user's set of the same ranks is the one taken."""
    known = {tuple(ranks): set_id
             for set_id, ranks in process_sets._basics._get_process_set_ids_and_ranks().items()}
    if (any(tuple(group) not in known for group in groups)
            and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0")):
        return None
    found = []
    for group in groups:
        if tuple(group) in known:
            process_set = process_sets._temp_process_set_object(known[tuple(group)])
            process_set.ranks = group
        else:
            process_set = hvd.add_process_set(group)
            known[tuple(group)] = process_set.process_set_id
        found.append(process_set)
    return found
