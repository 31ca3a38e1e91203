"""GIFT as DDP's communication hook (horovod_gift.ddp), on gloo under torchrun."""
import copy
import datetime
import io
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import helpers
from helpers import Net, assert_identical_on_all_ranks, gathered, loss_of
from horovod_gift.ddp import GiftState, gift_hook

# DDP buckets of about 2500 fp32 elements and GIFT buckets of 4096: several of each, laid out
# differently, so GIFT buckets span DDP buckets and the other way round
BUCKET_CAP_MB = 0.01
OPTIONS = dict(format="nvfp4", bucket_elements=4096, refresh_every=2, verbose=False)


def make(seed=0, **options):
    """(DDP model, its optimizer, its GiftState or None): the same initial weights on every rank;
    no options: DDP's own allreduce."""
    torch.manual_seed(seed)
    model = DDP(Net(), bucket_cap_mb=BUCKET_CAP_MB)
    state = None
    if options:
        state = GiftState(model, **options)
        model.register_comm_hook(state, gift_hook)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), state


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def train(model, opt, steps, first=0, check=True):
    """helpers.train, every step's gradients checked identical on every rank unless not check."""
    def identical(step):
        assert_identical_on_all_ranks(grads(model), f"gradients at step {step}")
    return helpers.train(model, opt, steps, first, identical if check else None)


def test_training_is_bit_identical_on_every_rank_and_follows_ddp_fp32():
    model, opt, state = make(**OPTIONS)
    losses = train(model, opt, 12)
    assert_identical_on_all_ranks(list(model.parameters()), "parameters")
    reference, ref_opt, _ = make()
    ref_losses = train(reference, ref_opt, 12, check=False)
    assert state.step == 12
    assert state.stats()["bits_per_element"] < 8, state.stats()
    # fp32 residuals: r1 over every quantized parameter, r2 over this rank's share of the buckets
    quantized = sum(p.numel() for p in model.parameters() if p.numel() >= 1024)
    total = sum(p.numel() for p in model.parameters())
    assert 4 * quantized <= state.stats()["residual_bytes"] <= 4 * total * 1.6, state.stats()
    assert losses[-1] < losses[0] - 0.1, losses
    assert abs(losses[-1] - ref_losses[-1]) < 0.05, (losses, ref_losses)
    # the whitening ran: the linear weights took it, its factors exist
    assert state.plan.choice["module.up.weight" if False else "up.weight"] == "whiten"
    assert state.statistics.whitening["up.weight"].factors is not None


def test_the_averaged_gradient_is_close_to_ddp_fp32_on_the_same_batch():
    """One step from the same weights: GIFT fp8's average against DDP's own, per tensor."""
    model, _, _ = make(**dict(OPTIONS, format="fp8_e4m3", transform="none"))
    reference, _, _ = make()
    rank = dist.get_rank()
    loss_of(model, 0, rank).backward()
    loss_of(reference, 0, rank).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        error = (p.grad - q.grad).norm() / q.grad.norm()
        assert error < 0.05, (name, float(error))


def test_warm_up_steps_are_ddp_own_allreduce_bit_for_bit():
    model, opt, state = make(**dict(OPTIONS, start_step=3))
    reference, ref_opt, _ = make()
    rank = dist.get_rank()
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            loss_of(m, step, rank).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        opt.step()
        ref_opt.step()
    assert state.stats()["warmup_steps"] == 3
    train(model, opt, 2, first=3)       # then compressed, still identical on every rank
    assert state.stats()["warmup_steps"] == 3


def test_parameters_under_min_elements_are_averaged_in_fp32():
    model, _, state = make(**OPTIONS)
    reference, _, _ = make()
    rank = dist.get_rank()
    loss_of(model, 0, rank).backward()
    loss_of(reference, 0, rank).backward()
    small = [n for n, p in model.module.named_parameters() if p.numel() < 1024]
    assert small and not any(n in state.reducer.bucket_of for n in small)
    mine, theirs = dict(model.module.named_parameters()), dict(reference.module.named_parameters())
    for name in small:
        torch.testing.assert_close(mine[name].grad, theirs[name].grad, rtol=1e-6, atol=1e-7)
    assert_identical_on_all_ranks([mine[n].grad for n in small], "small gradients")


def test_no_sync_accumulates_and_the_synchronized_step_averages_the_sum():
    model, _, state = make(**dict(OPTIONS, format="fp8_e4m3", transform="none"))
    reference, _, _ = make()
    rank = dist.get_rank()
    for m in (model, reference):
        with m.no_sync():
            loss_of(m, 0, rank).backward()
        loss_of(m, 1, rank).backward()
    assert state.step == 1
    assert_identical_on_all_ranks(grads(model), "gradients")
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad - q.grad).norm() / q.grad.norm() < 0.05


def test_join_with_uneven_inputs_keeps_ranks_identical():
    model, opt, state = make(**OPTIONS)
    rank = dist.get_rank()
    steps = 3 + 2 * rank          # rank 0 runs out of data first
    with model.join():
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, step, rank).backward()
            opt.step()
    assert_identical_on_all_ranks(list(model.parameters()), "parameters after join")
    # every rank counted every step, the joined ones' too, and the next step runs as usual
    assert gathered(state.step) == [3 + 2 * (dist.get_world_size() - 1)] * dist.get_world_size()
    train(model, opt, 2, first=100)


