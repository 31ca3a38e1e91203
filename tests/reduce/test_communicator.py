"""StopAtFirstError: after one collective of a rank fails, it issues no other (its peers would
read that rank's next collective as the one they are still in)."""
import pytest
import torch

from horovod_gift.reduce.communicator import Communicator, Done, Handle, StopAtFirstError


class Failing(Handle):
    def poll(self):
        return True

    def wait(self):
        raise RuntimeError("peer gone")


class Recorder(Communicator):
    """Records what it is asked to issue; its alltoall raises when issued, its allreduce when
    waited for."""

    size, rank = 2, 0

    def __init__(self):
        self.issued = []

    def alltoall_async(self, tensor, splits, name):
        self.issued.append(name)
        raise RuntimeError("alltoall refused")

    def allgather_async(self, tensor, name):
        self.issued.append(name)
        return Done(torch.cat([tensor, tensor]))

    def allreduce_async(self, tensor, op, name):
        self.issued.append(name)
        return Failing()

    def broadcast_async_(self, tensor, root, name):
        self.issued.append(name)
        return Done(tensor)


@pytest.mark.parametrize("failure", ["issued", "waited for"])
def test_a_communicator_issues_nothing_after_a_collective_fails(failure):
    inner = Recorder()
    comm = StopAtFirstError(inner)
    assert comm.allgather_async(torch.ones(1), "before").wait().tolist() == [1.0, 1.0]
    pending = comm.allgather_async(torch.ones(1), "pending")
    with pytest.raises(RuntimeError, match="refused|peer gone"):
        if failure == "issued":
            comm.alltoall_async(torch.ones(2), torch.tensor([1, 1]), "fails")
        else:
            comm.allreduce_async(torch.ones(1), "sum", "fails").wait()
    with pytest.raises(RuntimeError, match="'after' not issued: an earlier one on this rank"):
        comm.allgather_async(torch.ones(1), "after")
    with pytest.raises(RuntimeError, match="not waited for: an earlier collective"):
        pending.wait()
    assert inner.issued == ["before", "pending", "fails"]
