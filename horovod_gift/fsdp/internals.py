"""Every private attribute of torch 2.13's FSDP2 (torch.distributed.fsdp._fully_shard) that GIFT
relies on, in one place; test_the_private_fsdp_attributes_gift_reads (torchrun_tests/
test_fsdp_hops.py) fails when torch changes any of them.

- `FSDPModule._get_fsdp_state()._fsdp_param_groups`: a module's FSDPParamGroup (none for a module
  without parameters of its own; GIFT takes one group a module, fully_shard's default).
- `FSDPParamGroup.fsdp_params`, and per FSDPParam `sharded_param`, `fsdp_placement.dim` and
  `padded_sharded_param_size`: the order and the sizes of the parameters in the reduce-scatter's
  buffer (FSDP's `foreach_reduce_scatter_copy_in`: row k holds every parameter's k-th dim-0 shard)
  and in the all-gather's input (`foreach_all_gather`: each padded shard end to end).
- `FSDPParamGroup.mesh_info` and `post_forward_mesh_info`, of the classes `FSDPMeshInfo` and
  `HSDPMeshInfo` (`shard_process_group`, `replicate_process_group`, `mesh`, `shard_mesh_dim`):
  under HSDP, FSDP's `foreach_reduce` all-reduces the reduce-scatter's output across replicas
  with `dist.all_reduce` when `isinstance(mesh_info, DDPMeshInfo)`, in fp32 (or reduce_dtype),
  and no public API replaces that collective (`set_all_reduce_hook` runs after it). GIFT gives
  such a group an FSDPMeshInfo over the same shard dimension (`reduce_across_replicas_in_gift`):
  FSDP then reduce-scatters in the node only, and GIFT's reduce-scatter does the cross-replica
  part, quantized. Parameters, all-gathers and DTensor placements keep the 2-D mesh
  (`keep_reduction_across_replicas_in_fsdp` undoes it where attach raises).
- `FSDPParamGroup.gradient_divide_factor` (FSDPModule.set_gradient_divide_factor's): under HSDP
  GIFT refuses a factor, which FSDP would divide by alone.
"""
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

__all__ = ["param_group", "trained_fsdp_params", "all_fsdp_params", "hsdp_groups",
           "reduce_across_replicas_in_gift", "shard_group"]


def param_group(module):
    """The FSDPParamGroup of a fully_shard module, or None when it has no parameters of its own
    (FSDP gives it no reduce-scatter)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(f"GIFT (FSDP): {type(module).__name__} has {len(groups)} parameter "
                         "groups; GIFT takes fully_shard's one group a module")
    return groups[0] if groups else None


def trained_fsdp_params(group):
    """[(parameter, dim FSDP shards it on, elements of its padded shard)] of the parameters that
    train, in the order of FSDP's reduce-scatter buffer."""
    return [(fp.sharded_param, fp.fsdp_placement.dim, fp.padded_sharded_param_size.numel())
            for fp in group.fsdp_params if fp.sharded_param.requires_grad]


def all_fsdp_params(group):
    """[(parameter, elements of its padded shard)] of every parameter, frozen ones included, in
    the order of FSDP's all-gather input (fp32 parameters without a MixedPrecisionPolicy's
    param_dtype: FSDP's copy-in then lays each padded shard end to end)."""
    return [(fp.sharded_param, fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]


def shard_group(group):
    """The process group FSDP reduce-scatters over (one node's ranks under HSDP)."""
    return group.mesh_info.shard_process_group


def hsdp_groups(group):
    """(shard group, replicate group) of an HSDP parameter group (also once GIFT took its
    all-reduce), or None under 1-D FSDP."""
    info = getattr(group, "_gift_hsdp_mesh_info", group.mesh_info)
    if not isinstance(info, HSDPMeshInfo):
        return None
    return info.shard_process_group, info.replicate_process_group


def reduce_across_replicas_in_gift(group):
    """Make FSDP skip its own cross-replica all-reduce for this HSDP group (the module
    docstring); idempotent."""
    info = group.mesh_info
    if not isinstance(info, HSDPMeshInfo):
        return
    group._gift_hsdp_mesh_info = info
    flat = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim,
                        dp_mesh_dims=info.dp_mesh_dims, spmd_mesh=info.spmd_mesh)
    flat.reduce_scatter_process_group = info.reduce_scatter_process_group
    if group.post_forward_mesh_info is info:
        group.post_forward_mesh_info = flat
    group.mesh_info = flat


def keep_reduction_across_replicas_in_fsdp(group):
    """Undo reduce_across_replicas_in_gift (an attach that raised): FSDP all-reduces across
    replicas again."""
    info = getattr(group, "_gift_hsdp_mesh_info", None)
    if info is None:
        return
    if group.post_forward_mesh_info is group.mesh_info:
        group.post_forward_mesh_info = info
    group.mesh_info = info
    del group._gift_hsdp_mesh_info
