"""One rank of benchmarks/peers.py: trains examples/train_llama.py's model, data and optimizer with
one arm and times every step. peers.py starts it under mpirun, each rank in its own network
namespace; mpi_tests/test_peers.py calls run_arm() in-process for every arm.

    mpirun -np 2 ... python benchmarks/peers_worker.py --arm ddp-powersgd-r1 --out r.json \
        --steps 240 --eval-every 20 [any examples/train_llama.py flag: --dim, --seed, ...]

Arms: Horovod fp32 / fp16 / GIFT (train_llama's make_compression, the library's defaults) through
hvd.DistributedOptimizer; torch DDP over gloo, plain, with its bf16 hook, with PowerSGD (rank 1
or 4, error feedback and warm start on) or with GIFT's hook (horovod_gift.ddp); FSDP2 over gloo,
plain or with GIFT's reduce-scatter (horovod_gift.fsdp). Every arm: the same seeded init, batches,
AdamW and warm-up.

Each step records its wall seconds split three ways (why each split is where it is: see
HorovodArm.step and DdpArm.step), and the bytes this rank's interface sent during the step
(/proc/self/net/dev: wire bytes, headers and ACKs included). Every --eval-every steps the held-out
loss on train_llama's validation batches is measured with the clock stopped.
"""
import argparse
import json
import math
import os
import pathlib
import resource
import sys
import time

import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from horovod_gift.torch_comm import REDUCE_SCATTER

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import train_llama  # noqa: E402
from data import ByteBatches, read_corpus  # noqa: E402

HOROVOD_ARMS = {"hvd-fp32": "none", "hvd-fp16": "fp16", "gift-fp8": "gift-fp8",
                "gift-nvfp4": "gift-nvfp4"}           # arm -> train_llama --compression
# benchmarks/cluster.py's arms on nodes of --node-size ranks: arm -> (--compression, GIFT options)
NODE_ARMS = {"hvd-fp32-hier": ("none", {}),
             "gift-nvfp4-flat": ("gift-nvfp4", {"topology": "flat"}),
             "gift-nvfp4-2hop": ("gift-nvfp4", {"topology": "two-hop"}),
             "gift-fp8-2hop": ("gift-fp8", {"topology": "two-hop"}),
             "gift-int3-2hop": ("gift-int3", {"topology": "two-hop"})}
# arm -> its hook: PowerSGD's rank, "bf16" (DDP's bf16_compress_hook), "gift" (GIFT's), None
DDP_ARMS = {"ddp-fp32": None, "ddp-bf16": "bf16", "ddp-powersgd-r1": 1, "ddp-powersgd-r4": 4,
            "ddp-gift-nvfp4": "gift"}
# arm -> (its mesh: "fsdp" over every rank, "fsdp-hpz" the same with the backward all-gather
# in the node (reshard_after_forward=--node-size), or "hsdp" (nodes, --node-size); FSDP's
# reduce_dtype; GIFT's options or None); benchmarks/fsdp_cluster.py runs the node arms
FSDP_ARMS = {"fsdp-fp32": ("fsdp", None, None),
             "fsdp-gift-nvfp4": ("fsdp", None, {"topology": "flat"})}
FSDP_NODE_ARMS = {"fsdp-bf16": ("fsdp", torch.bfloat16, None),
                  "fsdp-gift-nvfp4-2hop": ("fsdp", None, {"topology": "two-hop"}),
                  "hsdp-fp32": ("hsdp", None, None),
                  "hsdp-bf16": ("hsdp", torch.bfloat16, None),
                  "hsdp-gift-nvfp4": ("hsdp", None, {}),
                  "hsdp-gift-nvfp4-ag8": ("hsdp", None, {"param_format": "fp8_e4m3"}),
                  "hsdp-gift-int3": ("hsdp", None, {"format": "int3"}),
                  "fsdp-gift-int3-2hop": ("fsdp", None, {"topology": "two-hop",
                                                         "format": "int3"}),
                  "fsdp-gift-nvfp4-2hop-ag8": ("fsdp", None, {"topology": "two-hop",
                                                              "param_format": "fp8_e4m3"}),
                  "fsdp-gift-nvfp4-2hop-ag8-hpz": ("fsdp-hpz", None, {
                      "topology": "two-hop", "param_format": "fp8_e4m3"})}
