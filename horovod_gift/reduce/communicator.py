"""The collectives GIFT's engine-neutral core uses, as a small interface an engine implements.

The codec, the buckets (collective.py), error feedback, transforms, statistics and checkpoints
talk only to a Communicator; each engine maps it onto its collectives
(hvd.comm.HorovodCommunicator, torch_comm.TorchCommunicator). Every call is collective over the
communicator's ranks, matched by `name` (a fixed, small set of names reused every step: engines
cache by name).

    handle = comm.alltoall_async(send, splits, "b3.reduce_scatter")
    if handle.poll(): received, received_splits = handle.wait()

Ranks are the communicator's own (0 .. size - 1), also for a broadcast's root.
"""
import contextlib
import pickle
import threading
from abc import ABC, abstractmethod

import torch


class Handle(ABC):
    """An operation in flight. what: the collective and this rank in the words of an error
    (Communicator.named sets it: an engine's bare timeout or shutdown names neither)."""

    what = "a collective"

    @abstractmethod
    def poll(self):
        """True once wait() would return without blocking."""

    @abstractmethod
    def wait(self):
        """The operation's result (see the Communicator method that made it)."""


class Done(Handle):
    """A handle whose result is already there."""

    def __init__(self, result):
        self.result = result

    def poll(self):
        return True

    def wait(self):
        return self.result


