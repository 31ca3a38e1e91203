"""What every GIFT state of a model holds and does, whatever reduces its gradients: core.GiftCore
(with its BucketReducer's buckets, for Horovod and DDP) and fsdp.state.FsdpGiftState (FSDP's rows)
are its two kinds.

It holds the configuration, the codec, the whitening statistics, the counters and the step, and
runs what a step shares in every engine: a loaded per-rank state applied once the ranks are
known, the ranks' agreement on the configuration (check_ranks_agree) at the first step and the
first after a load, the statistics' refresh on due steps, the step's count, and checkpoints:
state_dict() holds a shared part (step, configuration,
whitening statistics and factors, ...), the same on every rank, and a per-rank part (error-
feedback residuals, statistics histories) that only the rank that saved it, in a job of the same
size and topology, can use. The configuration is also what ranks compare at their first step and
the first after a load, so a job whose ranks differ raises on every rank instead of hanging or
training on wrong gradients. A kind says how its residuals follow a refresh (_refresh), what it
keeps per rank beside the statistics' histories (its PerRankState, `self.own`) and what it adds to
the configuration. The rule for a per-rank state that cannot be used, and its one warning, are
apply_loaded's.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

from torch.profiler import record_function

from ..codec.tensor_codec import Codec
from ..config import numeric_options
from ..geometry.statistics import WhiteningStatistics
from ..telemetry import Telemetry, logger

NOTHING_PENDING = False     # no loaded per-rank state waits (None is one: "saved without it")


def check_ranks_agree(comm, config):
    """Collective over comm, at the first step and the first after load_state_dict: every rank
    raises the same error if config (the configuration, the model's parameters, the step count)
    differs across them. Every frontend's (GIFT, GiftState, FSDP's) check."""
    configs = comm.allgather_object(config, "gift.config")
    if all(c == configs[0] for c in configs):
        return
    diff = sorted({k for c in configs for k in c if c.get(k) != configs[0].get(k)})
    hint = {"model": " (the model's parameter names or shapes, or the buckets, differ)",
            "linear": " (the linear layers whitened differ: call gift.register_linear on "
                      "every rank)",
            "step": " (load the compressor's state_dict on every rank, not only on one)"}
    per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k}={c.get(k)!r}" for k in diff)
                         for r, c in enumerate(configs))
    raise ValueError(f"GIFT configuration differs across ranks in {', '.join(diff)}: "
                     + per_rank + "".join(hint.get(k, "") for k in diff))


class PerRankState(ABC):
    """What a kind of state keeps for one rank of one job beside the statistics' histories (its
    error-feedback residuals and what they depend on): saved in that rank's checkpoint, usable
    only by the same rank of a job of the same size. `topology`: the Topology its residuals are
    laid out in (what the ranks' check compares)."""

    @abstractmethod
    def state(self) -> dict:
        """Host copies, for the rank's checkpoint (keys other than rank, ranks, statistics)."""

    @abstractmethod
    def restore(self, saved: dict) -> None:
        """Take a state() saved by this rank in a job of this size (unusable accepted it)."""

    @abstractmethod
    def forget(self) -> None:
        """Restart at zero."""

    @abstractmethod
    def tensors(self) -> list:
        """The residuals held now (their bytes are counted in stats())."""

    def unusable(self, saved: dict):
        """Why this rank cannot take saved beyond the rank and the number of ranks, or None."""
        return None


class GiftStateBase:
    """label: the name errors and logs give this kind of state; CONFIG_ADDED: configuration
    keys a kind added after its first checkpoints, with the value those checkpoints meant."""
    label = "GIFT"
    CONFIG_ADDED: dict[str, object] = {}

    def __init__(self, model, config, whitenable, comm):
        """config: the GiftConfig; whitenable: name -> weight of those the whitening may take;
        comm: the Communicator of the ranks, or None until the kind learns it (set_comm)."""
        self.config = config    # every option is read from here, by its field's name
        self.codec = Codec(config.format, config.block_size, config.rounding, config.seed)
        self.params = dict(model.named_parameters())
        self.comm = comm
        self.statistics = WhiteningStatistics(model, whitenable, config.whitening_rank,
                                              config.damping, config.refresh_every,
                                              config.stat_window, comm)
        self.telemetry = Telemetry(config.log_every)
        self.own = None           # the kind's PerRankState, made with the kind
        self.step = 0
        self._verify = True       # check the ranks agree at the next step
        self._pending_rank_state = NOTHING_PENDING   # loaded before the ranks were known

    def set_comm(self, comm):
        self.comm = self.statistics.comm = comm

    # ---------------------------------------------------------------- a step's shared parts
    def settle_ranks(self, before_training=False):
        """At a step's start, on every rank: a loaded per-rank state applied, and the ranks'
        agreement checked (collective) if due. Returns whether it was checked.
        before_training: a check made before the first step (FSDP's attach), which leaves the
        first step's due: a state then loaded on some ranks only (which makes it due there)
        must still meet a check on every rank, not a collective of GIFT's step."""
        self.apply_loaded()
        if not self._verify:
            return False
        check_ranks_agree(self.comm, dict(self.agreed(), step=self.step,
                                          topology=self.own.topology.description))
        self._verify = before_training
        return True

    def refresh_statistics(self):
        """The whitening statistics refreshed on due steps (collective), the residuals following
        (_refresh), then this step's statistics started; the description logged at step 0."""
        if self.statistics.due(self.step):
            with record_function("horovod_gift.refresh"):
                self._refresh()
        self.statistics.advance()
        if self.step == 0 and self.config.verbose and self.comm.rank == 0:
            logger.info("%s", self.describe())

    def count_step(self):
        """The step done: counted, and logged every log_every steps."""
        self.step += 1
        self.telemetry.end_step(self.step, self._transform_counts, self.comm.rank == 0)

    # ---------------------------------------------------------------- what a kind says
    def describe(self):
        raise NotImplementedError

    def _refresh(self):
        """New whitening factors (self.statistics.refresh()), and the residuals in them."""
        raise NotImplementedError

    def _transform_counts(self):
        """Tensors a transform takes, per transform (for the logs)."""
        return {}

    # ---------------------------------------------------------------- the per-rank state
    def apply_loaded(self):
        """A per-rank state loaded before the ranks were known, applied now they are (or the
        residuals restarted at zero, with one warning, where this rank cannot use it)."""
        if self._pending_rank_state is NOTHING_PENDING:
            return
        saved, self._pending_rank_state = self._pending_rank_state, NOTHING_PENDING
        n, me = self.comm.size, self.comm.rank
        if saved is None:
            why = "it has no per-rank state"
        elif (saved["ranks"], saved["rank"]) != (n, me):
            why = (f"it was saved by rank {saved['rank']} of {saved['ranks']}, "
                   f"this is rank {me} of {n}")
        else:       # what else the kind's part depends on
            why = self.own.unusable(saved)
        if why is None:
            self.statistics.load_local_state_dict(saved["statistics"])
            self.own.restore(saved)
            return
        self._forget_rank_state()
        # every rank is in the same case unless only the rank differs: one warning then
        if self.comm.rank == 0 or (saved is not None and saved["ranks"] == self.comm.size
                                   and saved["rank"] != self.comm.rank):
            logger.warning("%s.load_state_dict: %s; error-feedback residuals and statistics "
                           "histories restart at zero (the rest is kept)", self.label, why)

    def _forget_rank_state(self):
        """What belongs to this rank in this job restarts; the ranks check they agree at the
        next step."""
        self.own.forget()
        self.statistics.load_local_state_dict({})
        self._verify = True
        self.telemetry.restart(self.step)

    def stats(self) -> dict:
        """Cumulative counters of this rank: steps, gradient elements, bytes sent through the
        quantized path (node_bytes_sent: the part a two-hop reduction sent inside its node),
        bits per gradient element encoded (uncompressed tensors at 32), seconds in the codec,
        seconds waiting inside GIFT (for the network, and at a step's start for the slowest
        rank), steps on the fp32 path (a rank in hvd.join(), or GIFT warming up), and
        residual_bytes: what this rank's error-feedback residuals hold."""
        return dict(self.telemetry.stats(self.step, self._transform_counts()),
                    residual_bytes=sum(r.numel() * r.element_size()
                                       for r in self.own.tensors()))

    # ---------------------------------------------------------------- checkpoints
    def agreed(self):
        """What ranks must agree on and a checkpoint must match: the options that change the
        numbers (config.numeric_options), and what each kind adds."""
        config = {name: getattr(self.config, name) for name in numeric_options()}
        return dict(config, residual_dtype=str(config["residual_dtype"]))

    def state_dict(self, rank_state: bool = True) -> dict:
        """The shared state (step, configuration, whitening statistics and factors, ...), the
        same on every rank, and, unless rank_state=False, this rank's own (error-feedback
        residuals and statistics histories, with the rank and the number of ranks). Not
        collective. To resume bit for bit, every rank saves its own (one file per rank); the
        shared part alone resumes on any number of ranks, residuals at zero."""
        state = {"step": self.step, "config": self.agreed(),
                 "statistics": self.statistics.state_dict(), "rank_state": None}
        if rank_state and self._pending_rank_state is not NOTHING_PENDING:
            state["rank_state"] = self._pending_rank_state     # loaded, not applied yet
        elif rank_state and self.comm is not None:
            state["rank_state"] = dict(self.own.state(), rank=self.comm.rank,
                                       ranks=self.comm.size,
                                       statistics=self.statistics.local_state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a state_dict(): the shared part now, the per-rank part at the next step (or now,
        where the ranks are known: apply_loaded); the ranks check they agree at that step."""
        saved, here = dict(self.CONFIG_ADDED, **state["config"]), self.agreed()
        differ = sorted(k for k in saved.keys() | here.keys() if saved.get(k) != here.get(k))
        if differ:
            # "model" and "linear" are digests of the parameters' names and shapes and of the
            # whitened layers: a checkpoint of another model differs there
            raise ValueError(
                f"{self.label}.load_state_dict: the checkpoint was saved with another "
                f"{', '.join(differ)} (" + "; ".join(
                    f"{k}: saved with {saved.get(k)!r}, here {here.get(k)!r}" for k in differ)
                + "); load it into the model and options it was saved with")
        self.step = state["step"]
        self.statistics.load_state_dict(state["statistics"])
        self._pending_rank_state = state["rank_state"]
        self._verify = True
        self.telemetry.restart(self.step)


def fingerprint(value):
    """A short digest of value's repr: what ranks compare of the model's parameters."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]

