"""NodeAwareCommunicator (reduce/node_aware.py) on simulated nodes, one thread a rank: the same
sums and broadcasts as one flat group, the same bits on every rank, and 1/L of an all-reduce (the
root's local rank only, for a broadcast) across the nodes."""
import pytest
import torch
from ranks import run_ranks

from horovod_gift.reduce.communicator import LocalGroup
from horovod_gift.reduce.node_aware import SMALL, NodeAwareCommunicator


class CountingCommunicator:
    """A communicator's calls, with the elements this rank sent through them counted."""

    def __init__(self, comm):
        self.comm, self.size, self.rank, self.sent = comm, comm.size, comm.rank, 0

    def allreduce_async(self, tensor, op, name):
        self.sent += tensor.numel()
        return self.comm.allreduce_async(tensor, op, name)

    def broadcast_async_(self, tensor, root, name):
        self.sent += tensor.numel() if self.rank == root else 0
        return self.comm.broadcast_async_(tensor, root, name)


def run_nodes(nodes, per_node, work, shuffled=False):
    """work(rank, NodeAwareCommunicator) on every rank, one thread a rank (ranks.run_ranks:
    its group is the world); rank = node * per_node + local, or node and local rank taken from
    a shuffled placement. (what each returned, its cross communicator)."""
    ranks = nodes * per_node
    node = [LocalGroup(per_node, threads=True).communicators() for _ in range(nodes)]
    cross = [[CountingCommunicator(c) for c in LocalGroup(nodes, threads=True).communicators()]
             for _ in range(per_node)]
    order = torch.randperm(ranks, generator=torch.Generator().manual_seed(1)).tolist() \
        if shuffled else list(range(ranks))

    def placed(rank, world):
        n, local = divmod(order[rank], per_node)
        return work(rank, NodeAwareCommunicator(world, node[n][local], cross[local][n]))
    crossing = [cross[order[r] % per_node][order[r] // per_node] for r in range(ranks)]
    return run_ranks(ranks, placed), crossing


def values(rank, numel):
    """Integers in floats: every order of the sum gives the same, exact result."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(-1000, 1000, (numel,), generator=generator).float()


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_an_allreduce_is_the_flat_one_with_one_lth_across_nodes(nodes, per_node, op):
    numel = 3 * SMALL + 5          # not a multiple of the node size: padded and dropped
    out, crossing = run_nodes(nodes, per_node,
                              lambda r, comm: comm.allreduce(values(r, numel).view(-1, 1), op,
                                                             "stats"))
    stacked = torch.stack([values(r, numel) for r in range(nodes * per_node)])
    expected = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    for result in out:
        assert not isinstance(result, Exception), result
        assert result.shape == (numel, 1)
        assert torch.equal(result.view(-1), expected)
    chunk = -(-numel // per_node)
    assert [c.sent for c in crossing] == [chunk] * (nodes * per_node)


def test_every_rank_gets_the_same_bits_of_a_rounded_sum():
    numel = 2 * SMALL
    out, _ = run_nodes(2, 4, lambda r, comm: comm.allreduce(torch.randn(
        numel, generator=torch.Generator().manual_seed(r)), "sum", "stats"))
    exact = torch.stack([torch.randn(numel, generator=torch.Generator().manual_seed(r))
                         for r in range(8)]).double().sum(0)
    for result in out:
        assert torch.equal(result, out[0])
    assert torch.allclose(out[0].double(), exact, atol=1e-4)


def test_a_small_allreduce_stays_flat():
    out, crossing = run_nodes(2, 2, lambda r, comm: comm.allreduce(
        torch.full((3,), float(r)), "max", "vote"))
    assert all(torch.equal(result, torch.full((3,), 3.0)) for result in out)
    assert all(c.sent == 0 for c in crossing)


@pytest.mark.parametrize("shuffled", [False, True])
def test_broadcasts_from_every_root_cross_once_from_the_roots_local_rank(shuffled):
    nodes, per_node = 2, 4
    ranks, numel = nodes * per_node, 100

    def work(rank, comm):
        # every root's broadcast started before any is waited for, as the refresh does
        tensors = [values(rank, numel) for _ in range(ranks)]
        handles = [comm.broadcast_async_(t, root, f"factors.{root}")
                   for root, t in enumerate(tensors)]
        return [handle.wait().clone() for handle in handles]
    out, crossing = run_nodes(nodes, per_node, work, shuffled)
    for received in out:
        assert not isinstance(received, Exception), received
        for root, tensor in enumerate(received):
            assert torch.equal(tensor, values(root, numel))
    # each root's tensor leaves its node once, sent by the root itself in its cross group
    assert [c.sent for c in crossing] == [numel] * ranks