class Communicator(ABC):
    """size: the number of ranks; rank: this one's, 0 .. size - 1."""

    size: int
    rank: int

    @abstractmethod
    def alltoall_async(self, tensor, splits, name):
        """Send tensor's split j (splits: int32 CPU tensor of size elements, in order) to rank j.
        wait(): (the received splits concatenated in rank order, their sizes as a CPU tensor)."""

    @abstractmethod
    def allgather_async(self, tensor, name):
        """Every rank's tensor, all of one size, concatenated in rank order (wait())."""

    @abstractmethod
    def allreduce_async(self, tensor, op, name):
        """The elementwise op ("sum", "max" or "min") of every rank's tensor (wait())."""

    @abstractmethod
    def broadcast_async_(self, tensor, root, name):
        """tensor overwritten with rank root's; wait() returns it."""

    def allreduce(self, tensor, op, name):
        return self.allreduce_async(tensor, op, name).wait()

    def named(self, handle, name):
        """handle, its errors naming the collective and this rank."""
        handle.what = f"collective {name!r} on rank {self.rank} of {self.size}"
        return handle

    def allgather_object(self, obj, name):
        """Every rank's picklable obj, in rank order: sizes first, then the bytes padded to the
        largest (an allgather of one size; host tensors)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.allgather_async(torch.tensor([data.numel()], dtype=torch.int64, device="cpu"),
                                     f"{name}.sizes").wait().tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device="cpu")
        padded[: data.numel()] = data
        gathered = self.allgather_async(padded, f"{name}.data").wait().view(self.size, -1)
        return [pickle.loads(row[:size].numpy().tobytes()) for row, size in zip(gathered, sizes)]


class StopAtFirstError(Communicator):
    """comm, until one of its collectives raises (when issued or waited for): from then on each
    later call raises at once and issues nothing, and a wait for one issued before raises too
    (its result is of no use, and it may only end at the timeout). A rank that left a collective
    would otherwise send its next one's bytes to peers still in the first (torchft's rule after
    an error: skip every later collective; gloo aborts the process on the mismatch)."""

    def __init__(self, comm):
        self.comm, self.size, self.rank = comm, comm.size, comm.rank
        self.error = None

    def _issue(self, method, name, *args):
        if self.error is not None:
            raise RuntimeError(f"GIFT: collective {name!r} not issued: an earlier one on this "
                               f"rank failed ({self.error})")
        try:
            return _Watched(getattr(self.comm, method)(*args, name), self)
        except Exception as error:
            self.error = error
            raise

    def alltoall_async(self, tensor, splits, name):
        return self._issue("alltoall_async", name, tensor, splits)

    def allgather_async(self, tensor, name):
        return self._issue("allgather_async", name, tensor)

    def allreduce_async(self, tensor, op, name):
        return self._issue("allreduce_async", name, tensor, op)

    def broadcast_async_(self, tensor, root, name):
        return self._issue("broadcast_async_", name, tensor, root)


class _Watched(Handle):
    def __init__(self, handle, owner):
        self.handle, self.owner = handle, owner

    def poll(self):
        return self.owner.error is not None or self.handle.poll()

    def wait(self):
        if self.owner.error is not None:
            raise RuntimeError(f"GIFT: not waited for: an earlier collective on this rank failed "
                               f"({self.owner.error})")
        try:
            return self.handle.wait()
        except Exception as error:
            self.owner.error = error
            raise


class LocalGroup:
    """n ranks in one process, each a LocalCommunicator (communicators()): for tests and
    simulations. The c-th call of a name on one rank meets the c-th call of it on the others.
    Driven from one thread, a wait() needs all of them made first (else it raises); with
    threads=True each rank runs in a thread of its own and wait() blocks until the others have
    made the call (timeout seconds, then it raises). Received tensors are new, as from a
    network."""

    def __init__(self, n, threads=False, timeout=60.0):
        self.n, self.sent, self.calls, self.waited = n, {}, {}, {}
        self.ready = {}         # (name, call, rank) -> ready_event of what was sent
        self.latest = {}        # name -> what its last waited call gave (for inspection)
        self.arrived = threading.Condition() if threads else None
        self.timeout = timeout

    def communicators(self):
        return [LocalCommunicator(self, rank) for rank in range(self.n)]

    def post(self, name, rank, value, combine):
        """value: the tensor (or tuple of tensors) rank sends, copied on the current stream."""
        with self.arrived or contextlib.nullcontext():
            call = self.calls[name, rank] = self.calls.get((name, rank), 0) + 1
            self.sent[name, call, rank] = value
            self.ready[name, call, rank] = ready_event(value)
            if self.arrived:
                self.arrived.notify_all()
        return LocalHandle(self, (name, call), combine)


def ready_event(value):
    """On CUDA, (an event recorded after the kernels that made value, its device), as Horovod
    records one on the current stream when a collective is enqueued; None on the CPU."""
    first = value[0] if isinstance(value, (tuple, list)) else value
    if not first.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first.device))
    return event, first.device


class LocalHandle(Handle):
    """Once every rank has waited on a call, what was sent for it is dropped."""

    def __init__(self, group, key, combine):
        self.group, self.key, self.combine, self.result = group, key, combine, None

    def poll(self):
        return self.result is not None or all((*self.key, k) in self.group.sent
                                              for k in range(self.group.n))

    def wait(self):
        if self.group.arrived is None:
            return self._wait()
        with self.group.arrived:
            if not self.group.arrived.wait_for(self.poll, self.group.timeout):
                raise TimeoutError(f"LocalGroup: call {self.key[1]} of {self.key[0]}: the other "
                                   f"ranks did not make it within {self.group.timeout} s")
            return self._wait()

    def _wait(self):
        if self.result is not None:
            return self.result
        group, n = self.group, self.group.n
        if not self.poll():
            raise RuntimeError(f"LocalGroup: call {self.key[1]} of {self.key[0]} waited on "
                               "before every rank made it")
        for k in range(n):   # the stream that combines waits for every sender's copy
            ready = group.ready[(*self.key, k)]
            if ready is not None:
                event, device = ready
                torch.cuda.current_stream(device).wait_event(event)
        self.result = group.latest[self.key[0]] = self.combine(
            [group.sent[(*self.key, k)] for k in range(n)])
        for k in range(n):   # the senders' copies must outlive this stream's reads of them
            if group.ready[(*self.key, k)] is not None:
                sent = group.sent[(*self.key, k)]
                for tensor in sent if isinstance(sent, (tuple, list)) else [sent]:
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
        waited = group.waited[self.key] = group.waited.get(self.key, 0) + 1
        if waited == n:
            del group.waited[self.key]
            for k in range(n):
                del group.sent[(*self.key, k)], group.ready[(*self.key, k)]
        return self.result


class LocalCommunicator(Communicator):
    """Rank `rank` of a LocalGroup."""

    def __init__(self, group, rank):
        self.group, self.size, self.rank = group, group.n, rank

    def alltoall_async(self, tensor, splits, name):
        def combine(sent):          # every source's split for this rank
            parts = [chunks[self.rank] for chunks in sent]
            return (torch.cat(parts),
                    torch.tensor([p.numel() for p in parts], dtype=torch.int32, device="cpu"))
        parts = torch.split(tensor.clone(), splits.tolist())
        return self.group.post(name, self.rank, parts, combine)

    def allgather_async(self, tensor, name):
        return self.group.post(name, self.rank, tensor.clone(), torch.cat)

    def allreduce_async(self, tensor, op, name):
        reduce = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]

        def combine(sent):
            total = sent[0].clone()
            for value in sent[1:]:  # in rank order, as every rank sees it
                total = reduce(total, value)
            return total
        return self.group.post(name, self.rank, tensor.clone(), combine)

    def broadcast_async_(self, tensor, root, name):
        def combine(sent):
            return tensor.copy_(sent[root])
        return self.group.post(name, self.rank, tensor.clone(), combine)
