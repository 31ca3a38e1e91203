"""What GIFT relies on in Horovod 0.28.1's DistributedOptimizer beyond the Compressor interface.

Horovod calls `compress(p.grad)` and nothing else tells the compressor which optimizer it serves.
GIFT needs that optimizer's process set and op, so it reads them from the calling frame:
- `_DistributedOptimizer._allreduce_grad_async(self, p)` and `_grouped_allreduce_grad_async(self,
  ps)` call `self._compression.compress(...)`; `self.process_set` and `self.op` are attributes of
  that optimizer (horovod/torch/optimizer.py).
- `_DistributedAdasumOptimizer` compresses parameter deltas and has `_starting_models`.
- Sparse gradients (without sparse_as_dense) skip `compress` and reach `decompress(out, None)`.
- `synchronize()` sets `p.grad.set_(decompress(output, ctx))`.
mpi_tests/test_horovod_options.py fails if Horovod changes any of these.
"""
import sys
import warnings
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

# compress() <- _allreduce_grad_async, or <- a list comprehension <- _grouped_allreduce_grad_async
SEARCH_DEPTH = 6


def _frames(frame, depth):
    while frame is not None and depth > 0:
        yield frame
        frame, depth = frame.f_back, depth - 1


def calling_optimizer(compressor):
    """The Horovod optimizer whose hook is calling `compressor.compress` now, or None (a direct
    call). Found by the `self` of the calling frames: only an optimizer holds `_compression`."""
    for frame in _frames(sys._getframe(2), SEARCH_DEPTH):
        caller = frame.f_locals.get("self")
        if caller is not None and getattr(caller, "_compression", None) is compressor:
            return caller
    return None


def is_adasum(optimizer):
    return hasattr(optimizer, "_starting_models")


def describe_process_set(ps):
    return f"process set {ps.process_set_id} (ranks {ps.ranks})"


# GIFT instances in use: an optimizer stepping their parameters must use one
_LIVE = weakref.WeakSet()
_WARNED = weakref.WeakSet()
_GUARD = []


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
