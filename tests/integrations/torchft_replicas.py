"""Replica groups of one rank each, as threads of this process, over a real torchft Lighthouse,
Managers and gloo process groups (torchft's own integration tests run the same way)."""
import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft._torchft import LighthouseServer
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from horovod_gift.integrations.torchft import GiftDiLoCo

WIDTH = 64


class FaultyGloo(ProcessGroupGloo):
    """torchft's gloo process group whose next alltoall raises once `fail` is set (a collective
    that fails on one replica: the others then time out in theirs), and which counts in `sent`
    the bytes this rank hands its collectives for the other ranks, whoever calls them (GIFT or
    torchft): an all-reduce 2 (n - 1) / n of its tensors (a ring's share), an all-gather n - 1
    copies of its input, an alltoall all but its own split."""

    fail = False
    sent = 0

    def allreduce(self, tensors, opts):
        n = self.size()
        self.sent += sum(t.nbytes for t in tensors) * 2 * (n - 1) // n
        return super().allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensor, opts):
        self.sent += sum(t.nbytes for t in input_tensor) * (self.size() - 1)
        return super().allgather(output_tensors, input_tensor, opts)

    def alltoall_base(self, output_buffer, input_buffer, output_split_sizes, input_split_sizes,
                      opts):
        if self.fail:
            self.fail = False
            raise RuntimeError("alltoall failed: injected by the test")
        own = input_split_sizes[self.parent.rank()] * input_buffer[0].nbytes
        self.sent += input_buffer.nbytes - own
        return super().alltoall_base(output_buffer, input_buffer, output_split_sizes,
                                     input_split_sizes, opts)


def make_model(seed=0):
    """The same initial model in every replica (made in the main thread: torch's seed is global
    to the process, and threads would interleave their draws)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1))


def batch(replica, step):
    generator = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(32, WIDTH, generator=generator)
    return x, x[:, :4].sum(1, keepdim=True).sin()


class Replica:
    """What one replica group's training left: its global weights (each fragment's DiLoCo
    backup: what every replica agrees on), its GiftDiLoCo (or None), the state saved at
    save_at, the error it raised, and the bytes its process group sent (FaultyGloo.sent)."""

    weights = engine = saved = error = None
    sent = 0


def train_replica(replica, lighthouse, initial, run, barrier):
    """One replica group's training (run: run_replicas' arguments for this replica)."""
    out = Replica()
    model = make_model()
    start = run["resume"]
    model.load_state_dict(start["model"] if start else initial)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pg = FaultyGloo(timeout=timedelta(seconds=5))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg, min_replica_size=2,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   inner.load_state_dict(s["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=str(replica), store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse.address(), port=0,
        timeout=timedelta(seconds=20), use_async_quorum=False)
    fragments, sync_every, gift = run["fragments"], run["sync_every"], run["gift"]
    parts = [model[:2], model[2:]] if fragments == 2 else [model]
    # DiLoCo's outer step (lr 0.7, Nesterov 0.9), one optimizer a fragment as torchft asks
    outer = [torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for part in parts]
    engine = (GiftDiLoCo(manager, parts, inner, outer, sync_every, **gift) if gift is not None
              else DiLoCo(manager, parts, inner, outer, sync_every))
    if start:
        inner.load_state_dict(start["inner"])
        for optimizer, state in zip(outer, start["outer"]):
            optimizer.load_state_dict(state)
        manager.load_state_dict(start["manager"])
        for key, state in start["fragments"].items():
            manager._load_state_dict_fns[key](state)
        if gift is not None:
            engine.load_state_dict(start["gift"])
    fail_at = set(run["fail_at"])
    try:
        if barrier is not None:
            barrier.wait()
        with engine:
            for step in range(start["step"] if start else 0, run["steps"]):
                if run["until"] is not None and manager.current_step() >= run["until"]:
                    break
                x, y = batch(replica, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                # a fragment syncs every sync_every / fragments steps
                if (step + 1) % (sync_every // fragments) == 0 and \
                        manager.current_step() in fail_at:
                    fail_at.discard(manager.current_step())    # once: a failed step repeats
                    pg.fail = True
                inner.step()
                if step + 1 == run["save_at"]:
                    out.saved = copy.deepcopy({
                        "step": step + 1, "model": model.state_dict(),
                        "inner": inner.state_dict(), "outer": [o.state_dict() for o in outer],
                        "manager": manager.state_dict(),
                        # each fragment's global weights and outer optimizer (a fragment synced
                        # inner steps ago holds local weights that are not its global ones):
                        # torchft's own state functions, as a healing replica gets them
                        "fragments": {k: v for k, v in
                                      manager._manager_state_dict()["user"].items()
                                      if k.startswith("StreamingDiLoCoFragment")},
                        "gift": engine.state_dict() if gift is not None else None})
    except Exception as error:     # the tests look at every replica's error
        out.error = error
    finally:
        manager.shutdown(wait=False)
    out.weights = {f"{k}.{n}": t.clone() for k, fragment in enumerate(engine._fragments)
                   for n, t in fragment.original_parameters.items()}
    out.engine = engine if gift is not None else None
    out.sent = pg.sent
    return out


def run_replicas(n=2, steps=12, sync_every=4, gift=None, fragments=1, fail_at=None,
                 save_at=None, resume=None, until=None, rejoin=None):
    """Every replica's Replica after `steps` inner steps, in replica order. gift: GiftDiLoCo's
    options (None: torchft's DiLoCo), or a list of them, one a replica; fail_at: replica ->
    manager steps at which its next alltoall fails; save_at: the inner step after which each
    replica saves its state (Replica.saved); resume: each replica's saved state to start from;
    until: every replica stops once its manager has committed this many outer steps; rejoin:
    (replica, inner steps): that replica stops (its process group and manager shut down) after
    so many steps and a new one with its id joins, from the initial weights, and heals.
    Returns the replicas' Replica, the rejoined one last."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n)
    barrier = threading.Barrier(n)
    initial = make_model().state_dict()
    gifts = gift if isinstance(gift, list) else [gift] * n
    runs = [dict(steps=steps, sync_every=sync_every, gift=gifts[r], fragments=fragments,
                 fail_at=(fail_at or {}).get(r, ()), save_at=save_at, until=until,
                 resume=resume[r] if resume else None) for r in range(n)]
    if rejoin is not None:
        runs[rejoin[0]] = dict(runs[rejoin[0]], steps=rejoin[1])
    with contextlib.ExitStack() as stack:
        stack.callback(lighthouse.shutdown)
        with ThreadPoolExecutor(max_workers=n + 1) as pool:
            futures = [pool.submit(train_replica, r, lighthouse, initial, runs[r], barrier)
                       for r in range(n)]
            if rejoin is not None:
                left = futures[rejoin[0]].result(timeout=300)
                rejoined = dict(runs[rejoin[0]], steps=10 * steps)
                futures.append(pool.submit(train_replica, rejoin[0], lighthouse, initial,
                                           rejoined, None))
                futures[rejoin[0]] = None
                return [left if f is None else f.result(timeout=300) for f in futures]
            return [f.result(timeout=300) for f in futures]
