"""GIFT under FSDP2 across nodes (reduce/topology.py's TwoHop and Hsdp, fsdp/state.py): HSDP on a
(replicas, shard) mesh, and two hops under 1-D FSDP, on gloo under torchrun as 2 nodes: 4 ranks as 2
x 2, 8 as 2 x 4 (scripts/run_tests.sh runs this file at 4 and 8 ranks)."""
import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_checks import (check_a_hung_rank_makes_every_rank_raise,
                         check_non_finite_comes_back_nan, check_reduced_shards_close_to_fp32,
                         check_resume_is_bit_identical, full)
from helpers import Net, assert_identical_on_all_ranks, gathered, loss_of, train
from horovod_gift.fsdp import internals as fsdp_internals
from horovod_gift.fsdp import attach

OPTIONS = dict(format="nvfp4", refresh_every=2, verbose=False)
NODES = 2


def per_node():
    return dist.get_world_size() // NODES


def make(kind, seed=0, dtype=torch.float32, **options):
    """(a model of dtype fully_shard'ed as kind: "hsdp" on a (NODES, ranks a node) mesh, or
    "fsdp" 1-D over every rank; its optimizer; its GIFT state or None without options)."""
    torch.manual_seed(seed)
    model = Net().to(dtype)
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (NODES, per_node()), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.up, model.down, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if kind == "fsdp" and options:
        options = dict(options, topology=options.get("topology", "two-hop"),
                       node_size=options.get("node_size", per_node()))
    state = attach(model, **options) if options else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), state


