"""Whole jobs under mpirun: a failing rank ends the job, and a restarted job resumes bit for bit."""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAIN = [
    str(ROOT / "examples" / "train_llama.py"),
    "--dim",
    "32",
    "--layers",
    "1",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--quiet",
]


def mpirun(np, *args, timeout=240):
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "mpirun.sh"), str(np), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_a_rank_that_raises_ends_the_job_with_an_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "import torch, horovod.torch as hvd, train_llama\n"
        "adamw_step, calls = torch.optim.AdamW.step, []\n"
        "def failing_step(self, *args, **kwargs):\n"
        "    calls.append(1)\n"
        "    if hvd.rank() == 1 and len(calls) == 3:\n"
        "        raise RuntimeError('rank 1 fails mid-run')\n"
        "    return adamw_step(self, *args, **kwargs)\n"
        "torch.optim.AdamW.step = failing_step\n"
        "train_llama.main()\n"
    )
    result = mpirun(
        2, str(script), *TRAIN[1:], "--steps", "50", "--compression", "gift-nvfp4", timeout=180
    )
    assert result.returncode != 0
    assert "rank 1 fails mid-run" in result.stdout + result.stderr


def test_restarted_processes_continue_bit_for_bit(tmp_path):
    straight, first, resumed = (
        tmp_path / "straight.pt",
        tmp_path / "first.pt",
        tmp_path / "resumed.pt",
    )
    common = [*TRAIN, "--compression", "gift-nvfp4"]
    for args in (
        [*common, "--steps", "16", "--checkpoint", str(straight)],
        [*common, "--steps", "8", "--checkpoint", str(first)],
        [*common, "--steps", "16", "--resume", str(first), "--checkpoint", str(resumed)],
    ):
        result = mpirun(2, *args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    a = torch.load(straight, weights_only=False)["model"]
    b = torch.load(resumed, weights_only=False)["model"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after the restart"


def torchrun(np, *args, timeout=240, launcher=()):
    return subprocess.run(
        [str(pathlib.Path(sys.executable).parent / "torchrun"), "--standalone",
         "--nproc-per-node", str(np), *launcher, *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


@pytest.mark.parametrize("engine, ranks", [("ddp", 2), ("fsdp", 2), ("hsdp", 4)])
def test_train_llama_under_torchrun_trains_and_resumes_bit_for_bit(tmp_path, engine, ranks):
    """examples/train_llama.py --engine ddp|fsdp|hsdp (HSDP: 2 nodes of 2 ranks): GIFT's
    statistics, residuals and step resume with the model and optimizer (FSDP: every rank's own
    shards)."""
    straight, first, resumed = (tmp_path / f"{n}.pt" for n in ("straight", "first", "resumed"))
    common = [*TRAIN, "--engine", engine, "--compression", "gift-nvfp4", "--node-size", "2"]
    outputs = []
    for args in (
        [*common, "--steps", "8", "--checkpoint", str(straight)],
        [*common, "--steps", "4", "--checkpoint", str(first)],
        [*common, "--steps", "8", "--resume", str(first), "--checkpoint", str(resumed)],
    ):
        result = torchrun(ranks, *args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
    assert f"with --engine {engine} --compression gift-nvfp4" in outputs[0]
    assert "bits per gradient element" in outputs[0]
    files = ([(straight, resumed)] if engine == "ddp" else
             [(f"{straight}.gift-rank{r}", f"{resumed}.gift-rank{r}") for r in range(ranks)])
    for a_path, b_path in files:
        a = torch.load(a_path, weights_only=False)["model"]
        b = torch.load(b_path, weights_only=False)["model"]
        for name in a:
            same = torch.equal(*(t.to_local() if hasattr(t, "to_local") else t
                                 for t in (a[name], b[name])))
            assert same, f"{name} differs after the restart"


DIES_IN_STEP = """
import os, signal, sys
sys.path.insert(0, {examples!r})
from torch.optim.optimizer import register_optimizer_step_pre_hook
import train_llama
steps = []

def die(optimizer, args, kwargs):
    # rank 1 of the first attempt, after step {step}'s backward and gradient collectives
    steps.append(1)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1" and os.environ["RANK"] == "0":
        with open({resumed!r}, "a") as f:     # the steps the restarted attempt takes
            f.write("x")
    if (len(steps) == {step} and os.environ["RANK"] == "1"
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
        open({marker!r}, "w").close()
        {die}

register_optimizer_step_pre_hook(die)
train_llama.main()
train_llama.shutdown()
"""


DEATHS = {"SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)",
          "SIGTERM": "os.kill(os.getpid(), signal.SIGTERM)",
          "exit 1": "os._exit(1)"}


# Every engine dies every way when GIFT_FAULTS=all (benchmarks/results/robustness.md has the run);
# make test takes 8 of the 12 (about 1.5 min each): every way under DDP, SIGKILL under every
# engine (Horovod's too), and one more way under FSDP and HSDP each.
EVERY_DEATH = os.environ.get("GIFT_FAULTS") == "all"
ENGINES = (("ddp", 2), ("fsdp", 2), ("hsdp", 4))
TORCHRUN_DEATHS = [(engine, ranks, death) for engine, ranks in ENGINES for death in DEATHS
                   if EVERY_DEATH or engine == "ddp" or death == "SIGKILL"
                   or (engine, death) in (("fsdp", "exit 1"), ("hsdp", "SIGTERM"))]


@pytest.mark.parametrize("engine, ranks, death", TORCHRUN_DEATHS)
def test_a_rank_killed_mid_step_under_torchrun_max_restarts_resumes_bit_for_bit(
        tmp_path, engine, ranks, death):
    """DDP or FSDP2 + GIFT INT3 on 2 ranks, HSDP on 2 nodes of 2, a checkpoint every 4 steps;
    rank 1 dies in step 9 of the first attempt (killed, terminated, or exiting 1). torchrun stops
    the survivors and starts every rank again; the example's process group connects
    (engines.init_process_group), --resume auto loads step 8, and step 12 ends with the bits of
    an uninterrupted run (parameters, the optimizer's state and GIFT's residuals; FSDP and HSDP:
    every rank's shards)."""
    script = tmp_path / "dies.py"
    marker, resumed_steps = tmp_path / "killed", tmp_path / "resumed-steps"
    script.write_text(DIES_IN_STEP.format(examples=str(ROOT / "examples"), step=9,
                                          die=DEATHS[death], marker=str(marker),
                                          resumed=str(resumed_steps)))
    common = [*TRAIN, "--engine", engine, "--compression", "gift-int3", "--steps", "12",
              *(["--node-size", "2"] if engine == "hsdp" else [])]
    straight, restarted = tmp_path / "straight.pt", tmp_path / "restarted.pt"
    result = torchrun(ranks, *common, "--checkpoint", str(straight))
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun(ranks, str(script), *common[1:], "--save-every", "4", "--checkpoint",
                      str(restarted), "--resume", "auto", launcher=["--max-restarts", "1"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert marker.exists(), "rank 1 was not killed: the test tested nothing"
    # the restarted attempt resumed at step 8 (from the checkpoint), not from the start
    assert resumed_steps.read_text() == "x" * 4, resumed_steps.read_text()
    assert_resumed_as_uninterrupted(straight, restarted, ranks, sharded=engine != "ddp")


def assert_resumed_as_uninterrupted(straight, restarted, ranks, sharded):
    """The last checkpoints of an uninterrupted run and of a resumed one hold the same bits:
    every rank's own file (GIFT's state; sharded: its shards of the parameters and optimizer
    too) and, unsharded, rank 0's parameters and optimizer state."""
    for rank in range(ranks):
        mine = torch.load(f"{straight}.gift-rank{rank}", weights_only=False)
        theirs = torch.load(f"{restarted}.gift-rank{rank}", weights_only=False)
        assert same_bits(mine, theirs), f"rank {rank}'s state differs"
    if sharded:
        return
    a = torch.load(straight, weights_only=False)
    b = torch.load(restarted, weights_only=False)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs"
    for key, value in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][key][k]) for k, v in value.items()
                   if torch.is_tensor(v)), key


HOROVOD_DIES_AFTER_SAVES = """
import os, signal, sys
sys.path.insert(0, {examples!r})
import horovod.torch as hvd
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
import train_llama
saves, saving, depth = [], train_llama.save_checkpoint, [0]

def save_checkpoint(*args):
    saving(*args)
    saves.append(1)

def die(optimizer, args, kwargs):
    # in the step after the checkpoint: Horovod's optimizer runs its base class's step inside
    # its own (depth 2), after synchronize(), so every peer has saved and done this step's
    # collectives too
    depth[0] += 1
    if depth[0] == 2 and len(saves) == {saves} and hvd.rank() == 1:
        open({marker!r}, "w").close()
        {die}

def leave(optimizer, args, kwargs):
    depth[0] -= 1

train_llama.save_checkpoint = save_checkpoint
register_optimizer_step_pre_hook(die)
register_optimizer_step_post_hook(leave)
train_llama.main()
"""


@pytest.mark.parametrize("death", list(DEATHS) if EVERY_DEATH else ["SIGKILL"])
def test_a_rank_killed_mid_step_under_mpirun_ends_the_job_and_a_relaunch_resumes_bit_for_bit(
        tmp_path, death):
    """Horovod + GIFT INT3 on 2 ranks under mpirun, a checkpoint every 4 steps; rank 1 is killed in
    step 9 (the step after the second checkpoint), after its gradient collectives. mpirun has
    no restart of its own: the job must end non-zero within a minute (mpirun stops the
    survivor), leaving step 8's checkpoint; the same command launched again with --resume auto
    ends step 12 with the bits of an uninterrupted run (parameters, the optimizer's state and
    every rank's GIFT state)."""
    script, marker = tmp_path / "dies.py", tmp_path / "killed"
    script.write_text(HOROVOD_DIES_AFTER_SAVES.format(examples=str(ROOT / "examples"), saves=2,
                                                      die=DEATHS[death], marker=str(marker)))
    common = [*TRAIN[1:], "--compression", "gift-int3", "--steps", "12"]
    straight, restarted = tmp_path / "straight.pt", tmp_path / "restarted.pt"
    result = mpirun(2, TRAIN[0], *common, "--checkpoint", str(straight))
    assert result.returncode == 0, result.stderr[-3000:]
    resumable = [*common, "--save-every", "4", "--checkpoint", str(restarted), "--resume", "auto"]
    t0 = time.monotonic()
    result = mpirun(2, str(script), *resumable, timeout=120)
    assert marker.exists(), "rank 1 was not killed: the test tested nothing"
    assert result.returncode != 0, "the job ended well with a rank dead"
    assert time.monotonic() - t0 < 90, "the survivor outlived its peer by more than a minute"
    assert torch.load(restarted, weights_only=False)["step"] == 8   # the last checkpoint
    result = mpirun(2, TRAIN[0], *resumable)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert torch.load(restarted, weights_only=False)["step"] == 12
    assert_resumed_as_uninterrupted(straight, restarted, 2, sharded=False)


def same_bits(a, b):
    """Whether two nested states hold the same tensors bit for bit and the same other values
    (a DTensor: its local shard)."""
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_bits, a, b))
    return a == b


def test_a_hung_collective_ends_the_job_at_the_per_test_timeout(tmp_path):
    test_file = tmp_path / "test_hang.py"
    test_file.write_text(
        "import torch, horovod.torch as hvd\n"
        "def test_ranks_wait_for_different_collectives():\n"
        "    hvd.init()\n"
        "    hvd.allreduce(torch.ones(4), name=f'never.matched.{hvd.rank()}')\n"
    )
    start = time.monotonic()
    result = mpirun(
        2,
        "-m",
        "pytest",
        str(test_file),
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "10",
        "--timeout-method",
        "thread",
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert time.monotonic() - start < 90
    assert "Timeout" in output and "test_ranks_wait_for_different_collectives" in output, output[
        -2000:
    ]


def test_a_stalled_rank_makes_every_rank_raise_naming_gifts_collective_and_rank(tmp_path):
    """Rank 1 stops sending for 12 s before step 2's backward; with Horovod's stall shutdown
    (README: In production) rank 0 raises within seconds, and rank 1 when it comes back, each
    naming GIFT's collective and its rank, not only Horovod's shutdown text."""
    script = tmp_path / "stall.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "os.environ.update(HOROVOD_STALL_CHECK_TIME_SECONDS='1',\n"
        "                  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='3')\n"
        "import torch, horovod.torch as hvd, horovod_gift as gift\n"
        "hvd.init()\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),\n"
        "                            torch.nn.Linear(32, 32))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "    named_parameters=model.named_parameters(),\n"
        "    compression=gift.GIFT(model, verbose=False))\n"
        f"out = pathlib.Path({str(tmp_path)!r})\n"
        "try:\n"
        "    for step in range(4):\n"
        "        if step == 2:\n"
        "            stalled = time.monotonic()\n"
        "            if hvd.rank() == 1:\n"
        "                time.sleep(12)\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(8, 32)).square().mean().backward()\n"
        "        opt.step()\n"
        "    outcome = 'finished'\n"
        "except Exception as e:\n"
        "    outcome = f'{time.monotonic() - stalled:.1f} {type(e).__name__}: {e}'\n"
        "(out / f'rank{hvd.rank()}.txt').write_text(outcome)\n"
        "while not (out / 'rank1.txt').exists():     # rank 0 stays until rank 1 has spoken\n"
        "    time.sleep(0.2)\n"
    )
    mpirun(2, str(script), timeout=180)
    for rank in (0, 1):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert re.search(rf"HorovodInternalError: GIFT: collective 'gift\.[^']+' on rank {rank} "
                         r"of 2 failed: Horovod has been shut down", outcome), outcome
    seconds = float((tmp_path / "rank0.txt").read_text().split()[0])
    assert seconds < 10, f"rank 0 raised {seconds} s into the stall, not at the stall shutdown"


def test_no_step_leaves_its_gradients_alive_in_a_cycle(tmp_path):
    """A fresh process compiles numba kernels in its first steps, and a compilation leaves its
    callers' frames (and the gradients they hold) in a reference cycle: without GIFT's collection
    after such a step, step 0's reductions outlived it (1x the parameters' bytes on CPU) until
    Python's cycle collector ran, which it never does here (disabled)."""
    script = tmp_path / "cycle.py"
    script.write_text(
        "import gc, sys, weakref, torch, horovod.torch as hvd, horovod_gift as gift\n"
        "from horovod_gift.kernels.native import CompileCount\n"
        "hvd.init()\n"
        "gc.disable()\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),\n"
        "                            torch.nn.Linear(64, 64))\n"
        "compression = gift.GIFT(model, transform='auto', refresh_every=2, verbose=False)\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "    named_parameters=model.named_parameters(), compression=compression)\n"
        "steps = []\n"
        "for step in range(4):\n"
        "    opt.zero_grad()\n"
        "    model(torch.randn(8, 64)).square().mean().backward()\n"
        "    steps.append(weakref.ref(compression.current.pipeline))\n"
        "    opt.step()\n"
        "alive = [k for k, ref in enumerate(steps) if ref() is not None]\n"
        "print('ALIVE', alive, 'COMPILED', CompileCount.count, flush=True)\n"
        "sys.exit(1 if alive or not CompileCount.count else 0)\n"
    )
    result = mpirun(2, str(script), timeout=180)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def test_two_hop_without_dynamic_process_sets_is_refused_on_every_rank(tmp_path):
    """Horovod started without dynamic process sets and none for the nodes: topology="two-hop"
    raises the same error on every rank (naming the line to add), "auto" takes the flat
    reduction with a warning, and training goes on."""
    script = tmp_path / "sets.py"
    script.write_text(
        "import json, sys, torch, horovod.torch as hvd, horovod_gift as gift\n"
        "hvd.init()\n"
        "def step(topology):\n"
        "    model = torch.nn.Linear(64, 64)\n"
        "    compression = gift.GIFT(model, topology=topology, node_size=2, verbose=False)\n"
        "    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "        named_parameters=model.named_parameters(), compression=compression)\n"
        "    model(torch.randn(8, 64)).square().mean().backward()\n"
        "    opt.step()\n"
        "    return compression\n"
        "raised = None\n"
        "try:\n"
        "    step('two-hop')\n"
        "except ValueError as error:\n"
        "    raised = str(error)\n"
        "compression = step('auto')\n"
        "with open(f'{sys.argv[1]}/rank{hvd.rank()}.json', 'w') as f:\n"     # one file a rank:
        "    json.dump([raised, compression.reducer.topology.describe()], f)\n"    # no mixed lines
    )
    result = mpirun(4, str(script), str(tmp_path), timeout=180)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    raised = {error for error, _ in outcomes}
    assert len(raised) == 1 and None not in raised, outcomes
    assert "hvd.init(process_sets='dynamic')" in raised.pop()
    assert all(topology == "flat" for _, topology in outcomes), outcomes
    assert "topology='auto' takes the flat reduction" in result.stdout + result.stderr


def test_a_transformers_model_with_checkpointing_trains_with_its_linear_weights_whitened():
    """examples/train_hf.py: GPT-2 from its config, activation checkpointing, every Conv1D and
    the tied embedding whitened (mpi_tests/test_transformers.py checks the ranks agree)."""
    result = mpirun(2, str(ROOT / "examples" / "train_hf.py"), "--config", "gpt2",
                    "--gradient-checkpointing", *TRAIN[1:], "--compression", "gift-nvfp4",
                    "--steps", "6")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "5 weights of linear modules (4 stored in x out), read through another module: " \
           "model.transformer.wte.weight by model.lm_head" in output
    assert "done: 6 steps on 2 ranks" in output
