"""How GIFT lays FSDP2's gradient reduction over nodes (reduce_scatter.py has the whole picture).

FSDP hands GIFT a buffer of `rows` rows, row k the k-th shard of every parameter of a group, to be
summed over the ranks of its group. With L ranks a node and N nodes (rank = node * L + local):

  OneHop    1-D FSDP, one hop: every rank quantizes all P rows, sends row k to rank k, which
            decodes P payloads and sums them in fp32 (what reduce_scatter.py always did).
  TwoHops   1-D FSDP over N x L ranks: an fp32 reduce-scatter inside the node first (local rank l
            receives rows l, L + l, 2L + l, ... of its L node mates and sums them), then the
            quantized hop of those N rows among the N ranks of local rank l, one a node. A rank
            quantizes N rows: 1/L of the group, and so holds 1/L of the one-hop residual.
  Hsdp      HSDP, mesh (replicas, shard): FSDP's reduce-scatter over the shard group (the node)
            stays in fp32, made by GIFT (internals.reduce_across_replicas_in_gift takes
            FSDP's own fp32 all-reduce across replicas away); its one row is then all-reduced
            across the N replicas, quantized: collective.BucketReduction (stage 1 to each
            1/N's owner, fp32 sum, stage 2 re-quantized and allgathered), so every replica ends
            with the same bits. One residual, r1 over the row (1/L of the group, residual_dtype):
            stage 2's error, over the owner's 1/N of the row, is folded into r1's same elements
            (times the divisor) once the reduction finishes, and re-enters the next step's sum
            through stage 1. A residual of its own would hold 1/N more; folding only at refresh
            steps (what 0.3's HSDP did) costs it as well.

Bytes across a node's link per gradient element a step (b: bits an element, scales included):
OneHop (P - L) / P * b / 8 * L; TwoHops (N - 1) / N * b / 8; Hsdp 2 (N - 1) / N * b / 8, against
HSDP's own 2 (N - 1) / N * 2 in bf16.
"""
import torch

from ..reduce.collective import BucketLayout, BucketReduction, Fp32Reduction, timed_wait
from ..reduce.feedback import fold_into
from ..reduce.node_aware import NodeAwareCommunicator


class OneHop:
    """Every row quantized by every rank and reduce-scattered over comm (all the ranks)."""

    def __init__(self, comm):
        self.comm = comm
        self.description = ("flat",)

    def describe(self):
        return "flat"

    def quantized_rows(self, rows):
        """How many of a buffer's rows this rank quantizes (its residual's rows)."""
        return rows

    def statistics_comm(self):
        """The communicator of the whitening statistics' refresh (collective to make)."""
        return self.comm

    def reduce(self, state, layout, rows, divisor):
        """This rank's row of the sum of every rank's rows (rows: fp32, its own buffer, may be
        overwritten), divided by divisor, and un-whitened."""
        state.whiten(layout, rows)
        mine = state.quantized_reduce_scatter(layout, rows, self.comm, divisor)
        return state.unwhiten(layout, mine)


class TwoHops(OneHop):
    """1-D FSDP over nodes: node, the communicator of this rank's node; cross, that of the ranks
    of its local rank, one a node."""

    def __init__(self, comm, node, cross):
        self.comm, self.node, self.cross = comm, node, cross
        self.description = ("two-hop", node.size)

    def describe(self):
        return f"two-hop: {self.cross.size} nodes x {self.node.size} ranks"

    def quantized_rows(self, rows):
        return rows // self.node.size

    def statistics_comm(self):
        """Across nodes the refresh crosses each node's link once (reduce/node_aware.py)."""
        return NodeAwareCommunicator(self.comm, self.node, self.cross)

    def reduce(self, state, layout, rows, divisor):
        summed = node_reduce_scatter(state, rows, self.node)
        state.whiten(layout, summed)
        mine = state.quantized_reduce_scatter(layout, summed, self.cross, divisor)
        return state.unwhiten(layout, mine)