def test_checkpoint_resume_is_bit_identical():
    """Resumed at a refresh step (refresh_every=2): the residuals of every group are
    re-expressed in the new factors, also those of groups not seen yet since the load."""
    model, opt, state = make(**OPTIONS)
    train(model, opt, 4, check=False)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "gift": state.state_dict()}, saved)
    train(model, opt, 4, first=4, check=False)

    resumed, resumed_opt, resumed_state = make(seed=1, **OPTIONS)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_state.load_state_dict(checkpoint["gift"])
    train(resumed, resumed_opt, 4, first=4, check=False)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("nonfinite", ["nan", "raise"])
def test_a_non_finite_gradient_on_one_rank(nonfinite):
    model, opt, state = make(**dict(OPTIONS, nonfinite=nonfinite))
    train(model, opt, 2, check=False)
    rank = dist.get_rank()
    opt.zero_grad()
    loss = loss_of(model, 2, rank)
    poison = None
    if rank == 0:           # an Inf in the gradient of up.weight on rank 0 only
        poison = model.module.up.weight.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    if nonfinite == "raise":
        with pytest.raises(Exception, match="averaged gradient of up.weight is not finite"):
            loss.backward()
    else:
        loss.backward()
        up = model.module.up.weight.grad
        assert not torch.isfinite(up).all()
        assert_identical_on_all_ranks(grads(model), "gradients")
        others = [p.grad for n, p in model.module.named_parameters() if n != "up.weight"]
        assert all(torch.isfinite(g).all() for g in others)
    # the residuals were scrubbed: the next steps are finite again
    if poison is not None:
        poison.remove()
    opt.zero_grad()
    loss_of(model, 3, rank).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_configuration_that_differs_across_ranks_raises_on_every_rank():
    rank = dist.get_rank()
    model, _, _ = make(**dict(OPTIONS, format="nvfp4" if rank == 0 else "fp8_e4m3"))
    with pytest.raises(Exception, match="configuration differs across ranks in format"):
        loss_of(model, 0, rank).backward()


def test_a_layer_unfrozen_after_ddp_wrapped_the_model_is_refused_on_every_rank():
    """DDP never reduces a parameter frozen when it wrapped the model: its gradient would stay
    each rank's own. GIFT names it before the step's collectives, on every rank."""
    torch.manual_seed(0)
    net = Net()
    net.up.weight.requires_grad_(False)
    model = DDP(net)
    model.register_comm_hook(GiftState(model, **OPTIONS), gift_hook)
    loss_of(model, 0, dist.get_rank()).backward()     # frozen: trains on
    net.up.weight.requires_grad_(True)
    with pytest.raises(Exception, match="up.weight trains now but was frozen when DDP wrapped"):
        loss_of(model, 1, dist.get_rank()).backward()


def test_the_hook_refuses_a_state_it_was_not_made_with():
    model = DDP(Net())
    model.register_comm_hook(object(), gift_hook)
    with pytest.raises(Exception, match="register it with the state made for the model"):
        loss_of(model, 0, dist.get_rank()).backward()


def test_a_state_moves_between_a_ddp_job_and_a_fresh_one_of_the_same_model():
    """Parameter names are the wrapped module's: the configuration compares equal."""
    _, _, state = make(**OPTIONS)
    other = GiftState(copy.deepcopy(Net()), **OPTIONS)
    assert other.agreed() == state.agreed()


def test_reset_rank_state_restarts_the_residuals_and_training_goes_on():
    """hvd.elastic's on_state_reset analogue: every rank calls it, the next steps run."""
    model, opt, state = make(**OPTIONS)
    train(model, opt, 2)
    state.reset_rank_state()
    assert not state.reducer.feedback.stage1
    train(model, opt, 2, first=2)
    assert_identical_on_all_ranks(list(model.parameters()), "parameters")


def test_sparse_gradients_are_refused_by_name():
    model = Net()
    model.embed = torch.nn.Embedding(64, 32, sparse=True)
    with pytest.raises(ValueError, match="embed.weight has sparse gradients"):
        GiftState(DDP(model), **OPTIONS)


def test_two_hops_over_nodes_of_two_ranks():
    """node_size=2 on 4 ranks: node groups and cross-node groups made with torch.distributed,
    the two-hop reduction, bit-identical on every rank and following DDP fp32."""
    if dist.get_world_size() < 4:
        pytest.skip("two hops need 2 nodes of 2 ranks")
    model, opt, state = make(**dict(OPTIONS, node_size=2, topology="two-hop"))
    assert state.reducer.topology.description == ("two-hop", 2)
    losses = train(model, opt, 6)
    reference, ref_opt, _ = make()
    ref_losses = train(reference, ref_opt, 6, check=False)
    assert abs(losses[-1] - ref_losses[-1]) < 0.05, (losses, ref_losses)
    assert state.stats()["node_bytes_sent"] > 0


def test_a_rank_that_hangs_makes_every_rank_raise_naming_gifts_collective_and_rank():
    """Rank 1 sleeps past the process group's timeout before a step: every rank raises, and the
    error names GIFT's collective and the rank, not only gloo's words."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    model = DDP(Net(), process_group=group)
    model.register_comm_hook(GiftState(model, **OPTIONS), gift_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 2, check=False)
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(8)
    with pytest.raises(RuntimeError, match=rf"GIFT: collective '[^']+' on rank {rank} of "
                                           rf"{dist.get_world_size()} failed"):
        loss_of(model, 2, rank).backward()
