"""One replica group (one rank) of benchmarks/diloco_cluster.py: trains diloco.py's model and data
with one arm, timing every inner step and counting the bytes its interface sent.

    python benchmarks/diloco_worker.py --arm "GIFT INT3 H100" --replica 0 --replicas 2 \
        --address 10.77.0.1 --peer 10.77.0.1 --lighthouse http://10.77.0.254:PORT --out r.json

Arms (ARMS): DDP on gloo every step, plain or with GIFT's hook (horovod_gift.ddp, INT3); torchft's
DiLoCo in fp32; GiftDiLoCo with torchft's FP8 scheme (FP8, no transform, no error feedback: the
stand-in for torchft's should_quantize, which runs only on CUDA), with GIFT INT3 or with GIFT
NVFP4 (its default);
Streaming DiLoCo (two fragments, each synchronized every H steps in turn, the all-reduce started
one inner step before it is applied) with GIFT INT3. Every arm: the same seeded initialization,
data stream per replica (seed, replica), AdamW, and DiLoCo's outer SGD (lr 0.7, Nesterov 0.9).

--eval-every N: the held-out loss of the global weights (DiLoCo: each fragment's last synchronized
weights) every N steps, with the clock stopped. Bytes: this process's interface counter
(/proc/self/net/dev: wire bytes with headers and ACKs, the lighthouse's heartbeats included).
"""
import argparse
import contextlib
import json
import os
import pathlib
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from examples.data import ByteBatches, read_corpus  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402

DDP_PORT = 29531
# a replica group of several ranks (--group-size): its process group and its manager's store, one
# port apart per group (unshaped, every group is on 127.0.0.1)
GROUP_PORT, GROUP_STORE_PORT = 29541, 29561
# arm -> (engine, H, options): engine "ddp" (options: GIFT's, None plain), "diloco" (None:
# torchft's fp32 DiLoCo, else GiftDiLoCo's options) or "streaming" (GiftDiLoCo, two fragments)
FP8_STAND_IN = dict(format="fp8_e4m3", transform="none", error_feedback=False)
INT3 = dict(format="int3")
ARMS = {"DDP fp32": ("ddp", 1, None),
        "DDP + GIFT INT3": ("ddp", 1, INT3),
        **{f"DiLoCo fp32 H{h}": ("diloco", h, None) for h in (20, 50, 100, 200, 300)},
        "DiLoCo FP8 H100": ("diloco", 100, FP8_STAND_IN),
        **{f"GIFT INT3 H{h}": ("diloco", h, INT3) for h in (20, 50, 100, 200)},
        "GIFT NVFP4 H200": ("diloco", 200, dict(format="nvfp4")),
        **{f"GIFT FP8 H{h}": ("diloco", h, dict(format="fp8_e4m3")) for h in (200, 300)},
        "Streaming GIFT INT3 H100": ("streaming", 100, INT3)}


def interface_bytes(name):
    for line in pathlib.Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        iface, counters = line.split(":", 1)
        if iface.strip() == name:
            return int(counters.split()[8])
    raise ValueError(f"no interface {name}")


