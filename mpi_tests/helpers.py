"""Cross-rank checks through mpi4py, independent of the Horovod code under test."""
from mpi4py import MPI

from outcomes import assert_identical, digest  # noqa: F401 (the suites' digest)

COMM = MPI.COMM_WORLD


def assert_identical_on_all_ranks(tensors, what="tensors"):
    assert_identical(tensors, what, COMM.allgather)


def assert_same_on_all_ranks(value, what="value"):
    values = COMM.allgather(value)
    assert all(v == values[0] for v in values), f"{what} differs across ranks: {values}"
