"""The state of GIFT under FSDP2 (reduce_scatter.py is the frontend and says how it works):
where each parameter lies in a group's buffers (GroupLayout), and FsdpGiftState, which holds the
codec, the whitening statistics, the residuals and the step count of one model, and reduces a
group's rows over the ranks (rows.py) as its Topology (reduce/topology.py) lays them:

  Flat      1-D FSDP, one hop: every rank quantizes all P rows, sends row k to rank k, which
            decodes P payloads and sums them in fp32.
  TwoHop    1-D FSDP over N x L ranks: an fp32 reduce-scatter inside the node first (local rank l
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
Flat (P - L) / P * b / 8 * L; TwoHop (N - 1) / N * b / 8; Hsdp 2 (N - 1) / N * b / 8, against
HSDP's own 2 (N - 1) / N * 2 in bf16.
"""
import numpy as np
import torch

from ..codec.tensor_codec import TensorPieces
from ..config import GiftConfig
from ..core.state_base import GiftStateBase, PerRankState, fingerprint
from ..geometry.linear_layers import linear_readers
from ..reduce.collective import mix_seed, name_key
from ..reduce.feedback import scrub
from ..reduce.topology import Hsdp
from ..telemetry import logger
from .internals import param_group, trained_fsdp_params
from .rows import (
    node_reduce_scatter,
    quantized_reduce_scatter,
    replica_allreduce,
    unwhiten_row,
    whiten_rows,
)