class Replica:
    def __init__(self, args):
        self.args = args
        torch.manual_seed(args.seed)
        self.model = Llama(LlamaConfig(dim=args.dim, n_layers=args.layers,
                                       max_seq_len=args.seq_len))
        self.data = ByteBatches(read_corpus(), args.seq_len, args.batch_size, seed=args.seed,
                                rank=args.replica * args.group_size + args.local)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.kind, self.sync_every, self.options = ARMS[args.arm]
        self.engine = self.manager = self.store = None
        self.train_model = self.model
        if self.kind == "ddp":
            self._ddp()
        else:
            self._diloco()

    def _ddp(self):
        from torch.nn.parallel import DistributedDataParallel
        args = self.args
        dist.init_process_group("gloo", init_method=f"tcp://{args.peer}:{DDP_PORT}",
                                rank=args.replica * args.group_size + args.local,
                                world_size=args.replicas * args.group_size,
                                timeout=timedelta(seconds=600))
        self.train_model = DistributedDataParallel(self.model)
        if self.options is not None:
            from horovod_gift.ddp import GiftState, gift_hook
            self.gift = GiftState(self.train_model, verbose=False, **self.options)
            self.train_model.register_comm_hook(self.gift, gift_hook)

    def _diloco(self):
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from horovod_gift.integrations.torchft import GiftDiLoCo
        args = self.args
        timeout = timedelta(seconds=600)
        group = {}
        if args.group_size > 1:
            # DDP inside the group, over its own loopback; GIFT's two hops across groups
            from torch.nn.parallel import DistributedDataParallel
            dist.init_process_group(
                "gloo", init_method=f"tcp://{args.address}:{GROUP_PORT + args.replica}",
                rank=args.local, world_size=args.group_size, timeout=timeout)
            self.train_model = DistributedDataParallel(self.model)
            group = dict(group=dist.group.WORLD)
        self.store = TCPStore(args.address, GROUP_STORE_PORT + args.replica if args.group_size > 1
                              else 0, is_master=args.local == 0, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.replicas,
            load_state_dict=self.model.load_state_dict, state_dict=self.model.state_dict,
            replica_id=str(args.replica), store_addr=args.address, store_port=self.store.port,
            hostname=args.address, rank=args.local, world_size=args.group_size,
            lighthouse_addr=args.lighthouse, port=0, timeout=timeout, quorum_timeout=timeout,
            use_async_quorum=False, init_sync=False)
        m = self.model
        if self.kind == "streaming":
            half = len(m.blocks) // 2       # lm_head shares embed's weight: it is in the first
            fragments = [torch.nn.ModuleList([m.embed, *m.blocks[:half]]),
                         torch.nn.ModuleList([*m.blocks[half:], m.norm])]
            extra = dict(fragment_sync_delay=1)
        else:
            fragments, extra = [m], {}
        # DiLoCo's outer step, one optimizer a fragment (torchft steps a fragment's at its sync)
        outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                 for f in fragments]
        if self.options is None:
            self.engine = DiLoCo(self.manager, fragments, self.inner, outer, self.sync_every)
        else:
            self.engine = GiftDiLoCo(self.manager, fragments, self.inner, outer,
                                     self.sync_every, **extra, **group, **self.options)

    def global_weights(self):
        """(parameter, the replicas' agreed value) pairs: DiLoCo's last synchronized weights."""
        if self.engine is None:
            return []
        from horovod_gift.integrations import torchft_internals as internals
        pairs = []
        for fragment in internals.fragments(self.engine):
            module = internals.fragment_module(fragment)
            for name, p in module.named_parameters():
                pairs.append((p, fragment.original_parameters[name]))
        return pairs

    @torch.no_grad()
    def heldout(self):
        pairs = self.global_weights()
        local = [p.detach().clone() for p, _ in pairs]
        for p, g in pairs:
            p.copy_(g)
        losses = [self.model(*self.data.validation(seed=1234 + b))[1].item()
                  for b in range(self.args.eval_batches)]
        for (p, _), v in zip(pairs, local):
            p.copy_(v)
        return sum(losses) / len(losses)

    def run(self):
        args, rows, evals = self.args, [], []
        clock = 0.0
        context = self.engine if self.engine is not None else contextlib.nullcontext()
        with context:
            for step in range(1, args.steps + 1):
                x, y = self.data.next()
                sent, t0 = interface_bytes(args.interface), time.perf_counter()
                self.inner.zero_grad()
                self.train_model(x, y)[1].backward()
                self.inner.step()          # DiLoCo's sync runs in the optimizer's post hook
                seconds = time.perf_counter() - t0
                clock += seconds
                rows.append(dict(step=step, seconds=seconds,
                                 sent=interface_bytes(args.interface) - sent))
                if args.eval_every and step % args.eval_every == 0 and args.local == 0:
                    evals.append(dict(step=step, clock=clock, heldout=self.heldout()))
        return dict(arm=args.arm, seed=args.seed, replica=args.replica, rows=rows, evals=evals,
                    parameters=sum(p.numel() for p in self.model.parameters()))

    def close(self):
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arm", required=True, choices=list(ARMS))
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--group-size", type=int, default=1, help="ranks a replica group")
    p.add_argument("--local", type=int, default=0, help="this rank's place in its group")
    p.add_argument("--address", default="127.0.0.1", help="this replica's address")
    p.add_argument("--peer", default="127.0.0.1", help="replica 0's address (DDP)")
    p.add_argument("--lighthouse", default=None)
    p.add_argument("--interface", default=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    replica = Replica(args)
    try:
        result = replica.run()
    finally:
        replica.close()
    if args.local == 0:     # the group's one report (its link's bytes are the namespace's)
        args.out.write_text(json.dumps(result))
    # DDP's replica 0, which hosted the TCPStore, was seen to hang in the interpreter's exit on
    # gloo's threads after its peer left: its result is written, so it leaves at once
    os._exit(0)


if __name__ == "__main__":
    main()
