"""What GIFT relies on in torchft 0.2.0 beyond its public API, in one place.

torchft's DiLoCo (torchft/local_sgd.py) builds one `_StreamingDiLoCoFragment` per model fragment
and offers no hook for its all-reduce. GIFT reads and replaces, per fragment:
- `DiLoCo._fragments`: the fragments, in fragment order;
- `fragment._fragment_id`, `fragment._model_fragment`: its index and its module;
- `fragment._average_grads()`: called by `prepare_sync()` once `fragment._grads` (parameter name
  -> pseudo-gradient, a new tensor on the parameter's device) is computed; it must leave in
  `fragment._allreduce_work` objects whose `wait()` `perform_sync()` calls before it reads
  `_grads` (replaced here by GIFT's reduction);
- `fragment.perform_sync()` returns `should_commit()`'s verdict (wrapped here to commit or roll
  back GIFT's residuals).
And of the Manager:
- `manager._group_world_size`: the ranks of this replica group (the Manager's world_size);
- `manager._pg`: the process group across replicas (configured at each quorum); its wrappers
  (`ProcessGroupWrapper`) do not report their rank (`rank()` is 0), `parent.rank()` does.
tests/integrations/test_torchft.py::test_the_private_torchft_attributes_gift_reads fails when
torchft changes any of these.
"""
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment
from torchft.manager import Manager

FRAGMENT_ATTRIBUTES = ("_fragment_id", "_model_fragment", "_grads", "_allreduce_work",
                       "_average_grads", "perform_sync")


def fragments(diloco: DiLoCo) -> list:
    return list(diloco._fragments)


def fragment_id(fragment: _StreamingDiLoCoFragment) -> int:
    return fragment._fragment_id


def fragment_module(fragment: _StreamingDiLoCoFragment):
    return fragment._model_fragment


def pseudo_gradients(fragment: _StreamingDiLoCoFragment) -> dict:
    """name -> the pseudo-gradient prepare_sync() computed; written over by the average."""
    return fragment._grads


def pending_works(fragment: _StreamingDiLoCoFragment) -> list:
    """The list of works perform_sync() waits for."""
    return fragment._allreduce_work


def replace_average(fragment: _StreamingDiLoCoFragment, average) -> None:
    """prepare_sync() calls average() instead of torchft's all-reduce."""
    fragment._average_grads = average


def wrap_perform_sync(fragment: _StreamingDiLoCoFragment, after) -> None:
    """after(committed) runs once perform_sync() has asked should_commit() and stepped."""
    perform_sync = fragment.perform_sync

    def wrapped():
        committed = perform_sync()
        after(committed)
        return committed
    fragment.perform_sync = wrapped


def group_world_size(manager: Manager) -> int:
    return manager._group_world_size


def process_group(manager: Manager):
    return manager._pg


def process_group_rank(pg) -> int:
    """This replica's rank in the process group across replicas."""
    parent = getattr(pg, "parent", None)
    if parent is None:
        raise ValueError(f"GIFT (torchft): cannot tell this replica's rank in a "
                         f"{type(pg).__name__}; use ProcessGroupGloo or ProcessGroupNCCL")
    return parent.rank()
