"""The machinery the quantized path stands on: Horovod collectives over MPI, with uint8 payloads."""
import torch
import horovod.torch as hvd

from helpers import COMM, assert_identical_on_all_ranks, assert_same_on_all_ranks


def test_world_matches_mpi():
    assert hvd.size() == COMM.size and hvd.rank() == COMM.rank
    assert hvd.mpi_enabled()


def test_allreduce_sum_and_average():
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(10, dtype=torch.float32) * (r + 1)
    total = hvd.allreduce(x, op=hvd.Sum, name="transport.allreduce.sum")
    expected = torch.arange(10, dtype=torch.float32) * (n * (n + 1) / 2)
    assert torch.equal(total, expected)
    avg = hvd.allreduce(x, op=hvd.Average, name="transport.allreduce.avg")
    assert torch.allclose(avg, expected / n)
    assert_identical_on_all_ranks([total, avg], "allreduce results")


def test_allgather_uint8_payloads_of_different_lengths():
    r = hvd.rank()
    payload = torch.full((r + 3,), 200 + r, dtype=torch.uint8)  # > 127: a signed view would break
    out = hvd.allgather(payload, name="transport.allgather.uint8")
    assert out.dtype == torch.uint8
    expected = torch.cat(
        [torch.full((k + 3,), 200 + k, dtype=torch.uint8) for k in range(hvd.size())]
    )
    assert torch.equal(out, expected)
    assert_same_on_all_ranks(out.numel(), "allgathered byte count")


def test_alltoall_uint8_with_splits():
    n, r = hvd.size(), hvd.rank()
    # rank r sends (r + k + 1) bytes valued 16*r + k to rank k
    splits = torch.tensor([r + k + 1 for k in range(n)], dtype=torch.int32)
    payload = torch.cat([torch.full((r + k + 1,), 16 * r + k, dtype=torch.uint8) for k in range(n)])
    received, received_splits = hvd.alltoall(
        payload, splits=splits, name="transport.alltoall.uint8"
    )
    assert received.dtype == torch.uint8
    assert received_splits.tolist() == [k + r + 1 for k in range(n)]
    expected = torch.cat(
        [torch.full((k + r + 1,), 16 * k + r, dtype=torch.uint8) for k in range(n)]
    )
    assert torch.equal(received, expected)
    sent, got = COMM.allgather(payload.numel()), COMM.allgather(received.numel())
    assert sum(sent) == sum(got), "bytes sent and received across the world disagree"