FSDP_ARMS.update(FSDP_NODE_ARMS)
ARMS = ["hvd-fp32", "hvd-fp16", "ddp-fp32", "ddp-bf16", "ddp-powersgd-r1", "ddp-powersgd-r4",
        "ddp-gift-nvfp4", "fsdp-fp32", "fsdp-gift-nvfp4", "gift-fp8", "gift-nvfp4"]
TORCH_ARMS = set(DDP_ARMS) | set(FSDP_ARMS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", required=True, choices=ARMS + list(NODE_ARMS) + list(FSDP_NODE_ARMS))
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks a node, for the two-hop arms (consecutive ranks share a node)")
    p.add_argument("--ifname", default=None, help="count the bytes this interface sends")
    p.add_argument("--powersgd-start", type=int, default=None,
                   help="PowerSGD's start_powerSGD_iter (default: max(20 warm-up steps, 10 %% of "
                        "--steps), as its documentation advises)")
    p.add_argument("--out", default=None, help="rank 0 writes the result here (JSON)")
    own, rest = p.parse_known_args(argv)
    args = train_llama.parse_args(rest)          # model, data and optimizer flags, same defaults
    for key, value in vars(own).items():
        setattr(args, key, value)
    if args.powersgd_start is None:
        args.powersgd_start = max(20, args.steps // 10)
    return args


def tx_bytes(ifname):
    """Bytes sent so far by this network namespace's interface `ifname` (0 without one)."""
    if not ifname:
        return 0
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                return int(counters.split()[8])
    raise RuntimeError(f"no interface {ifname!r} in this network namespace")


class HorovodArm:
    """hvd.DistributedOptimizer with train_llama's compression of this arm."""

    def __init__(self, arm, model, args):
        import horovod.torch as hvd
        self.hvd, self.model = hvd, model
        self.rank, self.size = hvd.rank(), hvd.size()
        name, options = NODE_ARMS.get(arm, (HOROVOD_ARMS.get(arm), {}))
        if options.get("topology") == "two-hop":
            options = dict(options, node_size=args.node_size)
        compression, self.gift = train_llama.make_compression(name, model, **options)
        self.optimizer = hvd.DistributedOptimizer(
            train_llama.make_optimizer(model, args.lr), named_parameters=model.named_parameters(),
            compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # no broadcast_optimizer_state: the state is fresh on every rank, and the broadcast would
        # take one AdamW step on zero gradients first (Horovod's way to create the state), which
        # shrinks the next steps through Adam's bias correction and DDP's arms do not take it

    def step(self, x, y):
        """Returns (loss, codec seconds, waiting seconds). GIFT: its own counters of codec work
        and of time blocked on the network. fp32/fp16: waiting is the time blocked in
        synchronize() (Horovod's allreduces overlap the backward pass until then; fp16's casts
        are in it); codec 0. Compute is the rest of the step."""
        before = self.gift.stats() if self.gift is not None else None
        self.optimizer.zero_grad()
        _, loss = self.model(x, y)
        loss.backward()
        t = time.perf_counter()
        self.optimizer.synchronize()
        blocked = time.perf_counter() - t
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        if self.gift is None:
            return loss, 0.0, blocked
        after = self.gift.stats()
        return (loss, after["codec_seconds"] - before["codec_seconds"],
                after["wait_seconds"] - before["wait_seconds"])

    def allreduce_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="peers.heldout")

    def allgather(self, value):
        return self.hvd.allgather_object(value, name="peers.gather")

    def compressed(self):
        return self.gift is None or self.gift.stats()["bits_per_element"] < 32


class DdpArm:
    """torch DDP on the default (gloo) process group, with the hook of its arm."""

    def __init__(self, arm, model, args):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from horovod_gift.ddp import GiftState, gift_hook
        self.dist, self.module = dist, model
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.optimizer = train_llama.make_optimizer(model, args.lr)
        self.powersgd = self.gift = None
        hook = DDP_ARMS[arm]
        if not isinstance(hook, int):
            self.model = torch.nn.parallel.DistributedDataParallel(model)   # rank 0's weights
        else:
            # one bucket (an explicit cap drops DDP's small first bucket): with two, PowerSGD's
            # allreduces are issued from gloo's callback threads of both buckets, in an order
            # that can differ between ranks, and gloo aborts on the mismatch (seen at rank 4)
            self.model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
            self.powersgd = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=hook,
                start_powerSGD_iter=args.powersgd_start, use_error_feedback=True, warm_start=True)
            self.model.register_comm_hook(self.powersgd, self._timed(psgd.powerSGD_hook))
        if hook == "bf16":
            self.model.register_comm_hook(None, self._timed(default_hooks.bf16_compress_hook))
        elif hook == "gift":
            self.gift = GiftState(self.model, format="nvfp4", verbose=False)
            self.model.register_comm_hook(self.gift, self._timed(gift_hook))
        self.hook_seconds = self.hook_end = self.grads_end = 0.0
        for p in model.parameters():       # marks when the last local gradient is complete
            p.register_post_accumulate_grad_hook(self._mark)

    def _mark(self, _):
        self.grads_end = time.perf_counter()

    def _timed(self, hook):
        def timed(state, bucket):
            t = time.perf_counter()
            future = hook(state, bucket)
            self.hook_end = time.perf_counter()
            self.hook_seconds += self.hook_end - t
            return future
        return timed

    def step(self, x, y):
        """Returns (loss, codec seconds, waiting seconds). DDP's allreduces overlap backward()
        and backward() returns only when they are done, so waiting is the tail of backward()
        after the last local gradient (and the last comm hook) finished. Codec: time in the
        hook on this thread (PowerSGD: P = MQ, error feedback; its orthogonalization, Q = M^T P
        and decompression run in gloo's callback thread and so count as waiting); GIFT's hook
        waits for its collectives on this thread: GIFT's own count of that waiting moves from
        codec to waiting. Compute is the rest."""
        self.hook_seconds = self.hook_end = self.grads_end = 0.0
        before = self.gift.stats()["wait_seconds"] if self.gift else 0.0
        self.optimizer.zero_grad()
        _, loss = self.model(x, y)
        loss.backward()
        wait = time.perf_counter() - max(self.grads_end, self.hook_end)
        inside = self.gift.stats()["wait_seconds"] - before if self.gift else 0.0
        self.optimizer.step()
        return loss, self.hook_seconds - inside, wait + inside

    def allreduce_sum(self, tensor):
        self.dist.all_reduce(tensor)
        return tensor

    def allgather(self, value):
        out = [None] * self.size
        self.dist.all_gather_object(out, value)
        return out

    def compressed(self):
        """Whether PowerSGD compressed any step (error feedback holds a residual from then)."""
        return self.powersgd is None or bool(self.powersgd.error_dict)


class FsdpArm(DdpArm):
    """FSDP2 on the default (gloo) process group: each block, then the model, fully_shard'ed
    over every rank or as HSDP over (nodes, --node-size); its own reduce-scatter timed as
    waiting, or GIFT's (codec and waiting by GIFT's counts)."""

    lockstep_forward = True     # every forward all-gathers: every rank runs as many

    def __init__(self, arm, model, args):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from horovod_gift.fsdp import attach
        self.dist, self.module = dist, model
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        kind, reduce_dtype, gift = FSDP_ARMS[arm]
        shape = (self.size // args.node_size, args.node_size) if kind == "hsdp" else (self.size,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        reshard = args.node_size if kind == "fsdp-hpz" else True
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.optimizer = train_llama.make_optimizer(model, args.lr)
        self.powersgd, self.gift, self.waited = None, None, [0.0]
        if gift is not None:
            self.gift = attach(model, **{"format": "nvfp4", "verbose": False,
                                         "node_size": args.node_size, **gift})
        else:
            for module in model.modules():
                if hasattr(module, "set_custom_reduce_scatter"):
                    module.set_custom_reduce_scatter(TimedReduceScatter(self.waited))

    def step(self, x, y):
        """Returns (loss, codec seconds, waiting seconds): GIFT's own counts of its codec work
        and of its wait for the alltoall, or the time in FSDP's own reduce-scatters."""
        before = self.gift.stats() if self.gift else None
        self.waited[0] = 0.0
        self.optimizer.zero_grad()
        _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        if self.gift is None:
            return loss, 0.0, self.waited[0]
        after = self.gift.stats()
        return (loss, after["codec_seconds"] - before["codec_seconds"],
                after["wait_seconds"] - before["wait_seconds"])


class TimedReduceScatter(ReduceScatter):
    """FSDP's own reduce-scatter, its seconds added to waited[0]."""

    def __init__(self, waited):
        self.waited = waited

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        t = time.perf_counter()
        REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group)
        self.waited[0] += time.perf_counter() - t


def heldout_loss(arm, batches, args):
    """train_llama's held-out loss: mean over the same --eval-batches validation batches,
    split over the ranks, summed in float64."""
    model = arm.module if isinstance(arm, DdpArm) else arm.model
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    evaluated = args.eval_batches
    if getattr(arm, "lockstep_forward", False):     # FSDP: as many forwards on every rank
        evaluated = -(-args.eval_batches // arm.size) * arm.size
    with torch.no_grad():
        for k in range(arm.rank, evaluated, arm.size):
            _, loss = model(*batches.validation(seed=1234 + k))
            if k < args.eval_batches:
                total += torch.tensor([float(loss), 1.0], dtype=torch.float64)
    model.train()
    total = arm.allreduce_sum(total)
    return float(total[0] / total[1])


def run_arm(args):
    """Train args.steps steps with args.arm; returns rank 0's record (every rank returns one)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size(args.arm)))
    torch.manual_seed(args.seed)
    model = train_llama.build_model(args, torch.device("cpu"))
    kind = DdpArm if args.arm in DDP_ARMS else FsdpArm if args.arm in FSDP_ARMS else HorovodArm
    arm = kind(args.arm, model, args)
    schedule = train_llama.make_schedule(arm.optimizer)
    batches = ByteBatches(read_corpus(args.data), args.seq_len, args.batch_size, seed=args.seed,
                          rank=arm.rank)
    rows, clock = [], 0.0
    evals = [{"step": 0, "clock": 0.0, "heldout": heldout_loss(arm, batches, args)}]
    for step in range(1, args.steps + 1):
        sent = tx_bytes(args.ifname)
        t0 = time.perf_counter()
        loss, codec, wait = arm.step(*batches.next())
        loss = loss.item()
        schedule.step()
        seconds = time.perf_counter() - t0
        if step > 1:    # training time only: evaluation is off the clock, and so is step 1,
            clock += seconds    # which compiles GIFT's kernels and lets DDP rebuild its buckets
        rows.append({"seconds": seconds, "codec": codec, "wait": wait,
                     "compute": seconds - codec - wait, "loss": loss,
                     "bytes": tx_bytes(args.ifname) - sent})
        if step % args.eval_every == 0 or step == args.steps:
            evals.append({"step": step, "clock": clock,
                          "heldout": heldout_loss(arm, batches, args)})
    bytes_by_rank = arm.allgather(sum(r["bytes"] for r in rows[len(rows) // 2:]))
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for p in model.parameters()]
    gift = getattr(arm, "gift", None)
    return {"arm": args.arm, "ranks": arm.size, "seed": args.seed, "rows": rows, "evals": evals,
            "steady_bytes_by_rank": bytes_by_rank, "compressed": arm.compressed(),
            "max_rss_bytes": arm.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                           * 1024),
            "residual_bytes": arm.allgather(gift.stats().get("residual_bytes", 0) if gift
                                            else 0),
            # what GIFT's quantized hop sent, by GIFT's count (the whole run)
            "gift_bytes_sent": arm.allgather(gift.stats()["bytes_sent"] if gift else 0),
            "powersgd_start": args.powersgd_start, "params": params}


def world_size(arm):
    if arm in TORCH_ARMS:
        import torch.distributed as dist
        return dist.get_world_size()
    import horovod.torch as hvd
    return hvd.size()


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if args.arm in TORCH_ARMS:   # MASTER_ADDR / MASTER_PORT / GLOO_SOCKET_IFNAME come from peers.py
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank,
                                world_size=int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    else:
        if args.arm == "hvd-fp32-hier":
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        import horovod.torch as hvd
        # the two-hop arms: GIFT adds the process sets of the nodes
        hvd.init(process_sets="dynamic" if args.arm.endswith("2hop") else None)
    result = run_arm(args)
    result.pop("params")
    finite = all(math.isfinite(e["heldout"]) for e in result["evals"])
    if rank == 0 and args.out:
        pathlib.Path(args.out).write_text(json.dumps(result))
    code = 0 if finite else 1
    if args.arm in TORCH_ARMS:
        dist.barrier()
        # gloo's threads left by PowerSGD's callbacks can abort the C++ teardown ("terminate
        # called without an active exception", rank 1 at 1 Gbit/s): the result is written and
        # every rank is past its last collective, so leave without the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
