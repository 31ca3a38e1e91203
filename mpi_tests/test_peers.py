"""Every arm of benchmarks/peers.py trains on this suite's ranks, unshaped (gloo on the loopback,
Horovod on the suite's MPI), through the same run_arm() the benchmark's ranks call, so the
benchmark keeps working as the library changes. 3 steps, not 2: PowerSGD with error feedback
may start no earlier than iteration 2, and the third step is the first it compresses.
"""
import math
import os
import pathlib
import socket
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import assert_identical_on_all_ranks
from mpi4py import MPI

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import peers_worker  # noqa: E402

COMM = MPI.COMM_WORLD
STEPS = 3


@pytest.fixture(scope="module")
def gloo():
    """The default torch.distributed group the DDP arms use, on the loopback."""
    port = None
    if COMM.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=COMM.rank,
                            world_size=COMM.size)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)      # run_arm sets one share of the cores per rank
    dist.destroy_process_group()


@pytest.mark.parametrize("arm", peers_worker.ARMS + list(peers_worker.NODE_ARMS))
def test_arm_trains_and_keeps_replicas_identical(arm, gloo):
    if arm.endswith("2hop") and COMM.size < 4:
        pytest.skip("two hops need 2 nodes of 2 ranks")     # benchmarks/cluster.py's arms
    args = peers_worker.parse_args([
        "--arm", arm, "--steps", str(STEPS), "--eval-every", "2", "--powersgd-start", "2",
        "--dim", "64", "--layers", "1", "--seq-len", "32", "--batch-size", "2",
        "--eval-batches", "2", "--quiet", "--node-size", "2"])
    torch.manual_seed(args.seed)
    initial = [p.detach().clone() for p in peers_worker.train_llama.build_model(
        args, torch.device("cpu")).parameters()]
    result = peers_worker.run_arm(args)

    assert result["arm"] == arm and result["ranks"] == COMM.size
    assert len(result["rows"]) == STEPS
    for row in result["rows"]:
        assert math.isfinite(row["loss"]), row
        assert row["codec"] >= 0 and row["wait"] >= 0 and row["seconds"] > 0, row
    assert [e["step"] for e in result["evals"]] == [0, 2, 3]
    assert all(math.isfinite(e["heldout"]) for e in result["evals"]), result["evals"]
    assert result["evals"][-1]["clock"] > 0
    # the arm's own compression ran: GIFT sent fewer than 32 bits an element, PowerSGD compressed
    assert result["compressed"], f"{arm} did not compress"
    # training moved the weights, and every rank holds the same replica
    assert any(not torch.equal(a, b) for a, b in zip(initial, result["params"])), arm
    assert_identical_on_all_ranks(result["params"], f"{arm}'s parameters")
