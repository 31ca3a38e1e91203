"""GiftDiLoCo (integrations/torchft.py) with DDP inside each replica group: the torchrun job's
ranks are split into 2 replica groups (each its own DDP process group, its own torchft Manager
and TCPStore), over one torchft Lighthouse. On 4 ranks (2 x 2) GIFT takes two hops, the replica
group as the node; on 2 ranks (2 x 1) the flat reduction."""
import datetime
import pathlib
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

pytest.importorskip("torchft")

from torch.distributed import TCPStore  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.manager import Manager  # noqa: E402

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "integrations"))

from helpers import Net, assert_identical_on_all_ranks, loss_of  # noqa: E402
from horovod_gift.integrations.torchft import GiftDiLoCo  # noqa: E402
from torchft_replicas import FaultyGloo  # noqa: E402  (counts the bytes handed to it)

TIMEOUT = datetime.timedelta(seconds=30)


def train(fail_at_sync=None, timeout=TIMEOUT):
    """12 inner steps, a sync every 4, in 2 replica groups of world / 2 DDP ranks; fail_at_sync
    = (sync, replica, local): that rank's next collective across replicas raises (injected) in
    that sync. Returns the global weights, the losses, the fragment's sync, what this rank
    handed the process group across replicas, and the manager's step (its count of commits)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_group = world // 2
    replica, local = divmod(rank, per_group)
    # every rank makes every group, in the same order (torch.distributed's rule)
    groups = [dist.new_group(list(range(k * per_group, (k + 1) * per_group)))
              for k in range(2)]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2) if rank == 0 else None
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if local == 0 \
        else None
    shared = [None] * world
    dist.all_gather_object(shared, (lighthouse.address() if lighthouse else None,
                                    store.port if store else None))
    torch.manual_seed(0)
    model = DDP(Net(), process_group=groups[replica])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    across = FaultyGloo(timeout=timeout)
    manager = Manager(pg=across, min_replica_size=2,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(replica), store_addr="localhost",
                      store_port=shared[replica * per_group][1], rank=local,
                      world_size=per_group, lighthouse_addr=shared[0][0], port=0,
                      timeout=timeout, use_async_quorum=False, init_sync=False)
    try:
        diloco = GiftDiLoCo(manager, [model], inner, outer, sync_every=4,
                            group=groups[replica], format="int3", verbose=False)
        losses = []
        with diloco:
            for step in range(12):
                if fail_at_sync is not None and fail_at_sync == (step // 4, replica, local):
                    across.fail = True
                inner.zero_grad()
                loss = loss_of(model, step, rank)
                loss.backward()
                inner.step()
                losses.append(loss.item())
        weights = list(diloco._fragments[0].original_parameters.values())
        return weights, losses, diloco.syncs[0], across.sent, manager.current_step()
    finally:
        dist.barrier()          # every rank done with the Lighthouse and the stores
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()


def test_replica_groups_of_ddp_ranks_agree_and_send_their_share_across_replicas():
    per_group = dist.get_world_size() // 2
    weights, losses, sync, sent, _ = train()
    assert_identical_on_all_ranks(weights, "the global weights")
    assert losses[-1] < losses[0], losses
    expected = (f"two-hop: 2 nodes x {per_group} ranks" if per_group > 1 else "flat")
    assert sync.described == expected
    # what this rank handed the process group across replicas, a sync (3 of them): 1/L of the
    # pseudo-gradient, where the flat reduction sends all of it (2 (n - 1) / n = 1 of it on 2
    # replicas): INT3 at 3.29 bits, tensors under min_elements in fp32, and the fingerprint of
    # the shared options (an int64 each) with 128 bytes to spare
    sizes = [p.numel() for p in Net().parameters()]
    quantized = sum(n for n in sizes if n >= 1024)
    small = sum(sizes) - quantized
    share = (quantized * 3.29 / 8 + small * 4) / per_group
    fingerprint = 8 * len(sync.fingerprint)
    assert 0.9 * share < sent / 3 < 1.1 * share + fingerprint + 128, (sent, share)


def test_a_hop_across_replicas_that_fails_on_one_rank_discards_the_step_on_every_rank():
    """Two hops (2 x 2): rank 1 of replica 0 fails in its hop across replicas in the second sync
    (its peer in replica 1 then times out); each rank's node peer learns it from the node's
    allgather, so every rank of both groups discards that outer step, none hangs, and the
    global weights stay identical (before the two-hop flag, the node's peers waited in the
    allgather until its timeout and the group missed the next quorum)."""
    if dist.get_world_size() != 4:
        pytest.skip("two hops need 2 replica groups of 2 ranks (torchrun_tests np=4)")
    timeout = datetime.timedelta(seconds=10)
    start = time.monotonic()
    weights, losses, sync, _, commits = train(fail_at_sync=(1, 0, 1), timeout=timeout)
    assert_identical_on_all_ranks(weights, "the global weights")
    assert commits == 2, f"{commits} outer steps committed of 3; the second should be discarded"
    assert losses[-1] < losses[0], losses
    assert time.monotonic() - start < 6 * timeout.total_seconds()
