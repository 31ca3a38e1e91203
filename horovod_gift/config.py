"""GiftConfig: every option of GIFT, one frozen record checked once; the names its options
accept (the codec's own: codec/backend.py)."""

import dataclasses
import inspect
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .codec.backend import check_codec

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
REFRESH_EVERY = 4       # steps between whitening refreshes (GiftConfig.refresh_every says why)
STAT_WINDOW = 5         # steps in the statistics' EMA
PARAM_FORMATS = (None, "fp8_e4m3")      # FSDP's parameter all-gather (fsdp/allgather.py)
# "none", "hadamard" (randomized Hadamard rotation of the flattened tensor), "whiten" (input
# whitening of linear weights), "whiten+hadamard", "auto" (geometry/transforms.py)
TRANSFORMS = ("auto", "none", "hadamard", "whiten", "whiten+hadamard")
# one flat group of every rank, two hops over nodes, or the one the ranks' placement allows
TOPOLOGIES = ("auto", "flat", "two-hop")
FSDP_TRANSFORMS = ("whiten", "none")
# a pseudo-gradient is a sum of optimizer updates, not dY^T X: no input statistic describes it
DILOCO_TRANSFORMS = ("hadamard", "none")
# a field's metadata: the option changes the numbers, so ranks must agree on it and a checkpoint
# must match it (numeric_options; each kind of state adds what else its ranks must share)
NUMERIC = {"numeric": True}
# options a frontend cannot honour (any value but the default raises), and why
HOROVOD_DDP_REFUSED = {"param_format": "applies to FSDP's parameter all-gather only "
                                       "(horovod_gift.fsdp.attach)"}
FSDP_REFUSED = {"start_step": "FSDP has no fp32 warm-up path in GIFT",
                "grad_scaler": "FSDP2 trains in bf16 or fp32, without a GradScaler",
                "bucket_elements": "FSDP's groups are its buckets",
                "hadamard_block": "FSDP takes no Hadamard rotation"}
DILOCO_REFUSED = {"start_step": "every outer step is one GIFT reduction",
                  "grad_scaler": "pseudo-gradients are differences of weights, not scaled "
                                 "gradients",
                  "node_size": "the replica group's process group (group=) is the node",
                  "param_format": "DiLoCo all-gathers no parameters",
                  "log_every": "torchft logs each sync"}


