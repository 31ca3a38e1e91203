"""One step's bucket reductions, each moved to its next stage as soon as its collective arrives.

A BucketReduction (collective.py) goes start() -> exchange() -> finish() (a TwoHopReduction,
two_hop.py, calls exchange() three times). GIFT's compressor starts a bucket once all its
gradients are in; every later compress calls progress(), which moves each bucket whose collective
has arrived to its next stage, oldest first, never waiting: the middle stages and the decoding
run inside backward, each bucket's payloads are freed as soon as they are read (with every
bucket's held until the step's end they came to 0.2-0.3x of the parameters' bytes), and when
backward ends only the last buckets' work is left.

On CUDA the middle stages (the owner's decode, fp32 sum and re-encode; a node's sum) run on a
side stream of the gradient's device, so that their kernels do not queue behind backward's on
the current stream. Horovod records an operation's ready event on the stream current when it is
enqueued (the side stream for the allgather of stage 2's bytes); the alltoall's output is read
on the side stream once the handle's wait() returned there (Horovod's completion: the host
waited for the operation) and is marked as used by the side stream before it is freed; the
current stream waits for a bucket's second stage (an event recorded after it) before it decodes
that bucket, and for the whole side stream before the step's end reads the stage-2 residuals.
"""
import abc
import functools

import torch


class Reduction(abc.ABC):
    """What StagePipeline reads of a bucket's quantized reduction (collective.BucketReduction,
    two_hop.TwoHopReduction): start() -> exchange() until stage reaches final_stage ->
    finish(over_inputs), ready() telling whether the next of them would wait. After it ran:
    flats (its inputs: their device), residual1 (a list or None) and residual2 (or None) for
    the scrub, amax_bounds (bounds on the encodes with a residual), and for the telemetry
    bytes_sent, node_bytes_sent (the part sent inside the node) and wait_seconds."""

    final_stage = 2
    stage = 0
    node_bytes_sent = 0

    @abc.abstractmethod
    def start(self):
        """Its first collective issued; returns self."""

    @abc.abstractmethod
    def ready(self):
        """Whether the next exchange() (or finish(), at final_stage) would not wait."""

    @abc.abstractmethod
    def exchange(self):
        """The next middle stage, waiting for the collective in flight."""

    @abc.abstractmethod
    def finish(self, over_inputs=False):
        """The reduced flats (over the inputs' storage with over_inputs)."""


@functools.lru_cache(maxsize=None)
def side_stream(device):
    """The stream of a CUDA device that second stages run on, made once per device."""
    return torch.cuda.Stream(device)


class StagePipeline:
    """The reductions of one step: bucket index -> its reduction (a BucketReduction, or a
    TwoHopReduction with more stages), and their results (bucket -> {name: reduced flat u}).
    buckets: the parameter names of each bucket; telemetry: adds each finished bucket's bytes
    sent and seconds waited."""

    def __init__(self, buckets, telemetry):
        self.buckets, self.telemetry = buckets, telemetry
        self.reductions, self.results = {}, {}
        self.in_flight = {}         # bucket -> its reduction, not finished yet, oldest first
        self.exchanged_events = {}  # CUDA: bucket -> an event after its latest middle stage
        self.exchanged = False      # every started bucket's last collective is in flight

    def start(self, bucket, reduction):
        if not isinstance(reduction, Reduction):
            raise TypeError(f"StagePipeline: bucket {bucket} got a {type(reduction).__name__}, "
                            "not a pipeline.Reduction")
        self.reductions[bucket] = self.in_flight[bucket] = reduction.start()

    def progress(self):
        """Move every bucket whose collective has arrived to its next stage (exchange() up to
        the reduction's final_stage, then finish()), oldest first, never waiting."""
        for bucket, reduction in list(self.in_flight.items()):
            while bucket in self.in_flight and reduction.ready():
                if reduction.stage < reduction.final_stage:
                    self._exchange(bucket, reduction)
                else:
                    self.finish(bucket)

    def exchange_all(self):
        """The middle stages not done during backward: whatever has arrived first, else the
        oldest bucket's next stage, waiting for it."""
        while True:
            self.progress()
            waiting = [(b, r) for b, r in self.in_flight.items() if r.stage < r.final_stage]
            if not waiting:
                break
            self._exchange(*waiting[0])
        self.exchanged = True

    def advance(self, bucket):
        """Move one bucket one stage on (its next exchange(), or finish()), waiting for its
        collective: for engines that match collectives by call order, where what happens next
        must not depend on what has arrived."""
        reduction = self.reductions[bucket]
        if reduction.stage < reduction.final_stage:
            self._exchange(bucket, reduction)
        else:
            self.finish(bucket)

    def _exchange(self, bucket, reduction):
        device = reduction.flats[0].device
        if device.type == "cuda":
            with torch.cuda.stream(side_stream(device)):
                reduction.exchange()
                event = self.exchanged_events[bucket] = torch.cuda.Event()
                event.record()
        else:
            reduction.exchange()

    def finish(self, bucket):
        """The bucket's reduced flat u, decoded over its transformed gradients (some of them
        p.grad itself: Horovod's own allreduce_async_ writes its result into p.grad too, and sets
        p.grad to what decompress returns); {name: u}."""
        if bucket not in self.results:
            reduction = self.reductions[bucket]
            while reduction.stage < reduction.final_stage:  # its middle stages first
                self._exchange(bucket, reduction)
            if bucket in self.exchanged_events:
                device = reduction.flats[0].device
                torch.cuda.current_stream(device).wait_event(self.exchanged_events[bucket])
            del self.in_flight[bucket]
            results = reduction.finish(over_inputs=True)
            self.results[bucket] = dict(zip(self.buckets[bucket], results))
            self.telemetry.add(bytes_sent=reduction.bytes_sent,
                               node_bytes_sent=reduction.node_bytes_sent,
                               wait_seconds=reduction.wait_seconds)
        return self.results[bucket]

    def residuals(self):
        """(every residual this step's encodes updated, bounds on those encodes' magnitudes),
        for ErrorFeedback.scrub, once the current stream has waited for the second stages."""
        residuals, bounds = [], []
        for device in {reduction.flats[0].device for reduction in self.reductions.values()}:
            if device.type == "cuda":
                torch.cuda.current_stream(device).wait_stream(side_stream(device))
        for reduction in self.reductions.values():
            residuals += (reduction.residual1 or []) + [reduction.residual2]
            bounds += reduction.amax_bounds
        return residuals, bounds
