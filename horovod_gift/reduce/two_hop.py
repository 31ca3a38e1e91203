"""The two-hop quantized allreduce, for nodes of several GPUs (NVLink inside, a NIC each across).

The flat reduction (collective.py) sends (P - L) / P of every rank's bucket across nodes (P
ranks, L a node): its bytes per NIC grow with L, where a ring allreduce's do not. With N = P / L
nodes, rank (node k, local rank l) and a bucket of flat fp32 tensors u_1..u_m:
  1. Inside the node, a reduce-scatter in fp32: the bucket is cut into L node chunks; local rank
     l receives every local rank's node chunk l (one alltoall over the node) and sums them in
     local-rank order, s_l = sum_j u_j[chunk l] (NVLink carries fp32 cheaply).
  2. Across nodes, the flat quantized reduction of s_l among the N ranks of local rank l (one
     per node): stage 1 quantizes s_l + r1 (r1: the node sum's residual), the owner of each
     1/N of it decodes, sums in node order, divides by P for an average, adds r2, re-quantizes,
     and an allgather over those N ranks gives each the same bytes of all of chunk l.
  3. Inside the node, an allgather of step 2's bytes (each padded to the largest node chunk's),
     and every rank decodes the L x N payloads: the same bytes and scales on every rank of every
     node, so the results are bit-identical. Each rank's slot ends with a flag: whether its hop
     across nodes succeeded. A rank whose hop raised still takes part in the node's allgather
     (its peers wait for it there) and then raises; its node peers raise too, naming it (CPU
     tensors), or return every tensor of the bucket non-finite (CUDA: no host sync a bucket).
     This covers a group across nodes that fails on every member (an engine's abort, torchft's
     on a lost replica); one that fails on some members only leaves the other nodes to their
     collectives' timeout.
Bytes across nodes per rank: about 2 (N - 1) / N * (elements / L) * bits / 8: 1/L of the flat
reduction's. Inside the node: (L - 1) / L of the bucket in fp32 and the step-2 bytes L - 1 times.

Error feedback: r1 is kept per parameter, as in the flat reduction, and its node chunk (the part
of a tensor in this rank's chunk l) is the residual of step 2's first quantization. Where r1 holds
values outside that part (after a change of basis mapped it, or after loading a checkpoint), the
whole r1 is added to u before step 1 (ErrorFeedback.spread): the node's sum then carries it.
"""
import functools

import numpy as np
import torch

from ..codec.tensor_codec import TensorPieces
from .collective import BucketLayout, BucketReduction, mix_seed, timed_wait
from .pipeline import Reduction

FLAG_BYTES = 16     # a node allgather slot's trailer: its first byte is 1 if the hop succeeded


class TwoHopLayout:
    """Where a bucket's pieces lie for L ranks a node and N nodes, made once per (sizes, L, N,
    codec) and cached (TwoHopLayout.of): the node chunks (node_pieces[l]: (tensor, lo, hi)), their
    elements (the fp32 alltoall's splits), each node chunk's layout across nodes (cross[l], over
    its pieces as flats), the slot every local rank's step-2 bytes take in the node's allgather,
    and per tensor its pieces in that allgather's output (gathered[i])."""

    def __init__(self, sizes, node_size, nodes, align, codec):
        node = BucketLayout.of(sizes, node_size, align)
        self.node_pieces, self.node_elements = node.pieces, node.owned
        # per node chunk, where each of its pieces starts in the chunk's sum
        self.node_offsets = [np.cumsum([0] + [hi - lo for _, lo, hi in chunk]).tolist()
                             for chunk in node.pieces]
        self.splits = torch.tensor(node.owned, dtype=torch.int32, device="cpu")
        self.cross = [BucketLayout.of(tuple(hi - lo for _, lo, hi in chunk), nodes, align, codec)
                      for chunk in node.pieces]
        # the last FLAG_BYTES: the flag (the padding keeps each slot as aligned as the largest)
        self.slot = max(nodes * layout.slot for layout in self.cross) + FLAG_BYTES
        per_tensor = [[] for _ in sizes]
        for local, (chunk, layout) in enumerate(zip(node.pieces, self.cross)):
            for j, (i, lo, _) in enumerate(chunk):
                pieces = layout.gathered[j]
                per_tensor[i].append((pieces.starts + lo, pieces.ends + lo,
                                      pieces.offsets + local * self.slot, pieces.chunks))
        self.gathered = [TensorPieces(*(np.concatenate(part) for part in zip(*parts)), i)
                         for i, parts in enumerate(per_tensor)]

    def owned_pieces(self, node, local):
        """The (tensor, lo, hi) parts of the bucket whose stage-2 residual rank (node, local)
        holds, in the order of its r2."""
        chunk = self.node_pieces[local]
        return [(chunk[j][0], chunk[j][1] + lo, chunk[j][1] + hi)
                for j, lo, hi in self.cross[local].pieces[node]]

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def of(sizes, node_size, nodes, align, codec):
        return TwoHopLayout(sizes, node_size, nodes, align, codec)