@dataclass(frozen=True)
class GiftConfig:
    """Every option of GIFT, one frozen record that Horovod's GIFT, DDP's GiftState, FSDP's
    attach and torchft's GiftDiLoCo all take (as `config=` or as keyword arguments); checked once,
    here. Each field's comment says what it does and the measurement behind its default
    (benchmarks/results/fidelity.md measures the geometry on a small Llama's gradients, with
    statistics from earlier batches only, as training has them)."""

    # the wire format of gradients: "nvfp4" (4.5 bits an element with its scales), "int3" (7
    # levels, 3.25 bits an element with its scales), "fp8_e4m3" or "fp8_e5m2" (8, plus one
    # scale per block_size elements); NVFP4 and INT3 add 32 bits a tensor for its scale.
    # FP8: 13x (E4M3) / 3x (E5M2) lower squared error a step than NVFP4, where links are fast
    # enough that 4.5 bits gain little. INT3: 28 % fewer bytes than NVFP4 (at 2 x 4, two hops
    # send 0.43 B a gradient element across a node's link against NVFP4's 0.58: cluster_int3.md,
    # fsdp_cluster_int3.md); with whitening and error feedback -0.30 % (95 % CI -0.88 .. +0.27)
    # of fp32's held-out loss over 20 paired seeds, NVFP4 +0.33 % (-0.11 .. +0.78)
    # (convergence_int3_20seeds.md); its round trip's error is 1.6x NVFP4's even whitened
    # (fidelity_int3.md): error feedback makes up for it
    format: str = field(default="nvfp4", metadata=NUMERIC)
    # "whiten": the gradient of every compressed weight of a linear module (nn.Linear,
    # transformers' Conv1D, classes given to gift.register_linear; a weight tied to an LM head, by
    # the head's input) whitened with the symmetric inverse root of its input statistic
    # (geometry/); other tensors as they are. At step 100 it cuts the round-trip error 2.2-2.5x
    # for FP8 E5M2 and NVFP4, and the error of AdamW's update direction 2.0-2.4x.
    # "whiten+hadamard" adds a randomized Hadamard rotation: 3-14 % less Euclidean error but
    # 33-56 % more in AdamW's update (error moves onto coordinates with small second moments);
    # "hadamard" alone does the same without the gain. "auto" picks per tensor among the four by
    # the Euclidean round-trip error on each refresh step (4 codec round trips a tensor there):
    # for SGD-like optimizers, where the Euclidean error is what counts. "hadamard" alone suits
    # models without linear layers. "none": no transform. FSDP takes "whiten" and "none", DiLoCo
    # "hadamard" and "none".
    transform: str = field(default="whiten", metadata=NUMERIC)
    # keep each quantization stage's error and add it back next step; False saves the residuals'
    # memory (FSDP: +0.013 held-out loss without, fsdp_feedback.md)
    error_feedback: bool = field(default=True, metadata=NUMERIC)
    # FP8's scale block (None: one scale a tensor), a power of two: for gradients with outlier
    # rows; NVFP4's is fixed at 16, INT3's at 32
    block_size: Optional[int] = field(default=None, metadata=NUMERIC)
    # "nearest" or "stochastic" (seeded, the same on every rank: unbiased a step, twice the
    # squared error)
    rounding: str = field(default="nearest", metadata=NUMERIC)
    # seeds the Hadamard rotation's signs and stochastic rounding (the same on every rank)
    seed: int = field(default=0, metadata=NUMERIC)
    # the most elements in a bucket reduced together (Horovod, DDP): larger, fewer messages
    bucket_elements: int = 1 << 22
    # tensors under this many elements travel in fp32, uncompressed
    min_elements: int = field(default=1024, metadata=NUMERIC)
    # eigenpairs of each input statistic kept; the cost is O(out * in * rank) a gradient and
    # O(in * rank) memory. 64 gains 2-6 % over 32; 16 loses 7-15 %
    whitening_rank: int = field(default=32, metadata=NUMERIC)
    # the floor added to each statistic, relative to its mean eigenvalue tr(A) / in: 1.0 was best
    # of 0.01 ... 3 (0.1: 1.3x more error, 3: 1.1x); lower it only with fresher statistics
    damping: float = field(default=1.0, metadata=NUMERIC)
    # steps between recomputations of the whitening factors (an allreduce of in * (rank + 21)
    # floats, an O(in * rank^2) factorization on one rank and a broadcast, per input). Statistics
    # one step old gave 7 % less error than five steps old, and 1.3x less than 20
    refresh_every: int = field(default=REFRESH_EVERY, metadata=NUMERIC)
    # the statistics are an EMA with decay 1 - 1 / stat_window: 5 came within 3 % of a statistic
    # one step old; 20 gave 5-10 % more error
    stat_window: int = field(default=STAT_WINDOW, metadata=NUMERIC)
    # the randomized Hadamard rotation's block (a power of two)
    hadamard_block: int = 128
    # "nan": a non-finite gradient comes back NaN on every rank; "raise": every rank raises
    # (Horovod, DDP: FSDP's owner of each shard's sum is the only rank to see it)
    nonfinite: str = "nan"
    # the residuals' dtype: torch.float32 or torch.bfloat16. They hold 1 + 1/ranks elements a
    # parameter element: 4 (1 + 1/n) bytes a parameter in fp32, half in bf16 (plus an fp32
    # workspace the size of the largest piece encoded). bf16 keeps about 3 significant digits of
    # an error that is itself ~1e-2 of the gradient, for one conversion pass an encode. Under
    # HSDP fp32 costs 1.02 % of FSDP fp32's held-out loss against bf16's 1.27 % (10 seeds,
    # hsdp_loss.md)
    residual_dtype: torch.dtype = field(default=torch.float32, metadata=NUMERIC)
    # warm-up (Horovod, DDP): steps before it take the engine's own fp32 reduction, bit for bit
    # as without GIFT, while the whitening statistics gather; compression starts with zero
    # residuals
    start_step: int = 0
    # fp16 training's torch.amp.GradScaler (Horovod, DDP): the residuals are in its scaled units
    # and follow each change of scale; without it a backoff after an overflow leaves them 2x
    # too large
    grad_scaler: Optional[torch.amp.GradScaler] = field(default=None, compare=False)
    # log one line every N steps on rank 0 (logger "horovod_gift", INFO): bits an element, bytes
    # sent, codec and wait seconds a step, tensors each transform takes; 0: never
    log_every: int = 0
    # how a bucket is reduced over the ranks (reduce/topology.py). "flat": one quantized
    # reduce-scatter and allgather over all ranks, which sends (P - L) / P of every gradient
    # across nodes (L ranks a node). "two-hop": fp32 inside each node, the quantized reduction
    # across nodes on 1/L of each bucket: 1/L of flat's bytes across nodes
    # (benchmarks/results/cluster.md). "auto": two-hop on several nodes of several ranks; set
    # "two-hop" to insist (an error says why it cannot be had). Under HSDP the mesh decides
    topology: str = "auto"
    # consecutive ranks a node (None: the launcher's local size, where ranks fill nodes in order,
    # as mpirun, horovodrun and torchrun place them); set it to simulate nodes on one host
    node_size: Optional[int] = None
    # FSDP's parameter all-gather: None (fp32, FSDP's own) or "fp8_e4m3" (FP8 with block
    # scales: fsdp_cluster.md)
    param_format: Optional[str] = None
    # log what GIFT does at its first step
    verbose: bool = True

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"GIFT: unknown topology {self.topology!r}; expected one of "
                             f"{TOPOLOGIES}")
        if self.node_size is not None and (not isinstance(self.node_size, int)
                                           or self.node_size < 1):
            raise ValueError(f"GIFT: node_size must be None (Horovod's local size) or a "
                             f"positive int, got {self.node_size!r}")
        check_codec(self.format, self.block_size, self.rounding, where="GIFT")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"GIFT: unknown transform {self.transform!r}; expected one of "
                             f"{TRANSFORMS}")
        if self.nonfinite not in ("nan", "raise"):
            raise ValueError(f"GIFT: nonfinite must be 'nan' or 'raise', got {self.nonfinite!r}")
        for what in ("refresh_every", "stat_window", "whitening_rank", "min_elements",
                     "bucket_elements"):
            value = getattr(self, what)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GIFT: {what} must be a positive int, got {value!r}")
        if not self.damping > 0:
            raise ValueError(f"GIFT: damping must be positive, got {self.damping!r}")
        for what in ("start_step", "log_every"):
            value = getattr(self, what)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"GIFT: {what} must be a non-negative int, got {value!r}")
        if self.grad_scaler is not None and not callable(getattr(self.grad_scaler, "get_scale",
                                                                 None)):
            raise TypeError(f"GIFT: grad_scaler must be a torch.amp.GradScaler, "
                            f"got {type(self.grad_scaler).__name__}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"GIFT: residual_dtype must be one of {RESIDUAL_DTYPES}, "
                             f"got {self.residual_dtype!r}")
        block = self.hadamard_block
        if (isinstance(block, bool) or not isinstance(block, int) or block < 1
                or block & (block - 1)):
            raise ValueError(f"GIFT: hadamard_block must be a power of two, got {block!r}")
        if self.param_format not in PARAM_FORMATS:
            raise ValueError(f"GIFT: param_format must be one of {PARAM_FORMATS}, got "
                             f"{self.param_format!r}")

    @classmethod
    def for_fsdp(cls, **options):
        """FSDP's defaults: bf16 residuals (benchmarks/results/fsdp_feedback.md: as good as
        fp32, and FSDP users count bytes a parameter)."""
        return cls(**dict(dict(residual_dtype=torch.bfloat16), **options))

    @staticmethod
    def of(config, defaults, options):
        """The config a frontend runs: config (a GiftConfig or None: defaults()) with options
        replaced."""
        return replace(config, **options) if config is not None else defaults(**options)

    def refuse_for_fsdp(self):
        """Raise, naming the option, where FSDP cannot honour what this config asks."""
        default = GiftConfig()
        if self.transform not in FSDP_TRANSFORMS:
            raise ValueError(f"GIFT (FSDP): transform must be one of {FSDP_TRANSFORMS}, got "
                             f"{self.transform!r}: the Hadamard rotations mix rows FSDP shards "
                             "apart")
        if self.nonfinite != "nan":
            raise ValueError(f"GIFT (FSDP): nonfinite must be 'nan', got {self.nonfinite!r}: "
                             "each shard's sum is seen by its owner alone, so no rank can raise "
                             "for all of them")
        for what, why in FSDP_REFUSED.items():
            if getattr(self, what) != getattr(default, what):
                raise ValueError(f"GIFT (FSDP): {what} does not apply: {why}")

    @classmethod
    def for_diloco(cls, **options):
        """DiLoCo's defaults (integrations/torchft.py): NVFP4 with error feedback, and the
        transform benchmarks/results/diloco.md measured best on pseudo-gradients. NVFP4, not
        INT3: with 2 replica groups INT3 cost about 1 % of held-out loss against fp32 DiLoCo
        (diloco_cluster_2x2.md: +1.01 %, 95 % CI +0.06 .. +1.95) where NVFP4 kept it (-0.14 %,
        -0.85 .. +0.57), at 1/1455 of DDP fp32's bytes; with 4 groups INT3 keeps it too
        (diloco_cluster_4groups.md), at 28 % fewer bytes: format="int3" there. On a model 4x
        wider NVFP4 cost about 1 % at the sync before the last (every seed) and FP8 did not
        (diloco_cluster_d512.md): format="fp8_e4m3" where that matters, with H = 300 for 1/1055
        of DDP fp32's bytes, -0.29 % (-0.98 .. +0.41) from fp32 DiLoCo
        (diloco_cluster_d512_h300.md)."""
        return cls(**dict(dict(format="nvfp4", transform="hadamard"), **options))

    def refuse_for_diloco(self):
        """Raise, naming the option, where DiLoCo's outer all-reduce cannot honour it."""
        default = GiftConfig()
        if self.transform not in DILOCO_TRANSFORMS:
            raise ValueError(f"GIFT (DiLoCo): transform must be one of {DILOCO_TRANSFORMS}, got "
                             f"{self.transform!r}: a pseudo-gradient is a sum of optimizer "
                             "updates, which the inputs' statistics do not whiten "
                             "(benchmarks/results/diloco.md)")
        for what, why in DILOCO_REFUSED.items():
            if getattr(self, what) != getattr(default, what):
                raise ValueError(f"GIFT (DiLoCo): {what} does not apply: {why}")

    def refuse_param_format(self, frontend):
        default = GiftConfig()
        for what, why in HOROVOD_DDP_REFUSED.items():
            if getattr(self, what) != getattr(default, what):
                raise ValueError(f"{frontend}: {what} {why}")


def numeric_options():
    """The names of the options marked NUMERIC, in GiftConfig's order."""
    return tuple(f.name for f in dataclasses.fields(GiftConfig) if f.metadata.get("numeric"))


def with_options(defaults=GiftConfig):
    """A decorator: the function (whose **options are GiftConfig's fields) gets a signature that
    lists them as keyword-only parameters with the defaults of defaults(), for help() and IDEs:
    every option by name and default."""
    config = defaults()

    def decorate(function):
        options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                     default=getattr(config, f.name), annotation=f.type)
                   for f in dataclasses.fields(GiftConfig)]
        signature = inspect.signature(function)
        kept = [p for p in signature.parameters.values()
                if p.kind != inspect.Parameter.VAR_KEYWORD]
        function.__signature__ = signature.replace(parameters=kept + options)
        return function
    return decorate