class Hsdp(TwoHops):
    """HSDP: node, the shard group FSDP reduce-scatters over; cross, the replicate group."""

    def __init__(self, comm, node, cross):
        super().__init__(comm, node, cross)
        self.description = ("hsdp", node.size)

    def describe(self):
        return f"HSDP: {self.cross.size} replicas x {self.node.size} shards"

    def reduce(self, state, layout, rows, divisor):
        row = node_reduce_scatter(state, rows, self.node)
        state.whiten(layout, row)
        mine = self._replica_allreduce(state, layout, row.view(-1), divisor)
        return state.unwhiten(layout, mine)

    def _replica_allreduce(self, state, layout, row, divisor):
        coded = [i for i, tiny in enumerate(layout.small) if not tiny and layout.shards[i]]
        small = [i for i, tiny in enumerate(layout.small) if tiny and layout.shards[i]]
        flats = [_part(row, layout, i) for i in coded]
        residual = state.residual(layout, row.device)
        wide = None if residual is None else residual.to(torch.float32)
        bucket = BucketLayout.of(tuple(f.numel() for f in flats), self.cross.size,
                                 state.codec.align)
        # stage 2's error on the part this rank owns: fp32, for this step only
        second = None if wide is None or not flats else torch.zeros(
            bucket.owned[self.cross.rank], dtype=torch.float32, device=row.device)
        reduction = BucketReduction(
            "gift.fsdp.replicas", flats, state.codec, self.cross,
            residual1=None if wide is None else [_part(wide, layout, i) for i in coded],
            residual2=second,
            step=state.step, key=layout.key, divisor=divisor)
        fp32 = None
        if flats:
            reduction.start()
        if small:
            fp32 = Fp32Reduction("gift.fsdp.replicas.fp32",
                                 torch.cat([_part(row, layout, i) for i in small]), self.cross,
                                 divisor).start()
        if flats:
            reduction.exchange().finish(over_inputs=True)
            state.add_bounds(reduction.amax_bounds)
        if second is not None:    # r1[owned part] += divisor * e2: the sum was divided by it
            fold_into([_part(wide, layout, i) for i in coded], second,
                      bucket.pieces[self.cross.rank], divisor)
        if residual is not None and wide is not residual:
            residual.copy_(wide)
        if fp32 is not None:
            summed, offset = fp32.finish(), 0
            for i in small:
                _part(row, layout, i).copy_(summed[offset:offset + layout.shards[i]])
                offset += layout.shards[i]
            state.telemetry.add(bytes_sent=2 * 4 * fp32.chunk * (self.cross.size - 1))
        coded_elements = sum(f.numel() for f in flats)
        state.telemetry.add(elements=row.numel(), bytes_sent=reduction.bytes_sent,
                            payload_bytes=state.codec.payload_bytes(coded_elements)
                            if coded_elements else 0,
                            wait_seconds=reduction.wait_seconds)
        return row

def _part(flat, layout, i):
    """Parameter i's part of one row (flat)."""
    return flat[layout.offsets[i]:layout.offsets[i] + layout.shards[i]]


def node_reduce_scatter(state, rows, node):
    """rows: (R L, shard) fp32, row m L + l bound for local rank l of node m. Returns this local
    rank's R rows summed over the node's ranks in local-rank order, (R, shard) fp32: one fp32
    alltoall inside the node."""
    per_node = node.size
    count, shard = rows.shape[0] // per_node, rows.shape[1]
    send = rows.view(count, per_node, shard).transpose(0, 1).contiguous()
    splits = torch.full((per_node,), count * shard, dtype=torch.int32, device="cpu")
    (received, _), seconds = timed_wait(node.alltoall_async(send.view(-1), splits,
                                                            "gift.fsdp.node"))
    summed = received.view(per_node, count, shard).sum(0)
    state.telemetry.add(node_bytes_sent=send.numel() * 4 * (per_node - 1) // per_node,
                        wait_seconds=seconds)
    return summed

