"""GIFT: a horovod.torch Compressor that sends gradients as FP8 or NVFP4.

    compression = gift.GIFT(model, format="nvfp4", transform="auto", error_feedback=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)

Per step and parameter g (Horovod calls compress(g) when g is ready, decompress(out, ctx) in
synchronize()):
    u = T(g)                  T: K-FAC input whitening for linear weights, randomized Hadamard
                              rotation, both, or neither (see TRANSFORMS)
    sum or avg(u) over ranks  quantized reduce-scatter + allgather of buckets (collective.py),
                              with error feedback on both quantization stages
    g_avg = T^{-1}(avg(u))    identical bytes, scales and T on every rank: bit-identical result
compress returns a one-element placeholder for Horovod's own allreduce and launches the bucket's
first stage once all its members are in; each later compress moves every bucket whose collective
has arrived to its next stage (pipeline.py: stage 2 and decoding inside backward, never
waiting), and the first decompress of a step starts the rest's second stages. Tensors under
`min_elements`, sparse gradients and steps in which a rank has called hvd.join() take Horovod's
own fp32 reduction.
"""
import functools
import gc
import time
import weakref
from dataclasses import dataclass, field

import torch
import horovod.torch as hvd
from horovod.torch.compression import Compressor
from torch.profiler import record_function

from . import horovod_internals as internals
from .horovod_frontend import HorovodCommunicator, horovod_topology
from .checkpoint import Checkpointing
from .codec import Codec
from .collective import fill_buckets
from .config import check_arguments
from .feedback import ErrorFeedback
from .kernels.native import CompileCount
from .linear_layers import linear_readers
from .pipeline import StagePipeline
from .rotation import HadamardRotation
from .statistics import WhiteningStatistics
from .telemetry import Reporting, Telemetry, logger
from .transforms import WHITENING_TRANSFORMS, TransformPlan

HOROVOD_DTYPES = (torch.float16, torch.float32, torch.float64)


@dataclass
class StepState:
    """What GIFT knows about the step in flight; a new one starts each step."""
    in_step: bool = False                 # the step's first gradient has arrived
    outstanding: int = 0                  # tensors handed to Horovod and not yet decompressed
    sent: set = field(default_factory=set)           # names of the parameters compressed
    joined: bool = False                  # a rank is in hvd.join(): every tensor goes fp32
    plain: bool = False                   # every tensor takes Horovod's fp32 path (join, warm-up)
    u: dict = field(default_factory=dict)            # name -> transformed flat gradient
    maxima: dict = field(default_factory=dict)       # name -> its pieces' amax bits, if folded
    shapes: dict = field(default_factory=dict)       # name -> (shape, dtype) of the gradient
    pipeline: StagePipeline = None        # the step's bucket reductions


REFRESH_EVERY = 4       # steps between whitening refreshes (the class docstring says why)
STAT_WINDOW = 5         # steps in the statistics' EMA