def trained_elements(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_training_follows_fp32_and_every_rank_ends_with_the_same_parameters(kind, residual_dtype):
    model, opt, state = make(kind, **OPTIONS, residual_dtype=residual_dtype)
    losses = train(model, opt, 12)
    reference, ref_opt, _ = make(kind)
    ref_losses = train(reference, ref_opt, 12)
    assert losses[-1] < losses[0] - 0.1, losses
    assert abs(losses[-1] - ref_losses[-1]) < 0.05, (losses, ref_losses)
    assert_identical_on_all_ranks([full(p) for p in model.parameters()], "parameters")
    stats = state.stats()
    assert ("HSDP" if kind == "hsdp" else "two-hop") in stats["topology"], stats
    assert state.statistics.whitening["up.weight"].factors is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_parameters_fsdp_reduces_with_a_sum_are_averaged_over_every_rank(kind, dtype):
    """fp16 and fp64 gradients: FSDP asks for a sum and divides by itself. Found by
    benchmarks/robustness.py: under HSDP GIFT's average came out 2x FSDP's own on 2 replicas
    (FSDP's factors count the shard group alone once GIFT does the all-reduce across them)."""
    model, _, _ = make(kind, dtype=dtype, **dict(OPTIONS, format="fp8_e4m3"))
    reference, _, _ = make(kind, dtype=dtype)
    for m in (model, reference):
        loss_of(m, 0, dist.get_rank()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        mine, theirs = full(p.grad).double(), full(q.grad).double()
        error = float((mine - theirs).norm() / theirs.norm())
        assert error < 0.15, (name, error)     # FP8's error; twice the average is error 1


def test_a_gradient_divide_factor_under_hsdp_is_refused_on_every_rank():
    """FSDP would divide by the factor alone, GIFT by every rank: refused, not silently off."""
    model, _, _ = make("hsdp", **OPTIONS)
    model.up.set_gradient_divide_factor(2.0)
    with pytest.raises(Exception, match="set_gradient_divide_factor is not supported"):
        loss_of(model, 0, dist.get_rank()).backward()
    assert gathered(True) == [True] * dist.get_world_size()


def test_hsdp_replicas_hold_bit_identical_shards():
    model, opt, _ = make("hsdp", **OPTIONS)
    train(model, opt, 5)
    local = [p.to_local() for p in model.parameters()]
    shard_index = dist.get_rank() % per_node()
    digests = gathered((shard_index, [t.clone() for t in local]))
    for index, tensors in digests:
        if index == shard_index:
            assert all(torch.equal(a, b) for a, b in zip(tensors, local))


@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
@pytest.mark.parametrize("transform", ["none", "whiten"])
def test_the_reduced_shards_are_close_to_fp32_on_the_same_batch(kind, transform):
    # one-hop FSDP's bound; HSDP quantizes twice (stage 1, and the owners' sum): sqrt(2) x
    check_reduced_shards_close_to_fp32(
        functools.partial(make, kind), dict(OPTIONS, format="fp8_e4m3", transform=transform),
        0.05 * (2 ** 0.5 if kind == "hsdp" else 1))


@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_residuals_cover_one_node_share_of_the_parameters(kind):
    """bf16 residuals: 2 / L bytes a parameter (HSDP's stage 2 folds its error into them), against
    2 bytes a parameter in one hop."""
    model, opt, state = make(kind, **OPTIONS)
    train(model, opt, 2)
    flat_model, flat_opt, flat_state = make("fsdp", **dict(OPTIONS, topology="flat"))
    train(flat_model, flat_opt, 2)
    params, local = trained_elements(model), per_node()
    per_parameter = state.stats()["residual_bytes"] / params
    bound = 2 / local
    # FSDP pads each parameter's dim 0 to a multiple of its ranks: a few rows more
    assert per_parameter <= bound * 1.15, (per_parameter, bound)
    assert per_parameter >= bound * 0.9, (per_parameter, bound)
    assert flat_state.stats()["residual_bytes"] / params >= 2 * 0.95


@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_checkpoint_resume_at_a_refresh_step_is_bit_identical(kind):
    check_resume_is_bit_identical(functools.partial(make, kind), OPTIONS)


@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_a_non_finite_gradient_on_one_rank_comes_back_nan_then_training_goes_on(kind):
    check_non_finite_comes_back_nan(functools.partial(make, kind), OPTIONS,
                                    poisoned_rank=dist.get_world_size() - 1)


def test_a_configuration_that_differs_across_ranks_raises_on_every_rank():
    rank = dist.get_rank()
    with pytest.raises(Exception, match="configuration differs across ranks in format"):
        make("hsdp", **dict(OPTIONS, format="nvfp4" if rank == 0 else "fp8_e4m3"))
    assert gathered(True) == [True] * dist.get_world_size()


def test_combinations_gift_cannot_honour_are_refused_by_name():
    with pytest.raises(ValueError, match="topology='flat' does not apply under HSDP"):
        make("hsdp", **dict(OPTIONS, topology="flat"))
    with pytest.raises(ValueError, match="unknown topology 'ring'"):
        make("hsdp", **dict(OPTIONS, topology="ring"))
    with pytest.raises(ValueError, match="node_size must be None .* or a positive int, got 0"):
        make("hsdp", **dict(OPTIONS, node_size=0))
    with pytest.raises(ValueError, match="two-hop' needs several nodes"):
        make("fsdp", **dict(OPTIONS, node_size=dist.get_world_size()))


def test_the_private_fsdp_attributes_gift_reads():
    """fsdp/internals.py's list, read as GIFT reads it: fails when torch changes one."""
    model, _, _ = make("hsdp")
    group = fsdp_internals.param_group(model.up)
    (weight, dim, shard), (bias, _, bias_shard) = fsdp_internals.trained_fsdp_params(group)
    assert weight is model.up.weight and dim == 0 and bias is model.up.bias
    assert shard == -(-model.up.weight.shape[0] // per_node()) * model.up.weight.shape[1]
    shard_pg, replicate_pg = fsdp_internals.hsdp_groups(group)
    assert (shard_pg.size(), replicate_pg.size()) == (per_node(), NODES)
    assert fsdp_internals.shard_group(group) is shard_pg
    assert group.gradient_divide_factor is None
    model.up.set_gradient_divide_factor(3.0)
    assert group.gradient_divide_factor == 3.0
    fsdp_internals.reduce_across_replicas_in_gift(group)
    assert fsdp_internals.hsdp_groups(group) == (shard_pg, replicate_pg)
    assert fsdp_internals.shard_group(group) is shard_pg
    assert not group._is_hsdp      # FSDP's foreach_reduce then skips its all-reduce
    fsdp_internals.keep_reduction_across_replicas_in_fsdp(group)
    assert group._is_hsdp and group.post_forward_mesh_info is group.mesh_info


def test_a_rank_that_hangs_under_hsdp_makes_every_rank_raise_naming_gifts_collective():
    """HSDP on groups with a 6 s timeout (ranks share 2 cores in make test); rank 1 sleeps past
    it between forward and backward (the parameters stay gathered, so backward's first
    collective is GIFT's reduce-scatter in the shard group): every rank raises, its node peers
    in the shard group and the others in the replica all-reduce, and each error names GIFT's
    collective and the rank."""
    timeout = datetime.timedelta(seconds=6)
    world, size = dist.get_world_size(), per_node()
    layout = torch.arange(world).view(NODES, size)
    # every rank makes every group, in the same order (torch.distributed's rule)
    shard, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout,
                                                 backend="gloo")
    replicate, _ = dist.new_subgroups_by_enumeration(layout.T.tolist(), timeout=timeout,
                                                     backend="gloo")
    mesh = DeviceMesh.from_group([replicate, shard], "cpu", mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))
    check_a_hung_rank_makes_every_rank_raise(
        mesh, timeout, OPTIONS, r"GIFT: collective '[^']+' on rank \d+ of \d+ failed")
