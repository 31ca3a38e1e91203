"""The engines benchmarks/robustness.py runs its cases on: each makes its process group, wraps a
model and its optimizer with GIFT, and says where the averaged gradients are and what GIFT
accepts there."""
import copy


class Horovod:
    """GIFT as Horovod's compression (hvd.DistributedOptimizer) under mpirun."""
    name = "horovod"
    misuse = ("plain optimizer on a GIFT model", "with no Horovod wrapper")
    transforms = ("none", "hadamard", "whiten", "whiten+hadamard", "auto")
    exact_by_reference = False      # each rank's gradient is read before the reduction

    def __init__(self, node_size=None):
        self.gift_node_size = node_size     # GIFT's two hops over nodes of that many ranks
        import horovod.torch as hvd
        from mpi4py import MPI
        hvd.init(process_sets="dynamic")    # two hops add the nodes' process sets
        self.hvd, self.mpi = hvd, MPI.COMM_WORLD
        self.rank, self.size = hvd.rank(), hvd.size()

    def allgather(self, value):
        return self.mpi.allgather(value)

    def wrap(self, model, base, options, misuse=False, unused=False):
        """(the module to run, the optimizer to step, GIFT's state) for model and its optimizer
        base; misuse: the engine's misuse case (base stepped without Horovod's wrapper)."""
        import horovod_gift as gift
        compression = gift.GIFT(model, verbose=False, **options)
        if misuse:
            return model, base, compression
        return model, self.hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), compression=compression), compression

    def averaged(self, optimizer):
        """After backward: the gradients are averaged once this returns."""
        optimizer.synchronize()

    def step(self, optimizer):
        if hasattr(optimizer, "skip_synchronize"):      # Horovod's, not the misuse case's
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()


class Ddp:
    """GIFT as DDP's communication hook (horovod_gift.ddp) under torchrun, on gloo."""
    name = "ddp"
    misuse = ("hook registered with another model's state", "GiftState(model) does not have")
    transforms = Horovod.transforms
    exact_by_reference = False

    def __init__(self, node_size=None):
        self.gift_node_size = node_size
        import torch.distributed as dist
        from engines import init_process_group
        init_process_group("gloo")
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allgather(self, value):
        out = [None] * self.size
        self.dist.all_gather_object(out, value)
        return out

    def wrap(self, model, base, options, misuse=False, unused=False):
        """As Horovod.wrap; unused: a parameter may have no gradient on a rank (DDP needs to be
        told)."""
        from torch.nn.parallel import DistributedDataParallel

        from horovod_gift.ddp import GiftState, gift_hook
        ddp = DistributedDataParallel(model, find_unused_parameters=unused)
        # misuse: a state made for another model (a copy) registered on this one
        target = copy.deepcopy(model) if misuse else ddp
        state = GiftState(target, process_group=ddp.process_group, verbose=False, **options)
        ddp.register_comm_hook(state, gift_hook)
        return ddp, base, state

    def averaged(self, optimizer):
        """DDP averaged the gradients in backward."""

    def step(self, optimizer):
        optimizer.step()


class Fsdp(Ddp):
    """GIFT as FSDP2's reduce-scatter (horovod_gift.fsdp.attach) under torchrun, on gloo: every
    block, then the model, fully_shard'ed over the ranks (node_size: GIFT's two hops over nodes
    of that many ranks). FSDP computes each rank's gradient into a parameter it unshards for the
    step only, so the exact average a case is judged against is the fp32 reduce-scatter of a
    copy of the model sharded alike without GIFT, run on the same batches from the same weights
    (exact_by_reference)."""
    name = "fsdp"
    misuse = ("attach before fully_shard", "the model has no fully_shard module")
    transforms = ("whiten", "none")
    exact_by_reference = True

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (self.size,))

    def shard(self, model):
        from torch.distributed.fsdp import fully_shard
        mesh = self.mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def reference(self, model):
        """A copy of model (not sharded yet) sharded alike, without GIFT."""
        return self.shard(copy.deepcopy(model))

    def wrap(self, model, base, options, misuse=False, unused=False):
        """As Horovod.wrap (the optimizer made again over the sharded parameters); misuse: GIFT
        attached to the model before fully_shard."""
        from horovod_gift.fsdp import attach
        if not misuse:
            self.shard(model)
        state = attach(model, verbose=False, **options)
        return model, type(base)(model.parameters(), **base.defaults), state


class Hsdp(Fsdp):
    """Fsdp sharded over the ranks of each node of node_size ranks and replicated across nodes
    (a 2-D mesh): GIFT quantizes the all-reduce across replicas."""
    name = "hsdp"

    def __init__(self, node_size=None):
        if node_size is None:
            raise SystemExit("robustness.py: hsdp needs a node size (hsdp:RANKS:NODE_SIZE)")
        super().__init__()
        self.node_size = node_size      # the mesh's, not an option of GIFT's

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (self.size // self.node_size, self.node_size),
                                mesh_dim_names=("replicate", "shard"))


ENGINES = {"horovod": Horovod, "ddp": Ddp, "fsdp": Fsdp, "hsdp": Hsdp}
