"""How GIFT's reductions are laid over the ranks, for every frontend: one flat group (Flat), nodes
(TwoHop, two_hop.py) or HSDP's mesh (Hsdp). One family, one ABC (Topology):

- the core's bucket all-reduce (Horovod, DDP, DiLoCo) asks it for each bucket's reduction and
  for the part of a bucket this rank's stage-2 residual covers (ErrorFeedback folds it into r1
  there, and a checkpoint saved under one topology is re-expressed under another through it);
- FSDP2's reduce-scatter (fsdp/state.py) asks it how many rows this rank quantizes, which
  communicator the quantized hop takes (`across`) and whether an fp32 hop inside the node comes
  first (`node`); under Hsdp the quantized hop is an all-reduce across replicas.
Its `description` is a tuple the checkpoint keeps: ("flat",), ("two-hop", ranks a node) or
("hsdp", ranks a shard group).

Buckets smaller than the node size times the codec's alignment would leave a node chunk empty:
they take the flat reduction in both topologies.
"""
from abc import ABC, abstractmethod

import torch

from ..telemetry import logger
from .collective import BucketReduction, bucket_pieces
from .node_aware import NodeAwareCommunicator
from .two_hop import TwoHopLayout, TwoHopReduction


def takes_two_hops(sizes, node_size, codec):
    """Whether a bucket of tensors with these sizes is large enough for every node chunk."""
    return sum(sizes) >= node_size * codec.align