class GIFT(Checkpointing, Reporting, Compressor):
    """State of the low-precision gradient exchange for one model (see the module docstring).

    format: "nvfp4" | "fp8_e4m3" | "fp8_e5m2"; block_size: FP8 scale block (None: per tensor);
    error_feedback: keep each stage's quantization error and add it back next step; nonfinite:
    "nan" (a non-finite gradient comes back NaN on every rank) or "raise" (every rank raises).
    process_set: None (the default) takes the process set of the Horovod optimizer that uses this
    compressor; a set given here must be that optimizer's, or every rank raises at the first step.

    Geometry (benchmarks/results/fidelity.md measures each choice on a small Llama's gradients, with
    statistics from earlier batches only, as training has them):
    transform: "whiten" (the default) whitens the gradient of every compressed weight of a linear
    module (nn.Linear, transformers' Conv1D, classes given to gift.register_linear; a weight tied to
    an LM head, by the head's input: linear_layers.py) with the symmetric inverse root of its input
    statistic (geometry.py) and sends other tensors as they are. At step 100 it cuts the round-trip
    error 2.2-2.5x for FP8 E5M2 and NVFP4, and the error of AdamW's update direction 2.0-2.4x.
    "whiten+hadamard" adds a randomized Hadamard rotation: 3-14 % less Euclidean error, but 33-56 %
    more error in AdamW's update (it moves error onto coordinates with small second moments);
    "hadamard" alone does the same without the gain. "auto" picks per tensor among none / hadamard /
    whiten / whiten+hadamard by the Euclidean round-trip error on each refresh step (4 codec round
    trips per tensor there): use it with SGD-like optimizers, where the Euclidean error is what
    counts. "none": no transform.
    whitening_rank: eigenpairs of each input statistic kept; the cost is O(out * in * rank) per
    gradient and O(in * rank) memory. 64 gains 2-6 % over 32; 16 loses 7-15 %.
    damping: the floor added to the statistic, relative to its mean eigenvalue tr(A) / in. 1.0 was
    best of 0.01 ... 3 (0.1: 1.3x more error, 3: 1.1x); lower it only with fresher statistics.
    refresh_every: steps between recomputations of the whitening factors (an allreduce of
    in * (rank + 21) floats, an O(in * rank^2) factorization on one rank, a broadcast, per input).
    Statistics one step old gave 7 % less error than five steps old, and 1.3x less than 20.
    stat_window: the statistics are an EMA over steps with decay 1 - 1 / stat_window. 5 came
    within 3 % of a one-step-old statistic; 20 gave 5-10 % more error.
    start_step: warm-up; steps before it take Horovod's fp32 path, bit for bit as without GIFT,
    while the whitening statistics gather; compression starts with zero residuals.
    grad_scaler: the torch.amp.GradScaler of fp16 training. The residuals are in its scaled units;
    GIFT rescales them whenever the scale changes. Without it, a change of scale leaves them off
    by the ratio of the scales (a backoff after an overflow makes them 2x too large).
    log_every: log one line every N steps on rank 0 (logger "horovod_gift", level INFO): bits per
    element, bytes sent, codec and wait seconds per step, and how many tensors take each
    transform; 0 (the default) logs nothing periodically.
    topology: how a bucket is reduced over the ranks. "flat": one quantized reduce-scatter and
    allgather over all ranks, which sends (P - L) / P of every gradient across nodes (L ranks a
    node). "two-hop" (two_hop.py): an fp32 reduce-scatter inside each node, the quantized
    reduction across nodes on 1/L of each bucket, an allgather inside the node: 1/L of the flat
    bytes across nodes, for (L - 1) / L of the gradient in fp32 over the node's own links
    (benchmarks/results/cluster.md measures both). It reduces over every rank (the global
    process set) and needs Horovod process sets for the nodes: GIFT adds them when Horovod was
    started with hvd.init(process_sets="dynamic"). "auto" (the default): two-hop when the job
    has several nodes of several ranks and the process sets can be had, else flat (a warning
    says why when only the process sets are missing).
    node_size: consecutive ranks that share a node; None (the default) takes Horovod's local
    size, where ranks fill nodes in order (mpirun's and horovodrun's default placement). Set it
    to simulate nodes on one host.
    residual_dtype: torch.float32 (default) or torch.bfloat16 for the error-feedback residuals.
    They hold 1 + 1/ranks parameter elements per parameter element (stage 1 per tensor, stage 2
    per owned chunk): 4 (1 + 1/n) bytes per parameter in fp32, half that in bf16 (plus an fp32
    workspace the size of the largest piece encoded). bf16 keeps
    about 3 significant digits of an error that is itself ~1e-2 of the gradient, and costs one
    conversion pass per encode.
    """

    def __init__(self, model, format="nvfp4", transform="whiten", error_feedback=True,
                 block_size=None, rounding="nearest", seed=0, bucket_elements=1 << 22,
                 min_elements=1024, whitening_rank=32, damping=1.0, refresh_every=REFRESH_EVERY,
                 stat_window=STAT_WINDOW,
                 hadamard_block=128, nonfinite="nan", process_set=None,
                 residual_dtype=torch.float32, start_step=0, grad_scaler=None, log_every=0,
                 topology="auto", node_size=None, verbose=True):
        if not hvd.is_initialized():
            raise RuntimeError("GIFT: call hvd.init() before creating GIFT(model, ...)")
        check_arguments(model, format, block_size, rounding, transform, nonfinite, damping,
                        start_step, grad_scaler, residual_dtype,
                        topology, node_size, refresh_every=refresh_every,
                        stat_window=stat_window, whitening_rank=whitening_rank)
        try:
            rotation = HadamardRotation(hadamard_block, seed)
        except ValueError:
            raise ValueError(f"GIFT: hadamard_block must be a power of two, "
                             f"got {hadamard_block!r}") from None
        params = list(model.named_parameters())
        trainable = [(n, p) for n, p in params if p.requires_grad]
        if not trainable:
            raise ValueError("GIFT: the model has no trainable parameters")
        self.codec = Codec(format, block_size, rounding, seed)
        self.transform, self.error_feedback, self.nonfinite = transform, error_feedback, nonfinite
        self.min_elements, self.verbose, self.residual_dtype = min_elements, verbose, residual_dtype
        self.requested_process_set = process_set
        self.process_set = process_set or hvd.global_process_set
        self.comm = HorovodCommunicator(self.process_set)
        self.topology_request, self.node_size = topology, node_size
        # with no process set given, chosen for the optimizer's set at the first step: only its
        # ranks may be making this GIFT
        self.topology = (horovod_topology(topology, node_size, process_set)
                         if process_set is not None else None)
        self.average = True             # op=hvd.Average; hvd.Sum sets it False
        self._optimizer = None          # weak reference to the Horovod optimizer served
        # Parameters frozen now and trained later take an fp32 path: buckets must not wait for them.
        self.params = dict(params)
        self.unhooked = internals.UnhookedParameters(self.params, nonfinite, verbose)
        sparse = internals.sparse_gradient_parameters(model)
        compressed = [n for n, p in reversed(trainable)           # backward order
                      if p.numel() >= min_elements and n not in sparse]
        # the linear layers found, whatever the transform: ranks must agree on them
        self.linear_layers = sorted(
            (name, [(module_name, layout.layout) for module_name, _, layout in modules])
            for name, modules in linear_readers(model, self.params).items())
        # only tensors that are compressed can be whitened
        whitenable = ({n: self.params[n] for n in compressed}
                      if transform in WHITENING_TRANSFORMS else {})
        self.statistics = WhiteningStatistics(model, whitenable, whitening_rank, damping,
                                              refresh_every, stat_window, self.comm)
        self.plan = TransformPlan(self.params, transform, self.statistics, rotation)
        self.buckets = fill_buckets(compressed, {n: self.params[n].numel() for n in compressed},
                                     bucket_elements)
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self.feedback = (ErrorFeedback(self.params, self.buckets, self.codec.align, residual_dtype)
                         if error_feedback else None)
        self.step = 0
        self._verify = True
        self._pending_rank_state = False  # loaded before the process set was known: apply later
        self.grad_names = internals.GradientNames(self.params)
        self.start_step, self.grad_scaler = start_step, grad_scaler
        self._scale = None              # the GradScaler's scale the residuals are in
        self.telemetry = Telemetry(log_every)
        self._compiles_seen = CompileCount.count
        self._reset_step()
        internals.refuse_other_optimizers(self, GIFT)
        weakref.finalize(self, self.statistics.remove_hooks)

    # ---------------------------------------------------------------- Horovod's interface
    def compress(self, tensor=None):
        _check_instance(self)
        optimizer, hooked = internals.calling_optimizer(self)
        self._bind(optimizer)
        t0 = time.perf_counter()
        try:
            with record_function("horovod_gift.compress"):
                return self._compress(tensor, hooked)
        finally:
            self.telemetry.add(seconds_in_gift=time.perf_counter() - t0)

    def decompress(self, tensor=None, ctx=None):
        _check_instance(self)
        if ctx is None:     # a sparse gradient: Horovod reduced it itself, compress never saw it
            return tensor
        t0 = time.perf_counter()
        try:
            with record_function("horovod_gift.decompress"):
                return self._decompress(tensor, ctx)
        finally:
            self.telemetry.add(seconds_in_gift=time.perf_counter() - t0)

    def _bind(self, optimizer):
        """Take the process set and op of the Horovod optimizer calling compress, the first time;
        refuse what GIFT cannot honour. Every rank of the set raises the same error, before any
        collective of GIFT's, so none waits for the others."""
        if optimizer is None or (self._optimizer is not None and self._optimizer() is optimizer):
            return
        serving = (self.process_set, self.average) if self._optimizer is not None else None
        internals.check_optimizer(optimizer, self.requested_process_set, serving)
        self.process_set = optimizer.process_set
        self.comm = self.statistics.comm = HorovodCommunicator(self.process_set)
        if (self.topology is None or self.topology.comm.process_set.process_set_id
                != self.process_set.process_set_id):
            self.topology = horovod_topology(self.topology_request, self.node_size,
                                             self.process_set)
        self.average = optimizer.op == hvd.Average
        self._optimizer = weakref.ref(optimizer)

    def _compress(self, tensor, hooked):
        name = self.grad_names(tensor, hooked)
        if not self.current.in_step:
            self._begin_step(tensor.device)
        self.current.outstanding += 1
        self.current.sent.add(name)
        self.telemetry.add(elements=tensor.numel())
        if self.current.plain or name not in self.bucket_of:
            self.telemetry.add(uncompressed_elements=tensor.numel(),
                               payload_bytes=4 * tensor.numel())
            plain = tensor if tensor.dtype in HOROVOD_DTYPES else tensor.to(torch.float32)
            self._progress()
            return plain, ("plain", name, tensor.dtype)
        self.plan.record(name, tensor, self.codec)
        if (self.feedback and self.feedback.dtype == torch.float32 and self.topology.folds
                and self.plan.folds(name, tensor)):
            self.current.u[name], self.current.maxima[name] = self.plan.forward_folded(
                name, tensor, *self.feedback.residual_pieces(name, self.comm.size))
        else:
            self.current.u[name] = self.plan.forward(name, tensor, in_place=True)
            # an r1 with values outside this rank's part goes into the node's sum (two_hop.py)
            spread = self.feedback.take_spread(name) if self.feedback else None
            if spread is not None and not self.topology.folds:
                self.current.u[name].add_(spread)
                spread.zero_()
        self.current.shapes[name] = (tensor.shape, tensor.dtype)
        bucket = self.bucket_of[name]
        if all(n in self.current.u for n in self.buckets[bucket]):
            self._start(bucket)
        self._progress()
        # on the gradient's device: Horovod's grouped allreduce (groups=) wants one device a group
        return torch.zeros(1, device=tensor.device), ("gift", name, tensor.dtype)

    def _decompress(self, tensor, ctx):
        kind, name, dtype = ctx
        if kind == "plain":
            result = tensor.to(dtype)
        else:
            self._second_stage()
            result = self._result(name)
        if self.nonfinite == "raise" and not torch.isfinite(result).all():
            self._scrub()
            self._reset_step()
            raise FloatingPointError(f"GIFT: the averaged gradient of {name} is not finite "
                                     "(a rank's gradient held NaN or Inf)")
        self.current.outstanding -= 1
        if self.current.outstanding == 0:
            self._end_step()
        return result

    # ---------------------------------------------------------------- one step
    def _reset_step(self):
        self.current = StepState(pipeline=StagePipeline(self.buckets, self.telemetry))

    def _begin_step(self, device):
        self.current.in_step = True
        if self._pending_rank_state is not False:
            self._load_rank_state(self._pending_rank_state)
        t0 = time.perf_counter()
        everyone, largest_step = internals.roll_call(self.comm, self.step, device)
        self.telemetry.add(wait_seconds=time.perf_counter() - t0)   # for the slowest rank
        self.current.joined = not everyone
        if self.current.joined:     # every tensor takes Horovod's fp32 path; nothing else runs
            self.telemetry.add(joined_steps=1)
            self.current.plain = True
            self.statistics.advance()
            return
        if self._verify:
            self._check_ranks_agree()
            self._verify = False
        else:   # a mismatch before the first check is an error that check reports
            self.step = largest_step
        # warm-up: Horovod's fp32 path, while the statistics gather (the factors are ready when
        # compression starts, and the residuals start at zero then)
        self.current.plain = self.step < self.start_step
        self.telemetry.add(warmup_steps=int(self.current.plain))
        self._follow_grad_scaler()
        # "auto" judges the candidates on refresh steps (factors from earlier batches only, as on
        # the steps that follow); step 0 has no earlier batch
        self.plan.begin_step(evaluating=not self.current.plain and self.step >= 1
                             and self.statistics.due(self.step))
        if self.statistics.due(self.step):
            with record_function("horovod_gift.refresh"):
                self._change_transforms(lambda: {
                    name: functools.partial(self.plan.inverse, name, factors=old_factors)
                    for name, old_factors in self.statistics.refresh().items()})
        self.statistics.advance()
        if self.step == 0 and self.verbose and self.comm.rank == 0:
            logger.info("%s", self.describe())

    def _follow_grad_scaler(self):
        """The residuals hold gradients in the GradScaler's units: when its scale changes (growth,
        or backoff after a step it skipped), rescale them with it. Every rank reads the same
        scale: the scaler judges the averaged gradients, identical on every rank."""
        if self.grad_scaler is None:
            return
        scale = float(self.grad_scaler.get_scale())
        if self.feedback and self._scale is not None and scale != self._scale:
            self.feedback.rescale(scale / self._scale)
        self._scale = scale

    def _start(self, bucket):
        names = self.buckets[bucket]
        flats = [self.current.u[n] if n in self.current.u else self._zeros(n, torch.float32)
                 for n in names]
        residual1 = residual2 = None
        if self.feedback:
            residual1 = self.feedback.first_stage(names)
            owned = self.topology.owned_pieces([f.numel() for f in flats], self.codec)
            residual2 = self.feedback.second_stage(bucket, sum(hi - lo for _, lo, hi in owned),
                                                   flats[0].device)
        reduction = self.topology.reduction(f"gift.b{bucket}", flats, self.codec, residual1,
                                            residual2, self.average, self.step,
                                            [self.current.maxima.get(n) for n in names], bucket)
        self.current.pipeline.start(bucket, reduction)
        self.telemetry.add(payload_bytes=sum(self.codec.payload_bytes(f.numel()) for f in flats))

    def _zeros(self, name, dtype):
        """A flat zero tensor of a parameter's size on that parameter's device."""
        p = self.params[name]
        return torch.zeros(p.numel(), dtype=dtype, device=p.device)

    def _progress(self):
        """Move every bucket whose collective has arrived to its next stage (pipeline.py)."""
        self.current.pipeline.progress()

    def _second_stage(self):
        pipeline = self.current.pipeline
        if pipeline.exchanged:
            return
        for bucket in range(len(self.buckets)):     # a bucket whose members Horovod never sent
            members = self.buckets[bucket]
            if bucket not in pipeline.reductions and any(n in self.current.u for n in members):
                self._start(bucket)
        pipeline.exchange_all()
        self.plan.start_vote()

    def _scrub(self):
        """Residuals made non-finite by this step's gradients back to zero: one verdict for every
        bucket of the step (one host sync on a GPU), before the next step reads them."""
        if self.feedback:
            self.feedback.scrub(*self.current.pipeline.residuals())

    def _result(self, name):
        shape, dtype = self.current.shapes[name]
        u = self.current.pipeline.finish(self.bucket_of[name]).pop(name)
        return self.plan.inverse(name, u, in_place=True).view(shape).to(dtype)

    def _end_step(self):
        self._scrub()
        self.unhooked.average(self.current.sent, self.average, self.process_set)
        if self.plan.evaluating and not self.current.joined:
            with record_function("horovod_gift.vote"):
                self._change_transforms(self.plan.finish_vote)
        self.step += 1
        self.telemetry.end_step(self.step, lambda: self.plan.counts(self.bucket_of),
                                self.comm.rank == 0)
        self.plan.end_step()
        self._reset_step()
        self._collect_after_compiles()

    def _collect_after_compiles(self):
        """A step in which numba compiled a kernel (the first, a refresh step's first round
        trips) leaves its frames in a reference cycle with every gradient they held (native.py's
        CompileCount): without a collection here they lived on into later steps, up to 1x the
        parameters' bytes, until Python's cycle collector happened to run."""
        if CompileCount.count != self._compiles_seen:
            self._compiles_seen = CompileCount.count
            gc.collect()

    # ---------------------------------------------------------------- residuals
    def _change_transforms(self, change):
        """Run change() (new whitening factors, or new transform choices), which returns the old
        inverse map of each tensor it changed, and keep the residuals in step: stage 2 folded
        into stage 1 before (it lives in the old coordinates of a whole bucket), each changed
        tensor's stage 1 re-expressed in its new coordinates after."""
        if self.feedback:
            self.feedback.fold(functools.partial(self.topology.owned_pieces, codec=self.codec),
                               self.comm.size if self.average else 1)
        for name, old_inverse in change().items():
            if self.feedback:
                self.feedback.convert(name, old_inverse, functools.partial(self.plan.forward, name))


def _check_instance(obj):
    # Horovod calls compression.compress(grad): with the class itself, grad lands in `self`
    if not isinstance(obj, GIFT):
        raise TypeError("compression=GIFT passes the class; pass an instance made for your model: "
                        "compression=gift.GIFT(model, format='nvfp4')")
