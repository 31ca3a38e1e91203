"""Replica groups of one rank each, as threads of this process, over a real torchft Lighthouse,
Managers and gloo process groups (torchft's own integration tests run the same way)."""
import contextlib
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
    """torchft's gloo process group whose next alltoall raises once `fail` is set: a collective
    that fails on one replica (the others then time out in theirs)."""

    fail = False

    def alltoall_base(self, *args, **kwargs):
        if self.fail:
            self.fail = False
            raise RuntimeError("alltoall failed: injected by the test")
        return super().alltoall_base(*args, **kwargs)


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


def train_replica(replica, lighthouse, initial, steps, sync_every, gift, fragments, fail_at,
                  barrier, log):
    """One replica group's training; returns its global weights and GiftDiLoCo (or None).
    fail_at: manager steps at which this replica's next alltoall fails."""
    model = make_model()
    model.load_state_dict(initial)
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
    parts = [model[:2], model[2:]] if fragments == 2 else [model]
    # DiLoCo's outer step (lr 0.7, Nesterov 0.9), one optimizer a fragment as torchft asks
    outer = [torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for part in parts]
    engine = (GiftDiLoCo(manager, parts, inner, outer, sync_every, **gift) if gift is not None
              else DiLoCo(manager, parts, inner, outer, sync_every))
    try:
        barrier.wait()
        with engine:
            for step in range(steps):
                x, y = batch(replica, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                # a fragment syncs every sync_every / fragments steps
                if (step + 1) % (sync_every // fragments) == 0 and \
                        manager.current_step() in fail_at:
                    fail_at.discard(manager.current_step())    # once: a failed step repeats
                    pg.fail = True
                inner.step()
                log.append((replica, step, manager.current_step()))
    finally:
        manager.shutdown(wait=False)
    # the global weights of each fragment (DiLoCo's backup): what every replica agrees on
    global_weights = {f"{k}.{n}": t.clone() for k, fragment in enumerate(engine._fragments)
                      for n, t in fragment.original_parameters.items()}
    return global_weights, (engine if gift is not None else None)


def run_replicas(n=2, steps=12, sync_every=4, gift=None, fragments=1, fail_at=None):
    """Every replica's (global weights, GiftDiLoCo) after `steps` inner steps, in replica order."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n)
    barrier, log = threading.Barrier(n), []
    initial = make_model().state_dict()
    fail_at = fail_at or {}
    with contextlib.ExitStack() as stack:
        stack.callback(lighthouse.shutdown)
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(train_replica, r, lighthouse, initial, steps, sync_every, gift,
                                   fragments, set(fail_at.get(r, ())), barrier, log)
                       for r in range(n)]
            return [f.result(timeout=300) for f in futures]
