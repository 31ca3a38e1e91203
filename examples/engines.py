"""The data-parallel engines examples/train_llama.py trains with (--engine): Horovod (horovodrun
or mpirun), PyTorch DDP and FSDP2 (torchrun). Each sets up its processes, wraps the model and
optimizer with GIFT where --compression asks for it, and gives train_llama the few collectives
it needs for its own logging. DDP and FSDP import no Horovod.

    horovodrun -np 2 -H localhost:2 python examples/train_llama.py --engine horovod
    torchrun --nproc-per-node 2 examples/train_llama.py --engine ddp
    torchrun --nproc-per-node 2 examples/train_llama.py --engine fsdp
    torchrun --nnodes N --nproc-per-node 8 ... examples/train_llama.py --engine hsdp
"""
import os
import sys

import torch

# --compression -> (GIFT's format, its transform: None for GIFT's default); "none" and "fp16"
# take the engine's own fp32 or fp16 reduction
COMPRESSIONS = {
    "none": None,
    "fp16": None,
    "fp8": ("fp8_e4m3", "none"),
    "nvfp4": ("nvfp4", "none"),
    "gift-fp8": ("fp8_e4m3", None),
    "gift-nvfp4": ("nvfp4", None),
    "int3": ("int3", "none"),
    "gift-int3": ("int3", None),
}


def residual_option(args):
    """GIFT's residual_dtype for --residual-dtype ({} for the library's default)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.residual_dtype)
    return {} if dtype is None else {"residual_dtype": dtype}


def gift_options(args, **options):
    """GIFT's arguments for --compression and the GIFT flags of train_llama."""
    format, transform = COMPRESSIONS[args.compression]
    if transform is not None:
        options["transform"] = transform
    return dict(options, format=format, error_feedback=not args.no_error_feedback,
                log_every=args.log_every, **residual_option(args))


class HorovodEngine:
    name = "horovod"
    sharded = False

    def __init__(self):
        import horovod.torch as hvd
        # dynamic process sets: on nodes of several GPUs GIFT adds the sets of its two hops
        hvd.init(process_sets="dynamic")
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def wrap(self, model, make_optimizer, args, make_compression):
        """(the module to run, the optimizer to step, the GIFT instance or None); make_optimizer:
        model -> its optimizer."""
        options = residual_option(args) if args.compression.startswith("gift") else {}
        compression, compressor = make_compression(
            args.compression, model, args.bucket_elements, not args.no_error_feedback,
            args.log_every, args.start_step, **options)
        # wrap first: DistributedOptimizer builds a new optimizer object, which would drop a
        # loaded state
        optimizer = self.hvd.DistributedOptimizer(make_optimizer(model),
                                                  named_parameters=model.named_parameters(),
                                                  compression=compression)
        return model, optimizer, compressor

    def broadcast(self, model, optimizer):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def step(self, optimizer, exact):
        """The optimizer step after backward; the gradient's RelL2 against an exact average
        with exact (an ExactAverage), else None."""
        if exact is None:
            optimizer.step()
            return None
        optimizer.synchronize()
        error = exact.relative_error()
        with optimizer.skip_synchronize():
            optimizer.step()
        return error

    def sum(self, tensor, name):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)

    def average(self, tensors, name):
        return self.hvd.grouped_allreduce(tensors, op=self.hvd.Average, name=name)


class TorchEngine:
    """torch.distributed under torchrun: gloo on the CPU, NCCL on GPUs."""
    sharded = False

    def __init__(self, device):
        import torch.distributed as dist
        self.dist = dist
        init_process_group("nccl" if device == "cuda" else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def broadcast(self, model, optimizer):
        """Nothing: DDP and fully_shard broadcast rank 0's parameters themselves, and the
        optimizers' states start empty on every rank."""

    def step(self, optimizer, exact):
        error = None if exact is None else exact.relative_error()
        optimizer.step()
        return error

    def sum(self, tensor, name):
        placed = tensor.to(self._device())
        self.dist.all_reduce(placed)
        return placed.to(tensor.device)

    def average(self, tensors, name):
        return [self.sum(t, name) / self.size for t in tensors]

    def _device(self):
        if self.dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class DdpEngine(TorchEngine):
    name = "ddp"
    lockstep_forward = True     # every forward broadcasts the model's buffers from rank 0

    def wrap(self, model, make_optimizer, args, make_compression):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        from horovod_gift.ddp import GiftState, gift_hook
        cuda = next(model.parameters()).is_cuda
        ddp = DistributedDataParallel(model, device_ids=[self.local_rank] if cuda else None)
        compressor = None
        if args.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.compression != "none":
            compressor = GiftState(ddp, **gift_options(args, bucket_elements=args.bucket_elements,
                                                       start_step=args.start_step,
                                                       node_size=args.node_size))
            ddp.register_comm_hook(compressor, gift_hook)
        return ddp, make_optimizer(model), compressor


class FsdpEngine(TorchEngine):
    name = "fsdp"
    lockstep_forward = True     # every forward all-gathers: every rank runs as many
    sharded = True              # every rank checkpoints its own shards

    def mesh(self, device, args):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device.type, (self.size,))

    def wrap(self, model, make_optimizer, args, make_compression):
        """fully_shard each block, then the model; the optimizer over the sharded parameters
        (fully_shard replaces them)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from horovod_gift.fsdp import attach
        device = next(model.parameters()).device
        mesh = self.mesh(device, args)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float16 if args.compression == "fp16"
                                      else None)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = make_optimizer(model)
        compressor = None
        if args.compression not in ("none", "fp16"):
            compressor = attach(model, **gift_options(args, node_size=args.node_size,
                                                      param_format=args.param_format))
        return model, optimizer, compressor


class HsdpEngine(FsdpEngine):
    """FSDP2 sharded over the ranks of each node and replicated across nodes: GIFT quantizes the
    all-reduce across nodes (horovod_gift.fsdp)."""
    name = "hsdp"

    def mesh(self, device, args):
        from torch.distributed.device_mesh import init_device_mesh
        per_node = args.node_size or self.local_size
        return init_device_mesh(device.type, (self.size // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))


def shutdown(status=0):
    """End the process with status, without Python's finalization, once every rank is done. A
    gloo worker thread releases a finished collective's tensors after wait() has returned and
    needs the GIL for it; one that asks for it while Python finalizes is ended with a C++
    exception in flight (std::terminate, SIGABRT: 3 runs in 10 of this script under DDP, still 1
    in 20 after a barrier and destroy_process_group, since DDP and GIFT keep the group alive
    until the interpreter collects them). The script's files are closed and its output flushed
    here. Horovod's processes end as usual (MPI_Finalize runs at exit): this returns."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def init_process_group(backend):
    """torch.distributed's default group, set up so that a job torchrun restarts connects again.

    torchrun's agent keeps one store for the whole job (TORCHELASTIC_USE_AGENT_STORE), and a
    restarted attempt would find the first attempt's keys in it: gloo then connects to addresses
    of processes that are gone, and hangs or fails (issue 57: 15 of 24 restarts with a plain
    init_process_group, with or without GIFT; 4 of 4 with a prefix per attempt). Each attempt
    gets the keys of its own under a prefix of TORCHELASTIC_RESTART_COUNT. Outside torchrun's
    agent store (no torchrun, or a rendezvous whose store no agent hosts), the plain env://
    initialization."""
    import torch.distributed as dist
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=world)


def make_engine(name, device):
    if name == "horovod":
        return HorovodEngine()
    return {"ddp": DdpEngine, "fsdp": FsdpEngine, "hsdp": HsdpEngine}[name](device)
