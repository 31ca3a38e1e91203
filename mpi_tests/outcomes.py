"""What the multi-process suites share (mpi_tests/ under mpirun, torchrun_tests/ under torchrun):
the exact bytes of tensors, the check that every rank holds the same ones, and one outcome for
every rank of a test. No engine is imported here:
each suite gathers across ranks with its own means (mpi4py; a gloo group of its own)."""
import hashlib

import torch


def digest(tensors):
    """SHA-256 of the exact bytes of a sequence of tensors (dtype and shape included)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_identical(tensors, what, allgather):
    """Every rank holds the same bytes in tensors; allgather(value) -> every rank's value in rank
    order (each suite's own means, bound by its helpers.assert_identical_on_all_ranks)."""
    digests = allgather(digest(tensors))
    assert len(set(digests)) == 1, f"{what} differ across ranks: {digests}"


def share_outcome(report, allgather):
    """A test's report failed on every rank if it failed on any, with each failing rank's
    message; allgather(value) -> every rank's value in rank order."""
    if report.when != "call":
        return
    everyone = allgather((report.failed, str(report.longrepr) if report.failed else ""))
    failures = [(rank, text) for rank, (failed, text) in enumerate(everyone) if failed]
    if failures and not report.failed:
        report.outcome = "failed"
    if failures:
        report.longrepr = "\n".join(
            f"--- rank {rank} of {len(everyone)} failed:\n{text}" for rank, text in failures)
