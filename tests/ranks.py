"""Ranks as threads of this process, for the single-process suites (one helper for every
package's tests): each rank's work runs in its own thread, over a threaded LocalGroup
(reduce/communicator.py) where it needs a communicator."""
import threading

from horovod_gift.reduce.communicator import LocalGroup


def in_threads(n, work):
    """work(k) for k in range(n), one thread each; what each returned, or the exception it
    raised (the tests look at every rank's outcome)."""
    out = [None] * n

    def run(k):
        try:
            out[k] = work(k)
        except Exception as error:     # every rank's error is what the tests look at
            out[k] = error
    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def run_ranks(n, work):
    """work(rank, comm) on every rank of a threaded LocalGroup of n ranks; what each returned,
    or the exception each raised."""
    comms = LocalGroup(n, threads=True, timeout=60).communicators()
    return in_threads(n, lambda rank: work(rank, comms[rank]))