class GroupLayout:
    """An FSDP group's rows that one rank quantizes (`ranks` of them: all of FSDP's buffer in one
    hop, 1/L of it in two, Topology.quantized_rows), each of `shard` elements, row k holding every
    parameter's k-th shard (shards[i] elements at offsets[i]); the bytes GIFT sends for them:
    rows of row_bytes, parameter i's piece at byte_offsets[i] (codec payloads, or fp32 for
    the small ones, each rounded up to 4 bytes). pieces: the codec pieces of every row, for
    Codec.encode_pieces over the buffer and decode_pieces of the received rows (the same
    positions: row k of both comes from, or goes to, rank k)."""

    def __init__(self, names, shards, small, ranks, codec):
        self.names, self.shards, self.small, self.ranks = names, shards, small, ranks
        self.offsets = np.cumsum([0] + shards[:-1]).tolist()
        self.shard = sum(shards)
        sizes = [4 * m if is_small else -(-codec.payload_bytes(m) // 4) * 4
                 for m, is_small in zip(shards, small)]
        self.byte_offsets = np.cumsum([0] + sizes[:-1]).tolist()
        self.row_bytes = sum(sizes)
        coded = [i for i, is_small in enumerate(small) if not is_small and shards[i]]
        rows = np.arange(ranks, dtype=np.int64)[:, None]
        starts = rows * self.shard + np.array([self.offsets[i] for i in coded], np.int64)
        ends = starts + np.array([shards[i] for i in coded], np.int64)
        offsets = rows * self.row_bytes + np.array([self.byte_offsets[i] for i in coded],
                                                   np.int64)
        chunks = rows * len(names) + np.array(coded, np.int64)
        self.pieces = TensorPieces(starts.reshape(-1), ends.reshape(-1), offsets.reshape(-1),
                                   chunks.reshape(-1))
        self.key = name_key(",".join(names))

    def columns(self, rows, i, width=None):
        """Parameter i's part of every row of rows ((ranks, shard) elements, or (ranks,
        row_bytes) bytes with width=its byte size)."""
        start = self.byte_offsets[i] if width is not None else self.offsets[i]
        return rows[:, start:start + (width or self.shards[i])]


class RowResiduals(PerRankState):
    """FSDP's error-feedback residuals, this rank's own: one r1 a parameter group, over the rows
    this rank quantizes (by the group's layout key), in dtype; usable only under the topology
    they were made in (it lays the rows out)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.by_group = {}      # layout key -> r1
        self.topology = None    # the state's Topology, set with it (FsdpGiftState.use)
        self.device = None      # the gradients' (from the first reduce-scatter)

    def of(self, layout, device):
        """The r1 of layout's group, made (zero, on device) the first time."""
        if layout.key not in self.by_group:
            self.by_group[layout.key] = torch.zeros(layout.ranks * layout.shard,
                                                    dtype=self.dtype, device=device)
        return self.by_group[layout.key]

    def state(self):
        return {"topology": self.topology.description,
                "residuals": {k: r.to("cpu", copy=True) for k, r in self.by_group.items()}}

    def unusable(self, saved):
        topology = saved.get("topology", ("flat",))
        if topology != self.topology.description:
            return f"it was saved with topology {topology}, here {self.topology.description}"
        return None

    def restore(self, saved):
        self.by_group = {k: r.to(self.device, self.dtype) for k, r in saved["residuals"].items()}

    def forget(self):
        self.by_group = {}

    def tensors(self):
        return list(self.by_group.values())


class FsdpGiftState(GiftStateBase):
    """GIFT's state for one model under FSDP2: a GiftConfig (GiftConfig.for_fsdp's defaults;
    GiftConfig.refuse_for_fsdp says what FSDP cannot take) or its fields as keywords.

    error_feedback: see reduce_scatter.py and benchmarks/results/fsdp_feedback.md. topology:
    "auto" (two hops under 1-D FSDP when LOCAL_WORLD_SIZE, or node_size, makes several nodes of
    several ranks), "flat" or "two-hop"; under HSDP the mesh gives the nodes. attach() sets
    `topology`. param_format: None (FSDP's fp32 parameter all-gather) or "fp8_e4m3"
    (allgather.py).
    """

    label = "GIFT (FSDP)"
    CONFIG_ADDED = {"param_format": None}    # 0.3.0's first FSDP checkpoints all-gathered fp32

    def __init__(self, model, config=None, **options):
        config = GiftConfig.of(config, GiftConfig.for_fsdp, options)
        config.refuse_for_fsdp()
        params = dict(model.named_parameters())
        # whitened: trained weights of linear modules stored (out, in), whose rows FSDP shards
        readers = linear_readers(model, params) if config.transform == "whiten" else {}
        whitenable = {n: params[n] for n, modules in readers.items()
                      if params[n].requires_grad and params[n].numel() >= config.min_elements
                      and all(layout.layout == "out_in" for _, _, layout in modules)}
        super().__init__(model, config, whitenable, comm=None)
        self.name_of = {id(p): n for n, p in self.params.items()}
        self.modules = []       # the fully_shard modules whose reduce-scatter is GIFT's
        self.layouts = {}       # module id -> GroupLayout
        self.own = RowResiduals(config.residual_dtype)
        self.unwhitened = set()  # whitenable weights FSDP shards on another dim than rows
        self.topology = None     # set by attach (reduce/topology.py)
        self._task = None        # the autograd graph task of the step under way
        self._bounds = []        # this step's bounds on the encodes' magnitudes (scrub)
        self._partial = set()    # groups reduced in fp32 (a parameter had no gradient), warned

    # ---------------------------------------------------------------- layout and step
    def use(self, topology):
        """Reduce as topology lays it: its comm holds every rank; the statistics take the
        communicator it gives them (collective)."""
        self.topology = self.own.topology = topology
        self.set_comm(topology.comm)
        self.statistics.comm = topology.statistics_comm()

    def begin(self, module, buffer, group):
        """At each reduce-scatter: the step's start at a backward's first (_begin_step); the
        GroupLayout of module's parameter group, or None when this buffer is not all of it
        (a trained parameter without a gradient this step: FSDP leaves it out)."""
        if self.own.device is None:
            self.own.device = buffer.device
        if not self.layouts:    # every group's, before a refresh re-expresses their residuals
            for known in self.modules:
                self.layouts[id(known)] = self._layout(known, group.size())
        self._begin_step()
        layout = self.layouts[id(module)]
        if group.size() * layout.shard == buffer.numel():
            return layout
        if layout.key not in self._partial and self.comm.rank == 0:
            logger.warning("GIFT (FSDP): a parameter of %s had no gradient: the group is "
                           "reduced in fp32 whenever that happens", ", ".join(layout.names))
        self._partial.add(layout.key)
        return None

    def _layout(self, module, rows):
        """Its parameter group's GroupLayout (rows: FSDP's buffer's): the parameters that
        train, in FSDP's order."""
        fsdp_params = trained_fsdp_params(param_group(module))
        names = [self.name_of[id(param)] for param, _, _ in fsdp_params]
        self.unwhitened.update(name for (_, dim, _), name in zip(fsdp_params, names)
                               if dim != 0)   # rows not sharded whole
        shards = [shard for _, _, shard in fsdp_params]
        small = [self.params[n].numel() < self.config.min_elements for n in names]
        return GroupLayout(names, shards, small, self.topology.quantized_rows(rows), self.codec)

    def _begin_step(self):
        """At a backward's first reduce-scatter: the rank check (first step), the statistics'
        refresh (due steps), and the step's end queued after backward."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task == self._task:
            return
        self._task = task
        self.settle_ranks()
        self.refresh_statistics()
        if task != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
        else:
            self._end_step()

    def _end_step(self):
        """After backward: the residuals an encode of this step may have made non-finite back
        to zero (one verdict for the whole step: one host sync), and the step counted."""
        bounds, self._bounds = self._bounds, []
        if bounds:
            scrub(self.own.tensors(), bounds)
        self._task = None
        self.count_step()

    def _refresh(self):
        for name, old in self.statistics.refresh().items():
            if name not in self.unwhitened:
                self._convert_residuals(name, old)

    def describe(self):
        return (f"GIFT (FSDP) {self.codec.format}, transform={self.config.transform}, "
                f"{self.topology.describe()}: {len(self.statistics.whitening)} weights whitened")

    def _whitened(self, layout):
        return [(i, self.statistics.whitening[n]) for i, n in enumerate(layout.names)
                if n in self.statistics.whitening and n not in self.unwhitened]

    # ---------------------------------------------------------------- the reduce-scatter
    def reduce_scatter(self, layout, output, buffer, divisor):
        """output <- this rank's row of the sum (divided by divisor) of every rank's buffer:
        fp32 inside the node first where the topology has nodes, then the quantized hop
        (rows.py)."""
        work = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        rows, topology = work.view(-1, layout.shard), self.topology
        if topology.node is not None:
            rows = node_reduce_scatter(rows, topology.node, self.telemetry)
        whitened = self._whitened(layout)
        whiten_rows(layout, rows, whitened)
        residual = self.residual(layout, rows.device)
        if isinstance(topology, Hsdp):
            mine, bounds = replica_allreduce(layout, rows.view(-1), divisor, self.codec,
                                             topology.cross, residual, self.step,
                                             self.telemetry)
        else:
            seed = mix_seed(self.codec.seed, self.step, self.comm.rank, layout.key)
            mine, bounds = quantized_reduce_scatter(layout, rows, self.codec, topology.across(),
                                                    residual, seed, divisor, self.telemetry)
        self._bounds += bounds
        output.copy_(unwhiten_row(layout, mine, whitened))

    def residual(self, layout, device):
        return self.own.of(layout, device) if self.config.error_feedback else None

    def _convert_residuals(self, name, old_factors):
        """A weight's residual pieces from its old whitened coordinates to the new ones."""
        whitening = self.statistics.whitening[name]
        for layout in self.layouts.values():
            if name in layout.names and layout.key in self.own.by_group:
                rows = self.own.by_group[layout.key].view(layout.ranks, layout.shard)
                part = layout.columns(rows, layout.names.index(name))
                # a copy: an fp32 residual whose columns are contiguous would be read in place,
                # and copy_ refuses a source that overlaps its destination
                x = part.reshape(-1, whitening.in_features).to(torch.float32, copy=True)
                whitening.inverse(x, factors=old_factors, out=x)
                part.copy_(whitening.forward(x, out=x).view(part.shape))

    # ---------------------------------------------------------------- checks and checkpoints
    def agreed(self):
        shapes = [(n, tuple(p.shape)) for n, p in self.params.items()]
        return dict(super().agreed(), param_format=self.config.param_format,
                    model=fingerprint(shapes))

    def stats(self) -> dict:
        """GIFT's counters (GiftStateBase.stats) and the topology."""
        return dict(super().stats(), topology=self.topology.describe())

