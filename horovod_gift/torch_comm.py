"""torch.distributed as GIFT's engine: the Communicator (reduce/communicator.py) over a process
group, and the topology of a job launched with torchrun. The DDP hook (ddp.py) and the FSDP2
reduce-scatter (fsdp/reduce_scatter.py) are the frontends over it.

torch.distributed matches collectives by the order in which ranks issue them on a group, not by
name: the names of the Communicator interface are ignored here, and every frontend issues its
collectives in an order that is the same on every rank.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                                BroadcastOptions)

from .reduce.communicator import Communicator, Handle
from .reduce.topology import choose_topology

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor (and warns on the old names)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchHandle(Handle):
    """A torch.distributed Work and the tensor it fills (moved back to `home` once waited for:
    host metadata that travelled through a GPU-only backend). sent: the input, held until
    wait(): NCCL keeps an async op's tensors only until then, so on CUDA both are marked as used
    by the stream that waited (the engine's work is ordered before that stream's later work)."""

    def __init__(self, work, result, home=None, sent=None):
        self.work, self.result, self.home, self.sent = work, result, home, sent
        self._done = False

    def poll(self):
        return self._done or self.work.is_completed()

    def wait(self):
        if not self._done:
            try:
                self.work.wait()
            except RuntimeError as error:   # a peer that died, hangs or is slower than the timeout
                raise RuntimeError(f"GIFT: {self.what} failed: {error}") from error
            self._done = True
            for tensor in (self.sent, self.result):
                if tensor is not None and tensor.is_cuda:
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
            self.sent = None
            if self.home is not None:
                self.result = _to(self.result, self.home)
        return self.result


def _to(value, device):
    if isinstance(value, tuple):
        return tuple(v.to(device) for v in value)
    return value.to(device)


class TorchCommunicator(Communicator):
    """The ranks of a torch.distributed process group (the default group with None). Host
    tensors (GIFT's metadata) travel through `device` (the gradients': one GPU a rank; by
    default the current one) when the backend has no CPU support (NCCL)."""

    def __init__(self, group=None, device=None):
        self.group = group if group is not None else dist.group.WORLD
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.host_device = None
        if dist.get_backend(self.group) == "nccl":
            self.host_device = (torch.device(device) if device is not None and
                                torch.device(device).type == "cuda"
                                else torch.device("cuda", torch.cuda.current_device()))

    def _placed(self, tensor):
        """(tensor where the backend takes it, the device to return the result to or None)."""
        if self.host_device is not None and tensor.device.type == "cpu":
            return tensor.to(self.host_device), tensor.device
        return tensor, None

    def alltoall_async(self, tensor, splits, name):
        """splits must be the same on every rank (every caller's are): each rank receives
        splits[rank] elements from every rank, with no exchange of sizes first."""
        tensor, home = self._placed(tensor)
        sizes = splits.tolist()
        mine = sizes[self.rank]
        received = torch.empty(mine * self.size, dtype=tensor.dtype, device=tensor.device)
        work = dist.all_to_all_single(received, tensor, [mine] * self.size, sizes,
                                      group=self.group, async_op=True)
        counts = torch.full((self.size,), mine, dtype=torch.int32, device="cpu")
        return self.named(_AlltoallHandle(work, received, counts, home, tensor), name)

    def allgather_async(self, tensor, name):
        tensor, home = self._placed(tensor)
        out = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        sent = tensor.contiguous()
        work = ALL_GATHER(out, sent, group=self.group, async_op=True)
        return self.named(TorchHandle(work, out, home, sent), name)

    def allreduce_async(self, tensor, op, name):
        out, home = self._placed(tensor.clone())
        work = dist.all_reduce(out, op=TORCH_OPS[op], group=self.group, async_op=True)
        return self.named(TorchHandle(work, out, home), name)

    def broadcast_async_(self, tensor, root, name):
        placed, home = self._placed(tensor)
        work = dist.broadcast(placed, src=dist.get_global_rank(self.group, root),
                              group=self.group, async_op=True)
        return self.named(_BroadcastHandle(work, placed, tensor) if home is not None
                           else TorchHandle(work, tensor), name)


class ProcessGroupCommunicator(Communicator):
    """The Communicator of a ProcessGroup object called directly, for groups that
    torch.distributed does not know by name (torchft's, reconfigured at each quorum). rank: this
    process's rank in it (torchft's wrappers do not report it). Tensors stay where they are:
    GIFT hands it the gradients' device tensors only."""

    def __init__(self, pg, rank):
        self.pg, self.rank, self.size = pg, rank, pg.size()

    def alltoall_async(self, tensor, splits, name):
        sizes = splits.tolist()
        mine = sizes[self.rank]
        received = torch.empty(mine * self.size, dtype=tensor.dtype, device=tensor.device)
        work = self.pg.alltoall_base(received, tensor, [mine] * self.size, sizes,
                                     AllToAllOptions())
        counts = torch.full((self.size,), mine, dtype=torch.int32, device="cpu")
        return self.named(_AlltoallHandle(work, received, counts, None, tensor), name)

    def allgather_async(self, tensor, name):
        sent = tensor.contiguous()
        out = torch.empty((self.size * sent.shape[0], *sent.shape[1:]), dtype=sent.dtype,
                          device=sent.device)
        work = self.pg.allgather([list(out.chunk(self.size))], [sent], AllgatherOptions())
        return self.named(TorchHandle(work, out, None, sent), name)

    def allreduce_async(self, tensor, op, name):
        out, opts = tensor.clone(), AllreduceOptions()
        opts.reduceOp = TORCH_OPS[op]
        return self.named(TorchHandle(self.pg.allreduce([out], opts), out), name)

    def broadcast_async_(self, tensor, root, name):
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.named(TorchHandle(self.pg.broadcast([tensor], opts), tensor), name)


class _AlltoallHandle(TorchHandle):
    def __init__(self, work, received, counts, home, sent):
        super().__init__(work, received, home, sent)
        self.counts = counts

    def wait(self):
        return super().wait(), self.counts


class _BroadcastHandle(TorchHandle):
    """A broadcast into a host tensor through the backend's device: copied back into it."""

    def __init__(self, work, placed, tensor):
        super().__init__(work, placed)
        self.tensor = tensor

    def wait(self):
        if not self._done:
            self.tensor.copy_(super().wait())
        return self.tensor


def torch_topology(kind, node_size, group=None, device=None):
    """The Topology (reduce/topology.py) of a GIFT over a torch.distributed group: Flat, or TwoHop
    over a group for each node and one for each local rank across nodes. Collective over the group
    for "auto" and "two-hop"; node groups are made for the default group only. The launcher's
    local size is torchrun's LOCAL_WORLD_SIZE (1 where it is not set). device:
    TorchCommunicator's."""
    everyone = group is None or group is dist.group.WORLD

    def node_comms(groups):
        per_node = len(groups[0])
        # every rank makes every group, in the same order (torch.distributed's rule)
        node, _ = dist.new_subgroups_by_enumeration(groups[:-per_node])
        cross, _ = dist.new_subgroups_by_enumeration(groups[-per_node:])
        return (TorchCommunicator(node, device), TorchCommunicator(cross, device)), None
    launcher = (int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))
    return choose_topology(kind, node_size, TorchCommunicator(group, device),
                           None if everyone else "a subgroup", launcher, node_comms,
                           "the default process group")
