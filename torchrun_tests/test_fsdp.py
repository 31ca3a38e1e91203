"""GIFT as FSDP2's reduce-scatter (horovod_gift.fsdp), on gloo under torchrun."""
import datetime

import pytest
import torch
import torch.distributed as dist
from fsdp_checks import (
    check_a_hung_rank_makes_every_rank_raise,
    check_non_finite_comes_back_nan,
    check_reduced_shards_close_to_fp32,
    check_resume_is_bit_identical,
    full,
)
from helpers import Net, assert_identical_on_all_ranks, gathered, loss_of, train
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from horovod_gift.fsdp import attach

OPTIONS = dict(format="nvfp4", refresh_every=2, verbose=False)


def make(seed=0, **options):
    """(an FSDP2 model: each linear layer, then the whole, fully_shard'ed; its optimizer; its
    GIFT state, or None for FSDP's own reduce-scatter)."""
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.up, model.down, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = attach(model, **options) if options else None
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), state


# bf16: FSDP's default; fp32: the README's other choice (under HSDP its refresh once crashed)
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_training_follows_fsdp_fp32_and_the_full_parameters_are_identical_on_every_rank(
        residual_dtype):
    model, opt, state = make(**OPTIONS, residual_dtype=residual_dtype)
    losses = train(model, opt, 12)
    reference, ref_opt, _ = make()
    ref_losses = train(reference, ref_opt, 12)
    assert state.step == 12
    assert losses[-1] < losses[0] - 0.1, losses
    assert abs(losses[-1] - ref_losses[-1]) < 0.05, (losses, ref_losses)
    assert_identical_on_all_ranks([full(p) for p in model.parameters()], "parameters")
    assert state.statistics.whitening["up.weight"].factors is not None
    assert state.stats()["bits_per_element"] < 8, state.stats()


@pytest.mark.parametrize("transform", ["none", "whiten"])
def test_the_reduced_shards_are_close_to_fsdp_fp32_on_the_same_batch(transform):
    check_reduced_shards_close_to_fp32(
        make, dict(OPTIONS, format="fp8_e4m3", transform=transform), 0.05)


def test_checkpoint_resume_is_bit_identical():
    check_resume_is_bit_identical(make, OPTIONS)


def test_a_checkpoint_of_0_3_0s_first_fsdp_release_still_loads():
    """Its configuration had no param_format (it all-gathered fp32): it loads into a state that
    all-gathers fp32, and a state that all-gathers FP8 refuses it, naming both."""
    model, opt, state = make(**OPTIONS)
    train(model, opt, 2)
    saved = state.state_dict()
    del saved["config"]["param_format"]
    _, _, fresh = make(**OPTIONS)
    fresh.load_state_dict(saved)
    assert fresh.step == 2
    _, _, fp8 = make(**OPTIONS, param_format="fp8_e4m3")
    with pytest.raises(ValueError, match="saved with"):
        fp8.load_state_dict(saved)


def test_a_non_finite_gradient_comes_back_nan_and_the_next_step_is_finite():
    check_non_finite_comes_back_nan(make, OPTIONS, poisoned_rank=0)


def test_gradient_accumulation_without_sync_reduces_the_sum_once():
    model, _, state = make(**dict(OPTIONS, format="fp8_e4m3", transform="none"))
    reference, _, _ = make()
    rank = dist.get_rank()
    for m in (model, reference):
        m.set_requires_gradient_sync(False)
        loss_of(m, 0, rank).backward()
        m.set_requires_gradient_sync(True)
        loss_of(m, 1, rank).backward()
    assert state.step == 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (full(p.grad) - full(q.grad)).norm() / full(q.grad).norm() < 0.05


def test_options_fsdp_cannot_honour_are_refused_by_name():
    with pytest.raises(ValueError, match="transform must be one of.*'auto'"):
        make(**dict(OPTIONS, transform="auto"))
    with pytest.raises(ValueError, match="nonfinite must be 'nan', got 'raise'"):
        make(**dict(OPTIONS, nonfinite="raise"))


def test_a_configuration_that_differs_across_ranks_raises_on_every_rank_in_attach():
    """attach compares the ranks' options and models before FSDP's first all-gather."""
    rank = dist.get_rank()
    with pytest.raises(Exception, match="configuration differs across ranks in format"):
        make(**dict(OPTIONS, format="nvfp4" if rank == 0 else "fp8_e4m3"))
    assert gathered(True) == [True] * dist.get_world_size()