class TwoHopReduction(Reduction):
    """A BucketReduction's interface (start, ready, exchange, finish; stage and final_stage) over
    two communicators: `node` (the L ranks of this rank's node, in local-rank order) and `cross`
    (the N ranks of this local rank, in node order). residual1: r1 of each flat, whole (the part in
    this rank's node chunk is read and written); residual2: this rank's share of its node chunk.
    Stages: 1 the node's fp32 alltoall is in flight, 2 and 3 the flat reduction across nodes, 4 the
    node's allgather, 5 finished."""

    final_stage = 4

    def __init__(self, name, flats, codec, node, cross, residual1=None, residual2=None,
                 average=True, step=0, key=0, divisor=None):
        self.name, self.flats, self.codec, self.node, self.cross = name, flats, codec, node, cross
        self.residual1_whole, self.residual2 = residual1, residual2
        # as BucketReduction's: every rank of every node for an average, 1 for a sum
        self.divisor = divisor or (node.size * cross.size if average else 1)
        self.step, self.key = step, key
        self.layout = TwoHopLayout.of(tuple(f.numel() for f in flats), node.size, cross.size,
                                      codec.align, codec)
        self.device = flats[0].device
        self.stage, self.across = 0, None   # across: step 2's BucketReduction
        self.failed = None      # the error step 2 raised on this rank, kept until finish
        self.node_bytes_sent, self.node_wait_seconds = 0, 0.0

    # what the pipeline, the scrub and the telemetry read: step 2's, once it has started
    @property
    def residual1(self):
        return self.across.residual1 if self.across else None

    @property
    def amax_bounds(self):
        return self.across.amax_bounds if self.across else []

    @property
    def bytes_sent(self):
        return self.node_bytes_sent + (self.across.bytes_sent if self.across else 0)

    @property
    def wait_seconds(self):
        return self.node_wait_seconds + (self.across.wait_seconds if self.across else 0.0)

    def _wait(self):
        out, seconds = timed_wait(self._handle)
        self._handle = None     # its buffers go as soon as this stage is done
        self.node_wait_seconds += seconds
        if isinstance(out, tuple):      # an alltoall's (received, their sizes)
            out = out[0]
        if out.is_cuda:     # allocated by the engine, read on this stream
            out.record_stream(torch.cuda.current_stream(out.device))
        return out

    def start(self):
        send = torch.cat(self.flats) if len(self.flats) > 1 else self.flats[0]
        me = self.node.rank
        self.node_bytes_sent += 4 * (send.numel() - self.layout.node_elements[me])
        self._handle = self.node.alltoall_async(send, self.layout.splits,
                                                f"{self.name}.node_scatter")
        self.stage = 1
        return self

    def ready(self):
        if self.stage in (2, 3):
            return self.failed is not None or self.across.ready()
        return self._handle.poll()

    def _across_nodes(self, step):
        """step() of the hop across nodes, unless an earlier one raised; an error is kept, not
        raised: this rank's node peers wait for it in the node's allgather, which tells them."""
        if self.failed is None:
            try:
                return step()
            except Exception as error:     # raised by finish, on every rank of the node
                self.failed = error
        return None

    def exchange(self):
        """The next stage whose collective has arrived (stages 1 to 3)."""
        if self.stage == 1:
            self._sum_node()
        elif self.stage == 2:
            self._across_nodes(self.across.exchange)
        else:
            self._share_across_node(self._across_nodes(self.across.gathered))
            return self
        self.stage += 1
        return self

    def _sum_node(self):
        received = self._wait()
        local = self.node.rank
        rows = received.view(self.node.size, -1)
        total = rows[0].clone()
        for row in rows[1:]:    # in local-rank order: the same sum whatever arrived first
            total.add_(row)
        chunk, offsets = self.layout.node_pieces[local], self.layout.node_offsets[local]
        flats = [total[a:b] for a, b in zip(offsets, offsets[1:])]
        residual1 = (None if self.residual1_whole is None else
                     [self.residual1_whole[i][lo:hi] for i, lo, hi in chunk])
        self.across = BucketReduction(
            f"{self.name}.l{local}", flats, self.codec, self.cross, residual1, self.residual2,
            step=self.step, key=mix_seed(self.key, local), divisor=self.divisor)
        self._across_nodes(self.across.start)
        self.across.flats = None    # only start() reads the node's sum: freed once encoded

    def _share_across_node(self, gathered):
        """gathered: step 2's bytes, or None where it failed on this rank."""
        out = torch.zeros(self.layout.slot, dtype=torch.uint8, device=self.device)
        if gathered is not None:
            out[: gathered.numel()] = gathered
            out[-FLAG_BYTES] = 1
        self.node_bytes_sent += out.numel() * (self.node.size - 1)
        self._handle = self.node.allgather_async(out, f"{self.name}.node_gather")
        self.stage = 4

    def finish(self, over_inputs=False):
        """The reduced tensors, flat fp32, identical on every rank of every node (over_inputs: as
        BucketReduction.finish)."""
        gathered = self._wait()
        self.stage = 5
        if self.failed is not None:
            raise self.failed
        flags = gathered.view(self.node.size, -1)[:, -FLAG_BYTES]
        if flags.device.type == "cpu":      # read on the host at no cost: raise, naming them
            failed = [local for local, flag in enumerate(flags.tolist()) if not flag]
            if failed:
                raise RuntimeError(f"GIFT: {self.name}: the hop across nodes failed on local "
                                   f"rank(s) {failed} of this node (their own error says why); "
                                   "every rank of the node raises")
        out = self.flats if over_inputs else [torch.empty_like(f) for f in self.flats]
        for i, pieces in enumerate(self.layout.gathered):
            self.codec.decode_pieces(gathered, pieces, out[i])
        if flags.device.type != "cpu":
            # no host sync on the step's path, and no pass over the bucket: where a peer failed,
            # the first element of every tensor comes back NaN, and the frontend's non-finite
            # rule applies (DiLoCo discards the outer step)
            nan_first_elements(out, (flags == 0).any())
        return out


def nan_first_elements(tensors, failed):
    """Where failed (a bool tensor of one element) is true, the first element of every tensor
    becomes NaN; where it is false, every bit stays (x * 1 keeps -0, infinities and
    subnormals). One foreach multiply, not a kernel a tensor, and nothing read on the host."""
    firsts = [t[:1] for t in tensors if t.numel()]
    if firsts:
        torch._foreach_mul_(firsts, torch.where(failed, float("nan"), 1.0).to(firsts[0].dtype))