def owned_pieces(description, sizes, rank, ranks, codec):
    """The (tensor, lo, hi) parts of a bucket of tensors with these sizes whose stage-2 residual
    `rank` of `ranks` holds under the topology `description`, in the order of that residual."""
    if description[0] == "two-hop" and takes_two_hops(sizes, description[1], codec):
        node_size = description[1]
        layout = TwoHopLayout.of(tuple(sizes), node_size, ranks // node_size, codec.align, codec)
        return layout.owned_pieces(rank // node_size, rank % node_size)
    return bucket_pieces(sizes, ranks, codec.align)[rank]


def plan_nodes(views, ranks):
    """(ranks a node, None) for a two-hop reduction, or (None, why not). views: every rank's
    [node_size it was given (0: none), Horovod's local size, local rank, rank]. Raises, the same
    on every rank, when ranks were given different node sizes."""
    requested = sorted({view[0] for view in views})
    if len(requested) > 1:
        raise ValueError(f"GIFT: node_size differs across ranks ({requested}); pass the same "
                         "on every rank")
    node_size = requested[0]
    if not node_size:
        local_sizes = {view[1] for view in views}
        node_size = local_sizes.pop()
        if local_sizes or any(rank // node_size * node_size + local != rank
                              for _, _, local, rank in views):
            return None, ("Horovod's ranks do not lie in consecutive blocks of equal nodes "
                          "(node_size= says how many consecutive ranks share a node)")
    if ranks % node_size:
        return None, f"{ranks} ranks do not make nodes of {node_size}"
    if node_size == 1 or node_size == ranks:
        return None, (f"{ranks} ranks make " + ("one node" if node_size == ranks else
                                                 "nodes of one rank"))
    return node_size, None


def choose_topology(kind, node_size, comm, subset, launcher, node_comms, everyone):
    """The Topology of a reduction over comm, the same on every rank (every engine's planner).
    kind: "flat" | "two-hop" | "auto"; subset: None when comm holds every rank in order, else
    the words that name the ranks it holds (two hops reduce over every rank: `everyone`, in the
    engine's words); launcher: (local size, local rank) of this rank as its launcher placed it;
    node_comms(groups): this rank's node and cross communicators among groups (the nodes' ranks,
    then each local rank's across nodes; every rank makes every group, in order), or (None, why
    not). Collective over comm
    for "auto" and "two-hop": every rank decides the same, and raises the same error."""
    if kind == "flat":
        return Flat(comm)
    if subset is not None:
        if kind == "two-hop":
            raise ValueError(f"GIFT: topology='two-hop' reduces over every rank ({everyone}), "
                             f"but the gradients are reduced over {subset}; use topology='flat'")
        return Flat(comm)
    # every rank's view, even where each could decide alone: ranks given different node sizes
    # must all reach plan_nodes' error, not wait in a collective the others skip
    # host metadata: a communicator whose backend needs the device moves it there
    view = torch.tensor([[node_size or 0, *launcher, comm.rank]], dtype=torch.int64, device="cpu")
    views = comm.allgather_async(view, "gift.topology").wait().view(comm.size, -1).tolist()
    ranks = comm.size
    per_node, why = plan_nodes(views, ranks)
    if per_node is not None:
        groups = ([list(range(k, k + per_node)) for k in range(0, ranks, per_node)]
                  + [list(range(local, ranks, per_node)) for local in range(per_node)])
        comms, why = node_comms(groups)
        if comms is not None:
            if comm.rank == 0:
                logger.info("GIFT: two hops over %d nodes of %d ranks", ranks // per_node,
                            per_node)
            return TwoHop(comm, *comms)
    if kind == "two-hop":
        raise ValueError(f"GIFT: topology='two-hop' needs several nodes of several ranks: {why}")
    if per_node is not None and comm.rank == 0:
        logger.warning("GIFT: topology='auto' takes the flat reduction: %s", why)
    return Flat(comm)


class Topology(ABC):
    """One way to lay GIFT's reductions over the ranks. comm: every rank; node: this rank's node
    (its ranks in order) and cross: the ranks of its local rank, one a node (in node order), or
    None where there is one hop."""

    node = cross = None
    folds = True        # the rotation may add r1 in its own pass (TransformPlan.forward_folded)
    description = ("flat",)

    def __init__(self, comm):
        self.comm = comm

    @abstractmethod
    def describe(self):
        """The words stats() and the log give it."""

    def owned_pieces(self, sizes, codec):
        """The (tensor, lo, hi) parts of a bucket whose stage-2 residual this rank holds."""
        return owned_pieces(self.description, sizes, self.comm.rank, self.comm.size, codec)

    def reduction(self, name, flats, codec, residual1, residual2, average, step, maxima, key,
                  divisor=None):
        """The bucket's all-reduce (not started). divisor: what the sum is divided by, where it
        is not the ranks of an average (torchft's participants, integrations/torchft.py)."""
        return BucketReduction(name, flats, codec, self.comm, residual1, residual2,
                               average=average, step=step, maxima=maxima, key=key,
                               divisor=divisor)

    def quantized_rows(self, rows):
        """How many of a reduce-scatter buffer's rows this rank quantizes (its residual's)."""
        return rows // (self.node.size if self.node is not None else 1)

    def across(self):
        """The communicator of the quantized hop."""
        return self.cross if self.cross is not None else self.comm

    def statistics_comm(self):
        """The communicator of the whitening statistics' refresh (collective to make): across
        nodes it crosses each node's link once (node_aware.py)."""
        if self.node is None:
            return self.comm
        return NodeAwareCommunicator(self.comm, self.node, self.cross)


class Flat(Topology):
    """Every bucket reduced over comm, all ranks as one group (collective.py)."""

    def describe(self):
        return "flat"


class TwoHop(Topology):
    """Two hops (two_hop.py): fp32 inside the node, quantized across nodes, node_size
    consecutive ranks a node."""

    folds = False       # the node's sum is quantized, not u: r1 is added to it

    def __init__(self, comm, node, cross):
        super().__init__(comm)
        self.node, self.cross = node, cross
        self.description = ("two-hop", node.size)

    def describe(self):
        return f"two-hop: {self.cross.size} nodes x {self.node.size} ranks"

    def reduction(self, name, flats, codec, residual1, residual2, average, step, maxima, key,
                  divisor=None):
        if not takes_two_hops([f.numel() for f in flats], self.node.size, codec):
            return super().reduction(name, flats, codec, residual1, residual2, average, step,
                                     maxima, key, divisor)
        return TwoHopReduction(name, flats, codec, self.node, self.cross, residual1, residual2,
                               average=average, step=step, key=key, divisor=divisor)


class Hsdp(TwoHop):
    """HSDP's (replicas, shard) mesh: node, the shard group FSDP reduce-scatters over in fp32;
    cross, the replicate group, over which the quantized hop is an all-reduce of the node's row
    (FSDP's own would send it in fp32)."""

    def __init__(self, comm, node, cross):
        super().__init__(comm, node, cross)
        self.description = ("hsdp", node.size)

    def describe(self):
        return f"HSDP: {self.cross.size} replicas x {self.node.size} shards"