def test_a_state_loaded_on_one_rank_after_attach_raises_on_every_rank_at_the_first_step():
    """Found by benchmarks/robustness.py: with attach's check counted as the first step's, the
    rank that loaded checked again while the other went on into the reduce-scatter (a hang)."""
    rank = dist.get_rank()
    model, _, state = make(**OPTIONS)
    if rank == 0:
        state.load_state_dict(dict(state.state_dict(), step=5))
    with pytest.raises(Exception, match="differs across ranks in step"):
        loss_of(model, 0, rank).backward()
    assert gathered(True) == [True] * dist.get_world_size()


def test_models_whose_shapes_differ_across_ranks_raise_on_every_rank_in_attach():
    """Found by benchmarks/robustness.py: before attach compared them, FSDP's forward
    all-gathered shards of different sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64 if dist.get_rank() == 0 else 48),
                                torch.nn.Linear(64 if dist.get_rank() == 0 else 48, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(Exception, match="differs across ranks in model"):
        attach(model, **OPTIONS)
    assert gathered(True) == [True] * dist.get_world_size()


def test_a_root_without_parameters_of_its_own_and_a_frozen_parameter():
    """fully_shard on the blocks of an nn.Sequential (its root holds no parameter: FSDP gives it
    no reduce-scatter), one block's bias frozen: GIFT's layout is the trained parameters'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model[2].bias.requires_grad_(False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = attach(model, **OPTIONS)
    assert len(state.modules) == 2
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 32, generator=g)
        model(x).square().mean().backward()
        opt.step()
    assert state.step == 3 and state.stats()["bits_per_element"] < 8
    assert_identical_on_all_ranks([full(p) for p in model.parameters()], "parameters")


def test_stats_split_the_seconds_into_codec_and_waiting():
    model, opt, state = make(**OPTIONS)
    train(model, opt, 2)
    stats = state.stats()
    assert stats["seconds_in_gift"] > 0 and stats["wait_seconds"] > 0
    assert 0 <= stats["codec_seconds"] < stats["seconds_in_gift"]
    assert stats["residual_bytes"] > 0


def test_parameters_all_gathered_in_8_bits_are_the_same_on_every_rank_and_the_master_exact():
    model, opt, state = make(**dict(OPTIONS, param_format="fp8_e4m3"))
    seen = {}
    model.up.register_forward_pre_hook(
        lambda module, args: seen.update(weight=module.weight.detach().clone(),
                                         bias=module.bias.detach().clone()))
    master = [p.to_local().clone() for p in model.parameters()]
    loss_of(model, 0, dist.get_rank()).backward()
    exact_weight, exact_bias = full(model.up.weight).detach(), full(model.up.bias).detach()
    error = (seen["weight"] - exact_weight).norm() / exact_weight.norm()
    assert 0 < error < 0.05, float(error)       # FP8 with block scales, not fp32
    assert torch.equal(seen["bias"], exact_bias)    # under min_elements: fp32
    assert_identical_on_all_ranks([seen["weight"]], "all-gathered weights")
    assert all(torch.equal(p.to_local(), m) for p, m in zip(model.parameters(), master))
    ranks, elements = dist.get_world_size(), sum(p.numel() for p in model.parameters())
    # two all-gathers (forward, and backward after resharding), each sending this rank's shard
    # to the others: about 2 (ranks - 1) / ranks bytes an element and its scales (fp32: 8)
    sent = state.stats()["param_bytes_sent"] / elements / (2 * (ranks - 1) / ranks)
    assert 0.9 < sent < 1.3, sent


def test_training_with_8_bit_parameter_all_gathers_follows_fsdp_fp32():
    model, opt, _ = make(**dict(OPTIONS, param_format="fp8_e4m3"))
    losses = train(model, opt, 12)
    reference, ref_opt, _ = make()
    ref_losses = train(reference, ref_opt, 12)
    assert abs(losses[-1] - ref_losses[-1]) < 0.05, (losses, ref_losses)
    assert_identical_on_all_ranks([full(p) for p in model.parameters()], "parameters")
    with pytest.raises(ValueError, match="param_format must be one of .*, got 'int8'"):
        make(**dict(OPTIONS, param_format="int8"))


def test_a_rank_that_hangs_makes_every_rank_raise_naming_gifts_collective_and_rank():
    """Rank 1 sleeps past the process group's timeout before backward: every rank raises, and
    the error names GIFT's collective and the rank, not only gloo's words."""
    timeout = datetime.timedelta(seconds=3)
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo", timeout=timeout), "cpu")
    check_a_hung_rank_makes_every_rank_raise(
        mesh, timeout, OPTIONS,
        rf"GIFT: collective '[^']+' on rank {dist.get_rank()} of {dist.get_world_size()} failed")
