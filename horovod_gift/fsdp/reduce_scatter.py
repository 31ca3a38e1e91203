"""GIFT as FSDP2's reduce-scatter: gradients leave each rank as FP8 or NVFP4, are summed in fp32 on
the shard's owner, and only the owner keeps the result.

    from horovod_gift.fsdp import attach
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = attach(model, format="nvfp4")   # module.set_custom_reduce_scatter(GiftReduceScatter)

Across nodes (the Topology of reduce/topology.py; state.py says how each is reduced): under 1-D
FSDP, topology="auto" reduce-scatters in fp32 inside each node and quantizes only the hop across
nodes, when LOCAL_WORLD_SIZE (or node_size=) makes several nodes of several ranks; under HSDP
(fully_shard(..., mesh=init_device_mesh(device, (nodes, ranks_a_node),
mesh_dim_names=("replicate", "shard")))) FSDP's reduce-scatter stays in the node and GIFT
quantizes the all-reduce across replicas, which FSDP would send in fp32.

FSDP2 lays a parameter group's gradients out as one buffer of `ranks` rows, row k holding every
parameter's k-th dim-0 shard (padded), and reduce-scatters it. GiftReduceScatter does that in one
alltoall of bytes: every rank encodes each piece (a parameter's part of a row) with its own
scales, sends row k to rank k, and rank k decodes the `ranks` payloads of its row and sums them
in fp32: GIFT's stage 1 (reduce/collective.py) with no stage 2, since nobody else needs the sum.
Parameters under `min_elements` travel as fp32 bytes in the same alltoall.

Geometry: the input-side whitening of a linear weight stored (out, in), u = G S^{-T}, maps each
row of G on its own, so it commutes with dim-0 sharding: every rank whitens all rows before
encoding, the owner un-whitens its shard after the sum. Weights stored (in, out) (transformers'
Conv1D) and every other tensor go as they are; the Hadamard rotations and "auto" are refused.

Error feedback keeps, per rank, the quantization error of every piece it encoded: a residual the
size of the whole (unsharded) parameter group, 4 bytes per parameter in fp32, 2 in bf16, where
FSDP itself keeps 4 / ranks of gradient and 8 / ranks of Adam state. Whether it pays is measured
in benchmarks/results/fsdp_feedback.md; the default follows it (see attach).

torch.distributed matches collectives by call order: FSDP calls the reduce-scatters of its groups
in backward order, the same on every rank, and GIFT adds collectives only at a step's first
reduce-scatter (the configuration check at the first step, the statistics' refresh).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..config import GiftConfig, with_options
from ..reduce.topology import Flat, Hsdp
from ..torch_comm import REDUCE_SCATTER, TorchCommunicator, torch_topology
from .allgather import use_quantized_all_gather
from .internals import (
    hsdp_groups,
    keep_reduction_across_replicas_in_fsdp,
    param_group,
    reduce_across_replicas_in_gift,
    shard_group,
)
from .state import FsdpGiftState, GroupLayout

__all__ = ["attach", "GiftReduceScatter", "FsdpGiftState", "GroupLayout"]


class GiftReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one fully_shard module's gradients through GIFT (the module
    docstring); state: the FsdpGiftState of the whole model."""

    def __init__(self, state, module):
        if not isinstance(module, FSDPModule):
            raise TypeError(f"GiftReduceScatter: {type(module).__name__} is not a fully_shard "
                            "module; call fully_shard(module) first")
        self.state, self.module = state, module
        if param_group(module) is not None:   # else FSDP never reduce-scatters it
            state.modules.append(module)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with self.state.telemetry.timed("reduce_scatter"):
            layout = self.state.begin(self.module, input_tensor, group)
            if layout is None:      # a trained parameter of the group has no gradient
                return self._fp32(output_tensor, input_tensor, group, op, async_op)
            divisor = _divisor(op, self.state, param_group(self.module).gradient_divide_factor)
            self.state.reduce_scatter(layout, output_tensor, input_tensor, divisor)
            return None

    def _fp32(self, output, buffer, group, op, async_op):
        """FSDP's own reduction in fp32: its reduce-scatter, and under HSDP the all-reduce
        across replicas that GIFT took from FSDP."""
        if not isinstance(self.state.topology, Hsdp):
            return REDUCE_SCATTER(output, buffer, op=op, group=group, async_op=async_op)
        REDUCE_SCATTER(output, buffer, op=op, group=group)
        dist.all_reduce(output, op=op, group=self.state.topology.cross.group)
        if op == dist.ReduceOp.SUM:     # what FSDP's division leaves out (_divisor)
            output.div_(self.state.topology.cross.size)
        return None


