"""The state and the reduce-scatter of GIFT under FSDP2 (reduce_scatter.py is the frontend and
says how it works): where each parameter lies in a group's buffers (GroupLayout), and
FsdpGiftState, which holds the codec, the whitening statistics, the residuals and the step count
of one model, and quantizes rows; hops.py lays the reduction over nodes."""
import numpy as np
import torch

from ..codec.tensor_codec import TensorPieces
from ..config import GiftConfig
from ..core.state_base import NOTHING_PENDING, GiftStateBase, fingerprint
from ..geometry.linear_layers import linear_readers
from ..reduce.collective import RowReduction, mix_seed, name_key
from ..reduce.feedback import scrub
from ..telemetry import logger
from .internals import param_group, trained_fsdp_params


class GroupLayout:
    """An FSDP group's rows that one rank quantizes (`ranks` of them: all of FSDP's buffer in one
    hop, 1/L of it in two, hops.py), each of `shard` elements, row k holding every
    parameter's k-th shard (shards[i] elements at offsets[i]); the bytes GIFT sends for them:
    rows of row_bytes, parameter i's piece at byte_offsets[i] (codec payloads, or fp32 for
    the small ones, each rounded up to 4 bytes). pieces: the codec pieces of every row, for
    Codec.encode_pieces over the buffer and decode_pieces of the received rows (the same
    positions: row k of both comes from, or goes to, rank k)."""

    def __init__(self, names, shards, small, ranks, codec):
        self.names, self.shards, self.small, self.ranks = names, shards, small, ranks
        self.offsets = np.cumsum([0] + shards[:-1]).tolist()
        self.shard = sum(shards)
        sizes = [4 * m if tiny else -(-codec.payload_bytes(m) // 4) * 4
                 for m, tiny in zip(shards, small)]
        self.byte_offsets = np.cumsum([0] + sizes[:-1]).tolist()
        self.row_bytes = sum(sizes)
        coded = [i for i, tiny in enumerate(small) if not tiny and shards[i]]
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


class FsdpGiftState(GiftStateBase):
    """GIFT's state for one model under FSDP2: a GiftConfig (GiftConfig.for_fsdp's defaults;
    GiftConfig.refuse_for_fsdp says what FSDP cannot take) or its fields as keywords.

    error_feedback: see reduce_scatter.py and benchmarks/results/fsdp_feedback.md. topology:
    "auto" (two hops under 1-D FSDP when LOCAL_WORLD_SIZE, or node_size, makes several nodes of
    several ranks), "flat" or "two-hop"; under HSDP the mesh gives the nodes (hops.py). attach()
    sets `hops`. param_format: None (FSDP's fp32 parameter all-gather) or "fp8_e4m3"
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
        self.layouts, self.residuals = {}, {}   # module id -> GroupLayout; layout key -> r1
        self.unwhitened = set()  # whitenable weights FSDP shards on another dim than rows
        self.hops = None         # set by attach (hops.py)
        self._task = None        # the autograd graph task of the step under way
        self.device = None       # the gradients' (from the first reduce-scatter)
        self._bounds = []        # this step's bounds on the encodes' magnitudes (scrub)
        self._partial = set()    # groups reduced in fp32 (a parameter had no gradient), warned

    # ---------------------------------------------------------------- layout and step
    def use(self, hops):
        """Reduce through hops (hops.py): its comm holds every rank; the statistics take the
        communicator hops gives them (collective)."""
        self.hops = hops
        self.set_comm(hops.comm)
        self.statistics.comm = hops.statistics_comm()

    def begin(self, module, buffer, group):
        """At each reduce-scatter: the step's start at a backward's first (_begin_step); the
        GroupLayout of module's parameter group, or None when this buffer is not all of it
        (a trained parameter without a gradient this step: FSDP leaves it out)."""
        if self.device is None:
            self.device = buffer.device
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
        return GroupLayout(names, shards, small, self.hops.quantized_rows(rows), self.codec)

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
            scrub(list(self.residuals.values()), bounds)
        self._task = None
        self.count_step()

    def _refresh(self):
        for name, old in self.statistics.refresh().items():
            if name not in self.unwhitened:
                self._convert_residuals(name, old)

    def describe(self):
        return (f"GIFT (FSDP) {self.codec.format}, transform={self.config.transform}, "
                f"{self.hops.describe()}: {len(self.statistics.whitening)} weights whitened")

    def _whitened(self, layout):
        return [(i, self.statistics.whitening[n]) for i, n in enumerate(layout.names)
                if n in self.statistics.whitening and n not in self.unwhitened]

    # ---------------------------------------------------------------- the reduce-scatter
    def reduce_scatter(self, layout, output, buffer, divisor):
        """output <- this rank's row of the sum (divided by divisor) of every rank's buffer."""
        work = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        output.copy_(self.hops.reduce(self, layout, work.view(-1, layout.shard), divisor))

    def whiten(self, layout, rows):
        """Whitening of every row's linear weights, in place (whole rows of each weight)."""
        for i, whitening in self._whitened(layout):
            part = layout.columns(rows, i)
            x = part.reshape(-1, whitening.in_features)   # a copy unless rows is one row
            y = whitening.forward(x, out=x)
            if y.data_ptr() != part.data_ptr():
                part.copy_(y.view(part.shape))

    def unwhiten(self, layout, mine):
        """The inverse of whiten on this rank's reduced row, in place; returns it."""
        for i, whitening in self._whitened(layout):
            part = mine[layout.offsets[i]:layout.offsets[i] + layout.shards[i]]
            x = part.view(-1, whitening.in_features)
            whitening.inverse(x, out=x)
        return mine

    def quantized_reduce_scatter(self, layout, rows, comm, divisor):
        """Row k of rows (layout.ranks of them, fp32) quantized to comm's rank k, which sums the
        decoded rows in fp32, in rank order: this rank's row of the sum, divided by divisor."""
        seed = mix_seed(self.codec.seed, self.step, self.comm.rank, layout.key)
        reduction = RowReduction(layout, self.codec, comm, self.residual(layout, rows.device),
                                 seed)
        mine = reduction.run(rows, divisor)
        self._bounds += reduction.amax_bounds
        self.telemetry.add(**reduction.counts)
        return mine

    def add_bounds(self, bounds):
        """Bounds on the magnitudes of this step's encodes with a residual (_end_step's scrub)."""
        self._bounds += bounds

    def residual(self, layout, device):
        if not self.config.error_feedback:
            return None
        if layout.key not in self.residuals:
            self.residuals[layout.key] = torch.zeros(
                layout.ranks * layout.shard, dtype=self.config.residual_dtype, device=device)
        return self.residuals[layout.key]

    def _convert_residuals(self, name, old_factors):
        """A weight's residual pieces from its old whitened coordinates to the new ones."""
        whitening = self.statistics.whitening[name]
        for layout in self.layouts.values():
            if name in layout.names and layout.key in self.residuals:
                rows = self.residuals[layout.key].view(layout.ranks, layout.shard)
                part = layout.columns(rows, layout.names.index(name))
                # a copy: an fp32 residual whose columns are contiguous would be read in place,
                # and copy_ refuses a source that overlaps its destination
                x = part.reshape(-1, whitening.in_features).to(torch.float32, copy=True)
                whitening.inverse(x, factors=old_factors, out=x)
                part.copy_(whitening.forward(x, out=x).view(part.shape))

    # ---------------------------------------------------------------- checks and checkpoints
    def topology_description(self):
        return self.hops.description

    def agreed(self):
        shapes = [(n, tuple(p.shape)) for n, p in self.params.items()]
        return dict(super().agreed(), param_format=self.config.param_format,
                    model=fingerprint(shapes))

    def _rank_state(self):
        return {"rank": self.comm.rank, "ranks": self.comm.size,
                "topology": self.hops.description,
                "residuals": {k: r.to("cpu", copy=True) for k, r in self.residuals.items()},
                "statistics": self.statistics.local_state_dict()}

    def _load_rank_state(self, saved):
        self._pending_rank_state = NOTHING_PENDING
        saved = saved or {}
        here = (self.comm.rank, self.comm.size, self.hops.description)
        if (saved.get("rank"), saved.get("ranks"), saved.get("topology", ("flat",))) != here:
            if self.comm.rank == 0:
                logger.warning("GIFT (FSDP).load_state_dict: no residuals of this rank in this "
                               "job size and topology; they restart at zero")
            self.residuals = {}
            self.statistics.load_local_state_dict({})
            return
        self.residuals = {k: r.to(self.device, self.config.residual_dtype)
                          for k, r in saved["residuals"].items()}
        self.statistics.load_local_state_dict(saved["statistics"])

    def stats(self):
        """GIFT's counters (core.GiftCore.stats), the topology, and residual_bytes: what this
        rank's error-feedback residuals hold."""
        residuals = list(self.residuals.values())
        return dict(self.telemetry.stats(self.step, {}), topology=self.hops.describe(),
                    residual_bytes=sum(r.numel() * r.element_size() for r in residuals))
