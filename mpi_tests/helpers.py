"""Cross-rank checks through mpi4py, independent of the Horovod code under test."""
import hashlib

import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def digest(tensors):
    """SHA-256 of the exact bytes of a sequence of tensors (dtype and shape included)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_identical_on_all_ranks(tensors, what="tensors"):
    digests = COMM.allgather(digest(tensors))
    assert len(set(digests)) == 1, f"{what} differ across ranks: {digests}"


def assert_same_on_all_ranks(value, what="value"):
    values = COMM.allgather(value)
    assert all(v == values[0] for v in values), f"{what} differs across ranks: {values}"