def _divisor(op, state, factor):
    """What GIFT divides the sum of every rank's rows by. AVG (fp32, bf16): every rank. SUM
    (FSDP divides by itself, around the collective: fp16, fp64): nothing, but under HSDP the
    replicas, since FSDP's factors count the shard group alone once its all-reduce across
    replicas is GIFT's (internals.reduce_across_replicas_in_gift). factor: the module's
    set_gradient_divide_factor, which FSDP would divide by alone: refused under HSDP."""
    if factor is not None and isinstance(state.topology, Hsdp):
        raise ValueError("GIFT (FSDP): set_gradient_divide_factor is not supported under HSDP; "
                         "leave it unset (GIFT averages over every rank)")
    if op == dist.ReduceOp.AVG:
        return state.comm.size
    if op == dist.ReduceOp.SUM:
        return state.topology.cross.size if isinstance(state.topology, Hsdp) else 1
    raise ValueError(f"GiftReduceScatter: FSDP asked for the reduce op {op}; GIFT averages or "
                     "sums (leave set_gradient_divide_factor unset)")


@with_options(GiftConfig.for_fsdp)
def attach(model: torch.nn.Module, config: Optional[GiftConfig] = None,
           **options) -> FsdpGiftState:
    """Make an FsdpGiftState for model (config: a GiftConfig, options: fields of it to
    replace; GiftConfig.for_fsdp's defaults) and set a GiftReduceScatter on every fully_shard
    module in it; returns the state (for state_dict() and stats()). Collective: call it on every
    rank, after fully_shard and before the first forward; every rank raises if their options or
    models differ."""
    state = FsdpGiftState(model, config, **options)
    # a fully_shard module without parameters of its own has no reduce-scatter
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)
               and param_group(m) is not None]
    if not modules:
        raise ValueError("attach: the model has no fully_shard module; call fully_shard on its "
                         "layers and on the model first")
    state.use(_topology([param_group(m) for m in modules], state, _device(model)))
    # the ranks' configurations and models compared now: FSDP's first collective, the forward's
    # all-gather, cannot tell ranks whose shapes differ (nor the first step's check, after it)
    try:
        state.settle_ranks(before_training=True)
    except Exception:
        state.statistics.remove_hooks()     # as if attach had never run
        for module in modules:
            keep_reduction_across_replicas_in_fsdp(param_group(module))
        raise
    for module in modules:
        module.set_custom_reduce_scatter(GiftReduceScatter(state, module))
    use_quantized_all_gather(modules, state.config.param_format, state.config.min_elements,
                             state.telemetry)
    return state


def _device(model):
    return next(model.parameters()).device


def _topology(groups, state, device):
    """The Topology of the model's parameter groups (all on one mesh)."""
    meshes = {(hsdp_groups(g) or (shard_group(g),)) for g in groups}
    if len(meshes) > 1:
        raise ValueError("attach: the fully_shard modules of this model lie on different meshes; "
                         "GIFT takes one data-parallel mesh for the whole model")
    (groups_of_mesh,) = meshes
    if len(groups_of_mesh) == 2:
        return _hsdp(groups, state, device, *groups_of_mesh)
    group = groups_of_mesh[0]
    world = dist.get_world_size()
    spans_world = dist.get_process_group_ranks(group) == list(range(world))
    if state.config.topology == "two-hop" and not spans_world:
        raise ValueError("GIFT (FSDP): topology='two-hop' needs the FSDP mesh to hold every rank "
                         "of the default process group, in order; use topology='flat'")
    kind = state.config.topology if spans_world else "flat"
    topology = torch_topology(kind, state.config.node_size, None if spans_world else group, device)
    # one hop over FSDP's own group, as FSDP would reduce-scatter
    return topology if topology.node is not None else Flat(TorchCommunicator(group, device))


def _hsdp(groups, state, device, shard, replicate):
    if state.config.topology == "flat":
        raise ValueError("GIFT (FSDP): topology='flat' does not apply under HSDP: its mesh "
                         "makes the nodes (reduce-scatter inside, all-reduce across replicas)")
    if shard.size() == 1:
        raise ValueError("GIFT (FSDP): HSDP with one rank a shard group is DDP (FSDP then calls "
                         "no reduce-scatter); use horovod_gift.ddp's gift_hook")
    if shard.size() * replicate.size() != dist.get_world_size():
        raise ValueError("GIFT (FSDP): the HSDP mesh must hold every rank of the default "
                         f"process group ({shard.size()} x {replicate.size()} != "
                         f"{dist.get_world_size()})")
    for group in groups:
        reduce_across_replicas_in_gift(group)
    return Hsdp(TorchCommunicator(None, device), TorchCommunicator(shard, device),
                TorchCommunicator(replicate, device))
