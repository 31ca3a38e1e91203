"""What GIFT tells its user: cumulative counters (GIFT.stats()), a log line every `log_every` steps
on rank 0 through the "horovod_gift" logger, and ranges in the PyTorch profiler.

Messages go through logging.getLogger("horovod_gift"), as a library's should: they are shown
once the application configures logging (e.g. logging.basicConfig(level=logging.INFO)).
Profiler ranges (torch.profiler.record_function) are named PROFILER_RANGES: the compress and
decompress calls Horovod makes, the statistics refresh and the "auto" vote; they sit inside
Horovod's own timeline ranges for the same tensors. DDP's hook and FSDP's reduce-scatter have
theirs: horovod_gift.ddp_hook and horovod_gift.reduce_scatter.
"""

import contextlib
import logging
import time

from torch.profiler import record_function

logger = logging.getLogger("horovod_gift")

PROFILER_RANGES = ("horovod_gift.compress", "horovod_gift.decompress", "horovod_gift.refresh",
                   "horovod_gift.vote")
# param_bytes_sent: FSDP's parameter all-gathers in 8 bits (fsdp/allgather.py)
COUNTERS = ("elements", "bytes_sent", "node_bytes_sent", "param_bytes_sent", "payload_bytes",
            "uncompressed_elements", "seconds_in_gift", "wait_seconds", "joined_steps",
            "warmup_steps")


class Telemetry:
    """Counters of this rank since the start, and the periodic log line."""

    def __init__(self, log_every=0):
        self.log_every = log_every
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.restart(0)

    @contextlib.contextmanager
    def timed(self, name):
        """A frontend's call: its seconds counted in seconds_in_gift, and a profiler range
        named horovod_gift.<name> around it."""
        t0 = time.perf_counter()
        try:
            with record_function(f"horovod_gift.{name}"):
                yield
        finally:
            self.add(seconds_in_gift=time.perf_counter() - t0)

    def restart(self, steps):
        """The next log line averages from here (a loaded or reset step count)."""
        self._last = dict(self.counters, steps=steps, time=time.perf_counter())

    def add(self, **amounts):
        for key, amount in amounts.items():
            self.counters[key] += amount

    def stats(self, steps, plans):
        c = dict(self.counters, steps=steps)
        # transforms, encode, decode, sums
        c["codec_seconds"] = c["seconds_in_gift"] - c["wait_seconds"]
        c["bits_per_element"] = 8.0 * c["payload_bytes"] / c["elements"] if c["elements"] else 0.0
        c["plans"] = plans
        return c

    def end_step(self, steps, plans, is_rank0):
        """One INFO line on rank 0 every log_every steps: the averages since the last line (plans:
        a callable giving the transforms' counts, called only then)."""
        if not (self.log_every and is_rank0 and steps % self.log_every == 0):
            return
        now, last, c = time.perf_counter(), self._last, self.counters
        n = steps - last["steps"]
        if n <= 0:
            return
        elements = c["elements"] - last["elements"]
        payload = c["payload_bytes"] - last["payload_bytes"]
        wait = (c["wait_seconds"] - last["wait_seconds"]) / n
        codec = (c["seconds_in_gift"] - last["seconds_in_gift"]) / n - wait
        plan_text = ", ".join(f"{v} {k}" for k, v in sorted(plans().items()))
        sent = (c["bytes_sent"] - last["bytes_sent"]) / n / 1e6
        inside = (c["node_bytes_sent"] - last["node_bytes_sent"]) / n / 1e6
        logger.info("step %d: %.2f bits/element, %.3g MB sent/step (%.3g of it inside the node), "
                    "codec %.4f s/step, wait %.4f s/step, %.3f s/step in all; tensors: %s", steps,
                    8.0 * payload / elements if elements else 0.0, sent, inside, codec, wait,
                    (now - last["time"]) / n, plan_text)
        self._last = dict(c, steps=steps, time=now)
