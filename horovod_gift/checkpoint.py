"""GIFT's checkpoints and the agreement of ranks on what they run (a base class of GIFT).

state_dict() holds a shared part (step, configuration, whitening statistics and factors, transform
choices), the same on every rank, and a per-rank part (error-feedback residuals, statistics
histories, the GradScaler scale the residuals are in) that only the rank that saved it, in a job
of the same size, can use. The configuration is also what ranks compare at their first step and
the first after a load, so a job with ranks that differ raises on every rank instead of hanging
or training on wrong gradients.
"""
import hashlib

from horovod_gift.kernels.hadamard import LANES

from .feedback import ErrorFeedback
from .telemetry import logger
from .topology import owned_pieces


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


class Checkpointing:
    """Checkpoints and rank agreement of GIFT (which holds the state these methods read)."""

    def config(self):
        # the rotation's layout too: saved residuals live in the rotated space, and ranks must
        # agree on it
        shapes = [(n, tuple(p.shape)) for n, p in self.params.items()]
        return dict(format=self.codec.format, block_size=self.codec.block_size,
                    rounding=self.codec.rounding, seed=self.codec.seed, transform=self.transform,
                    error_feedback=self.error_feedback, min_elements=self.min_elements,
                    hadamard_block=self.plan.rotation.block_size, hadamard_interleave=LANES,
                    refresh_every=self.statistics.refresh_every,
                    stat_window=self.statistics.window, whitening_rank=self.statistics.rank,
                    damping=self.statistics.damping,
                    nonfinite=self.nonfinite, residual_dtype=str(self.residual_dtype),
                    start_step=self.start_step,
                    model=_fingerprint((self.buckets, shapes)),
                    linear=_fingerprint(self.linear_layers))

    def _load_rank_state(self, saved):
        """This rank's residuals and statistics histories, if they were saved on a job of this
        size by this rank; otherwise they restart at zero (with a warning)."""
        self._pending_rank_state = False
        n, me = self.comm.size, self.comm.rank
        if saved is None or (saved["ranks"], saved["rank"]) != (n, me):
            self._forget_rank_state()
            why = ("it has no per-rank state" if saved is None else
                   f"it was saved by rank {saved['rank']} of {saved['ranks']}, "
                   f"this is rank {me} of {n}")
            # every rank is in the same case unless only the rank differs: one warning then
            if me == 0 or (saved is not None and saved["ranks"] == n):
                logger.warning("GIFT.load_state_dict: %s; error-feedback residuals and statistics "
                               "histories restart at zero (the rest is kept)", why)
            return
        self.statistics.load_local_state_dict(saved["statistics"])
        self._scale = saved["grad_scale"]
        if self.feedback:
            feedback, topology = saved["feedback"], saved.get("topology", ("flat",))
            if topology not in (None, self.topology.description):   # r2 covers other parts
                feedback = self.feedback.fold_saved(
                    feedback, lambda sizes: owned_pieces(topology, sizes, me, n, self.codec),
                    n if saved.get("average", True) else 1)
            self.feedback.load_state_dict(feedback,
                                          lambda k: self.params[self.buckets[k][0]].device)

    def reset_rank_state(self):
        """Forget what belongs to this rank in this job (error-feedback residuals, statistics
        histories, the GradScaler scale they are in) and check the ranks agree at the next step:
        call it on every rank when the number of ranks changes (hvd.elastic's on_state_reset).
        The nodes and their process sets are chosen again at the next step."""
        self._forget_rank_state()
        self.topology, self._optimizer = None, None

    def _forget_rank_state(self):
        if self.feedback:
            self.feedback.reset()
        self.statistics.load_local_state_dict({})
        self._scale, self._verify = None, True
        self.telemetry.restart(self.step)

    def _check_ranks_agree(self):
        check_ranks_agree(self.comm, dict(self.config(), step=self.step,
                                          topology=self.topology.description))

    def state_dict(self, rank_state=True):
        """The shared state (step, configuration, whitening statistics and factors, transform
        choices) and, unless rank_state=False, this rank's own (error-feedback residuals and
        statistics histories, 1 + 1/n elements per parameter element, with the rank and the
        number of ranks). Not collective. To resume bit for bit, every rank saves its own (one
        file per rank); the shared part alone resumes on any number of ranks, residuals at zero."""
        state = {"step": self.step, "config": self.config(),
                 "statistics": self.statistics.state_dict(), "plan": self.plan.state_dict(),
                 "rank_state": None}
        if rank_state and self._pending_rank_state is not False:
            state["rank_state"] = self._pending_rank_state   # loaded, not applied yet
        elif rank_state:
            state["rank_state"] = {
                "rank": self.comm.rank, "ranks": self.comm.size,
                "feedback": (self.feedback.state_dict() if self.feedback
                             else ErrorFeedback.empty_state()),
                "statistics": self.statistics.local_state_dict(),
                "grad_scale": self._scale,          # the residuals' units
                # what r2 covers, and its scale when folded into r1 (None: no step yet, no r2)
                "topology": self.topology.description if self.topology else None,
                "average": self.average}
        return state

    def load_state_dict(self, state):
        """Load a state_dict(): the shared part always; the per-rank part if this rank saved it in
        a job of this size, else the residuals restart at zero with one warning."""
        if state["config"] != self.config():
            raise ValueError(f"GIFT.load_state_dict: saved with {state['config']}, "
                             f"this GIFT is {self.config()}")
        self._pending_rank_state = state["rank_state"]
        if self.topology is not None:   # else at the first step, once the process set is known
            self._load_rank_state(state["rank_state"])
        self.step = state["step"]
        self.statistics.load_state_dict(state["statistics"])
        self.plan.load_state_dict(state["plan"])
        self._verify = True
        self.telemetry.restart(self.step)
        self._reset_step()


def _fingerprint(value):
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]
