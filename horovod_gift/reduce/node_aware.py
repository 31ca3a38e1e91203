"""All-reduces and broadcasts that cross each node's link once: the whitening statistics' refresh
(geometry/statistics.py) under two hops and HSDP.

A flat all-reduce of S bytes over N nodes of L ranks sends about 2 S (P - 1) / P across each
node's link (a ring) and a flat broadcast up to L S from the root's node (gloo sends to every
rank). Here an all-reduce is an alltoall reduce-scatter inside the node, an all-reduce of the
rank's 1/L across the nodes (among the ranks of its local rank) and an all-gather inside the
node: 2 S (N - 1) / N leave a node in all. A broadcast goes across the nodes among the root's
local rank only, then inside each node: S (N - 1) leave the root's node. At 2 x 4 (gloo) the
refresh's bytes across the link fall about 2.6x.

Every rank gets the same bits: local rank l sums chunk l of its node's ranks in local-rank order,
the cross all-reduce gives every node the same chunk, and the node all-gather hands it out.
"""
import math

import torch

from .communicator import Communicator, Handle

# below this many elements (votes, flags) one flat all-reduce: three collectives' latency costs
# more than the few bytes saved
SMALL = 4096


class NodeAwareCommunicator(Communicator):
    """comm's ranks, as nodes: node is this rank's node's communicator (its local rank), cross
    the communicator of its local rank's ranks, one a node (rank = node index). Collective over
    comm: every rank's (node index, local rank) is gathered once, so a root names its node and
    local rank."""

    def __init__(self, comm, node, cross):
        self.comm, self.node, self.cross = comm, node, cross
        self.size, self.rank = comm.size, comm.rank
        # host metadata, once: root -> (its node's index in cross, its local rank in node)
        mine = torch.tensor([[cross.rank, node.rank]], dtype=torch.int64, device="cpu")
        table = comm.allgather_async(mine, "gift.node_aware").wait().view(comm.size, 2)
        self.places = [tuple(place) for place in table.tolist()]

    def alltoall_async(self, tensor, splits, name):
        return self.comm.alltoall_async(tensor, splits, name)

    def allgather_async(self, tensor, name):
        return self.comm.allgather_async(tensor, name)

    def allreduce_async(self, tensor, op, name):
        if tensor.numel() < SMALL:
            return self.comm.allreduce_async(tensor, op, name)
        return _HierarchicalAllreduce(self, tensor, op, name)

    def broadcast_async_(self, tensor, root, name):
        root_node, root_local = self.places[root]
        across = (self.cross.broadcast_async_(tensor, root_node, f"{name}.cross")
                  if self.node.rank == root_local else None)
        return _HierarchicalBroadcast(self.node, tensor, root_local, f"{name}.node", across)


class _HierarchicalAllreduce(Handle):
    """Three stages, the later two started by wait(): handles are waited for in the same order on
    every rank, so their collectives are issued in one order (torch.distributed matches by it);
    poll() starts nothing, so it is False until then."""

    REDUCE = {"sum": lambda parts: parts.sum(0), "max": lambda parts: parts.amax(0),
              "min": lambda parts: parts.amin(0)}

    def __init__(self, comms, tensor, op, name):
        self.comms, self.op, self.name = comms, op, name
        self.shape, self.numel = tensor.shape, tensor.numel()
        per_node = comms.node.size
        self.chunk = math.ceil(self.numel / per_node)
        # padding reduces with padding only and is dropped
        padded = torch.zeros(self.chunk * per_node, dtype=tensor.dtype, device=tensor.device)
        padded[: self.numel] = tensor.reshape(-1)
        splits = torch.full((per_node,), self.chunk, dtype=torch.int32, device="cpu")
        self.stage, self.result = 0, None
        self.handle = comms.node.alltoall_async(padded, splits, f"{name}.node_scatter")

    def _advance(self):
        """Start the next stage with the current one's result."""
        value = self.handle.wait()
        if self.stage == 0:
            received, _ = value
            chunk = self.REDUCE[self.op](received.view(self.comms.node.size, self.chunk))
            self.handle = self.comms.cross.allreduce_async(chunk, self.op, f"{self.name}.cross")
        elif self.stage == 1:
            self.handle = self.comms.node.allgather_async(value, f"{self.name}.node_gather")
        else:
            self.result = value[: self.numel].view(self.shape)
        self.stage += 1

    def poll(self):
        return self.result is not None

    def wait(self):
        while self.result is None:
            self._advance()
        return self.result


class _HierarchicalBroadcast(Handle):
    """The cross-node stage (on the root's local rank only), then the node's broadcast, started
    by wait() (see _HierarchicalAllreduce)."""

    def __init__(self, node, tensor, root_local, name, across):
        self.node, self.tensor, self.root_local, self.name = node, tensor, root_local, name
        self.across, self.handle = across, None

    def _start_node_stage(self):
        if self.across is not None:
            self.across.wait()
        self.handle = self.node.broadcast_async_(self.tensor, self.root_local, self.name)

    def poll(self):
        return self.handle is not None and self.handle.poll()

    def wait(self):
        if self.handle is None:
            self._start_node_stage()
        return self.handle.wait()
