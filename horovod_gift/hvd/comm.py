"""Horovod as GIFT's engine: the Communicator (reduce/communicator.py) over a Horovod process
set, and the quantized allreduce of one tensor. The GIFT compressor (compressor.py) is the frontend
Horovod's DistributedOptimizer calls."""
from __future__ import annotations

import os
from typing import Optional

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from ..codec.tensor_codec import Codec
from ..reduce.collective import BucketReduction, name_key
from ..reduce.communicator import Communicator, Handle
from ..reduce.topology import choose_topology
from .internals import node_process_sets

HOROVOD_OPS = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}


# With it, Horovod's completion of a GPU operation makes the device's default stream wait for it
# instead of the host: a result read on another stream (GIFT's side stream) must wait there too.
ASYNC_COMPLETION = os.environ.get("HOROVOD_ENABLE_ASYNC_COMPLETION", "0") not in ("", "0")


class HorovodHandle(Handle):
    def __init__(self, handle):
        self.handle, self._result, self._done = handle, None, False

    def poll(self):
        return self._done or hvd.poll(self.handle)

    def failure(self, error):
        """Horovod's error (a peer raised, or stalled past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS),
        naming the collective: still Horovod's type, which hvd.elastic catches to restore."""
        return HorovodInternalError(f"GIFT: {self.what} failed: {error}")

    def wait(self):
        if not self._done:
            try:
                self._result = hvd.synchronize(self.handle)
            except HorovodInternalError as error:
                raise self.failure(error) from error
            self._done = True
            first = self._result[0] if isinstance(self._result, tuple) else self._result
            if ASYNC_COMPLETION and first.is_cuda:
                current = torch.cuda.current_stream(first.device)
                current.wait_stream(torch.cuda.default_stream(first.device))
        return self._result


class HorovodCommunicator(Communicator):
    """The ranks of a Horovod process set (the global one by default)."""

    def __init__(self, process_set=None):
        self.process_set = process_set or hvd.global_process_set

    # read when used: a GIFT may be made with a set this rank is not in, refused at its first step
    @property
    def size(self):
        return self.process_set.size()

    @property
    def rank(self):
        return self.process_set.rank()

    def _issue(self, start, tensor, name, **options):
        handle = self.named(HorovodHandle(None), name)
        try:
            handle.handle = start(tensor, name=name, process_set=self.process_set, **options)
        except HorovodInternalError as error:   # Horovod was shut down before this one
            raise handle.failure(error) from error
        return handle

    def alltoall_async(self, tensor, splits, name):
        return self._issue(hvd.alltoall_async, tensor, name, splits=splits)

    def allgather_async(self, tensor, name):
        return self._issue(hvd.allgather_async, tensor, name)

    def allreduce_async(self, tensor, op, name):
        return self._issue(hvd.allreduce_async, tensor, name, op=HOROVOD_OPS[op])

    def broadcast_async_(self, tensor, root, name):
        ranks = self.process_set.ranks
        return self._issue(hvd.broadcast_async_, tensor, name,
                           root_rank=ranks[root] if ranks else root)


def allreduce(tensor: torch.Tensor, name: str, format: str = "fp8_e4m3", op: Optional[int] = None,
              block_size: Optional[int] = None, rounding: str = "nearest", seed: int = 0,
              process_set: Optional[hvd.ProcessSet] = None) -> torch.Tensor:
    """Average (op=hvd.Average, the default) or sum (hvd.Sum) `tensor` over the ranks of a
    Horovod process set (the global one by default) through the quantized path, without
    transform or error feedback. Returns a new tensor of tensor's dtype, bit-identical on every
    rank."""
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"gift.allreduce({name!r}): op must be hvd.Average or hvd.Sum")
    if not tensor.is_floating_point():
        raise TypeError(
            f"gift.allreduce({name!r}): expected a floating-point tensor, got {tensor.dtype}"
        )
    codec = Codec(format, block_size, rounding, seed)
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous()
    reduction = BucketReduction(f"gift.allreduce.{name}", [flat], codec,
                                HorovodCommunicator(process_set), average=op == hvd.Average,
                                key=name_key(name))
    (result,) = reduction.start().exchange().finish()
    return result.view(tensor.shape).to(tensor.dtype)


def horovod_topology(kind, node_size, process_set):
    """The Topology (reduce/topology.py) of a GIFT over a Horovod process set: Flat, or TwoHop
    over the process sets of each node and across nodes (internals.node_process_sets), made where
    Horovod was started with dynamic process sets. Collective over every rank for "auto" and
    "two-hop" with the global set."""
    everyone = process_set is None or process_set.process_set_id == 0

    def node_comms(groups):
        found = node_process_sets(groups)
        if found is None:
            return None, ("Horovod has no process sets for the nodes and was not started with "
                          "dynamic ones: start it with hvd.init(process_sets='dynamic') and GIFT "
                          "adds them")
        rank, per_node = hvd.rank(), len(groups[0])
        node, cross = found[rank // per_node], found[len(groups) - per_node + rank % per_node]
        return (HorovodCommunicator(node), HorovodCommunicator(cross)), None
    return choose_topology(kind, node_size, HorovodCommunicator(process_set),
                           None if everyone else f"the ranks {process_set.ranks}",
                           (hvd.local_size(), hvd.local_rank()), node_comms,
                           "Horovod's global process set")
