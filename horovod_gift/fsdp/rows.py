"""The reduce-scatter of an FSDP group's rows (state.py's GroupLayout), as FsdpGiftState's
Topology lays it (state.py's docstring says how each works): the fp32 reduce-scatter inside a
node, the whitening of the rows' linear weights, and the quantized hop: to each row's owner
(Flat, TwoHop) or all-reduced across HSDP's replicas (Hsdp). Functions of what they are given:
the state keeps the step, the residuals and the bounds they return."""
import torch

from ..reduce.collective import (
    BucketLayout,
    BucketReduction,
    Fp32Reduction,
    RowReduction,
    timed_wait,
)
from ..reduce.feedback import fold_into


def node_reduce_scatter(rows, node, telemetry):
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
    telemetry.add(node_bytes_sent=send.numel() * 4 * (per_node - 1) // per_node,
                  wait_seconds=seconds)
    return summed


def whiten_rows(layout, rows, whitened):
    """The whitening of every row's linear weights, in place (whole rows of each weight);
    whitened: (parameter index, Whitening) of the layout's whitened weights."""
    for i, whitening in whitened:
        part = layout.columns(rows, i)
        x = part.reshape(-1, whitening.in_features)   # a copy unless rows is one row
        y = whitening.forward(x, out=x)
        if y.data_ptr() != part.data_ptr():
            part.copy_(y.view(part.shape))


def unwhiten_row(layout, mine, whitened):
    """The inverse of whiten_rows on this rank's reduced row, in place; returns it."""
    for i, whitening in whitened:
        x = _part(mine, layout, i).view(-1, whitening.in_features)
        whitening.inverse(x, out=x)
    return mine


def quantized_reduce_scatter(layout, rows, codec, comm, residual, seed, divisor, telemetry):
    """Row k of rows (layout.ranks of them, fp32) quantized to comm's rank k, which sums the
    decoded rows in fp32, in rank order: (this rank's row of the sum divided by divisor, the
    encodes' magnitude bounds)."""
    reduction = RowReduction(layout, codec, comm, residual, seed)
    mine = reduction.run(rows, divisor)
    telemetry.add(**reduction.counts)
    return mine, reduction.amax_bounds


def replica_allreduce(layout, row, divisor, codec, cross, residual, step, telemetry):
    """Hsdp's quantized hop: the node's row all-reduced across the replicas (cross), in place;
    small parameters in fp32. Returns (row, the encodes' magnitude bounds)."""
    coded = [i for i, is_small in enumerate(layout.small) if not is_small and layout.shards[i]]
    small = [i for i, is_small in enumerate(layout.small) if is_small and layout.shards[i]]
    flats = [_part(row, layout, i) for i in coded]
    wide = None if residual is None else residual.to(torch.float32)
    bucket = BucketLayout.of(tuple(f.numel() for f in flats), cross.size, codec.align)
    # stage 2's error on the part this rank owns: fp32, for this step only
    second = None if wide is None or not flats else torch.zeros(
        bucket.owned[cross.rank], dtype=torch.float32, device=row.device)
    reduction = BucketReduction(
        "gift.fsdp.replicas", flats, codec, cross,
        residual1=None if wide is None else [_part(wide, layout, i) for i in coded],
        residual2=second, step=step, key=layout.key, divisor=divisor)
    fp32, bounds = None, []
    if flats:
        reduction.start()
    if small:
        fp32 = Fp32Reduction("gift.fsdp.replicas.fp32",
                             torch.cat([_part(row, layout, i) for i in small]), cross,
                             divisor).start()
    if flats:
        reduction.exchange().finish(over_inputs=True)
        bounds = reduction.amax_bounds
    if second is not None:    # r1[owned part] += divisor * e2: the sum was divided by it
        fold_into([_part(wide, layout, i) for i in coded], second,
                  bucket.pieces[cross.rank], divisor)
    if residual is not None and wide is not residual:
        residual.copy_(wide)
    if fp32 is not None:
        summed, offset = fp32.finish(), 0
        for i in small:
            _part(row, layout, i).copy_(summed[offset:offset + layout.shards[i]])
            offset += layout.shards[i]
        telemetry.add(bytes_sent=2 * 4 * fp32.chunk * (cross.size - 1))
    coded_elements = sum(f.numel() for f in flats)
    telemetry.add(elements=row.numel(), bytes_sent=reduction.bytes_sent,
                  payload_bytes=codec.payload_bytes(coded_elements) if coded_elements else 0,
                  wait_seconds=reduction.wait_seconds)
    return row, bounds


def _part(flat, layout, i):
    """Parameter i's part of one row (flat)."""
    return flat[layout.offsets[i]:layout.offsets[i] + layout.shards[i]]
