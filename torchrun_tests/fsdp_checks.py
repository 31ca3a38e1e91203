"""The checks test_fsdp.py (one hop) and test_fsdp_hops.py (across nodes) both make, each on
models its own make(seed=..., **options) -> (model, optimizer, GIFT state or None) builds."""
import io
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from helpers import Net, loss_of, train
from horovod_gift.fsdp import attach


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_reduced_shards_close_to_fp32(make, options, bound):
    """Each reduced gradient within bound (relative L2) of the fp32 reduction of the same batch,
    and small tensors (fp32 on the wire) equal to it before any residual exists."""
    model, opt, _ = make(**options)
    reference, ref_opt, _ = make()
    rank = dist.get_rank()
    for step in range(3):        # whitening factors from step 2 on
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            loss_of(m, step, rank).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            mine, theirs = full(p.grad), full(q.grad)
            error = (mine - theirs).norm() / theirs.norm()
            assert error < bound, (step, name, float(error))
            if step == 0 and p.numel() < 1024:      # small tensors travel in fp32
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
        for o in (opt, ref_opt):
            o.step()


def check_resume_is_bit_identical(make, options):
    """Saved at step 4, resumed at a refresh step (refresh_every=2): the residuals of every group
    are re-expressed in the new factors, also those of groups not seen yet since the load."""
    model, opt, state = make(**options)
    train(model, opt, 4)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "gift": state.state_dict()}, saved)
    train(model, opt, 4, first=4)
    resumed, resumed_opt, resumed_state = make(seed=1, **options)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed_state.load_state_dict(checkpoint["gift"])
    train(resumed, resumed_opt, 4, first=4)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


def check_non_finite_comes_back_nan(make, options, poisoned_rank):
    """An Inf in what reaches up's output on one rank: up's gradient comes back non-finite,
    head's (downstream of up) finite, and the next step's gradients all finite."""
    model, opt, _ = make(**options)
    train(model, opt, 2)
    rank = dist.get_rank()
    opt.zero_grad()
    poison = None
    if rank == poisoned_rank:
        poison = model.up.register_full_backward_pre_hook(
            lambda module, grad: (grad[0].index_fill(-1, torch.tensor([0]), float("inf")),))
    loss_of(model, 2, rank).backward()
    assert not torch.isfinite(full(model.up.weight.grad)).all()
    assert torch.isfinite(full(model.head.weight.grad)).all()
    if poison is not None:
        poison.remove()
    opt.zero_grad()
    loss_of(model, 3, rank).backward()
    assert all(torch.isfinite(full(p.grad)).all() for p in model.parameters())


def check_a_hung_rank_makes_every_rank_raise(mesh, timeout, options, match):
    """A model fully_shard'ed on mesh (whose groups time out after timeout) with GIFT attached;
    after 2 steps, rank 1 sleeps past the timeout between forward and backward (the parameters
    stay gathered after forward, so backward's first collective is GIFT's reduce-scatter):
    every rank's backward raises an error that matches match (GIFT's collective and rank)."""
    torch.manual_seed(0)
    model = Net()
    for layer in (model.up, model.down, model.head, model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    attach(model, **options)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 2)
    rank = dist.get_rank()
    loss = loss_of(model, 2, rank)
    if rank == 1:
        time.sleep(2.5 * timeout.total_seconds())
    with pytest.raises(RuntimeError, match=match):
        loss.backward()
