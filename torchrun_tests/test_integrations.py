"""GIFT in the trainers (horovod_gift.integrations) under torchrun on gloo: a transformers GPT-2
trains under Lightning, Accelerate and the transformers Trainer with GIFT, its held-out loss
within 1 % of the same trainer without GIFT, GIFT's stats showing compressed bytes; a resume
from the trainer's checkpoint is bit for bit; and every way GIFT could be asked for and not run
says so."""
import os
import pathlib
import sys

import pytest
import torch
from conftest import allgather
from helpers import assert_identical_on_all_ranks
from torch.nn.parallel import DistributedDataParallel

from horovod_gift.integrations import engines

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from train_trainers import (  # noqa: E402
    GIFT,
    STEPS_AN_EPOCH,
    accelerate_train,
    held_out_loss,
    hf_train,
    lightning_fit,
    sequences,
    tiny_gpt2,
)


def shared_folder(tmp_path):
    """One folder for every rank (rank 0's), as a cluster's shared file system gives."""
    return allgather(str(tmp_path))[0]


def weights(model):
    return [p.detach().clone() for p in getattr(model, "module", model).parameters()]


def assert_follows(with_gift, without, state):
    """Within 1 % of the trainer's own held-out loss, the same bits on every rank, and most
    gradient bytes compressed."""
    assert abs(with_gift - without) <= 0.01 * without, (with_gift, without)
    stats = state.stats()
    assert stats["steps"] > 0 and stats["payload_bytes"] > 0, stats
    assert stats["payload_bytes"] < 0.5 * 4 * stats["elements"], stats


def test_lightning_trains_with_gift_on_cpu_ddp_and_resumes_bit_for_bit(tmp_path):
    folder = shared_folder(tmp_path)
    _, plain, _ = lightning_fit(folder, 3, gift=False)
    trainer, model, callback = lightning_fit(folder, 3, gift=True)
    assert_identical_on_all_ranks(weights(model), "Lightning + GIFT's weights")
    assert_follows(held_out_loss(model), held_out_loss(plain), callback.state)

    trainer, _, _ = lightning_fit(folder, 2, gift=True)
    checkpoint = os.path.join(folder, "two-epochs.ckpt")
    trainer.save_checkpoint(checkpoint)
    _, resumed, _ = lightning_fit(folder, 3, gift=True, resume=checkpoint)
    for a, b in zip(weights(resumed), weights(model)):
        assert torch.equal(a, b)


def test_accelerate_trains_with_gift_and_resumes_bit_for_bit(tmp_path):
    folder = shared_folder(tmp_path)
    plain, _ = accelerate_train(os.path.join(folder, "plain"), 3, gift=False)
    model, state = accelerate_train(os.path.join(folder, "gift"), 3, gift=True)
    assert isinstance(model, DistributedDataParallel)
    assert_identical_on_all_ranks(weights(model), "Accelerate + GIFT's weights")
    assert_follows(held_out_loss(model), held_out_loss(plain), state)

    resumed, _ = accelerate_train(os.path.join(folder, "gift"), 3, gift=True, first_epoch=2)
    for a, b in zip(weights(resumed), weights(model)):
        assert torch.equal(a, b)


def test_accelerate_refuses_a_comm_hook_it_would_drop(tmp_path):
    from accelerate.utils import DistributedDataParallelKwargs

    from horovod_gift.ddp import gift_hook

    with pytest.raises(ValueError, match="takes only its DDPCommunicationHookType"):
        accelerate_train(shared_folder(tmp_path), 1, gift=True,
                         ddp_kwargs=DistributedDataParallelKwargs(comm_hook=gift_hook))


def test_the_transformers_trainer_trains_with_gift_and_resumes_bit_for_bit(tmp_path):
    folder = shared_folder(tmp_path)
    plain, _ = hf_train(os.path.join(folder, "plain"), 3, gift=False)
    model, callback = hf_train(os.path.join(folder, "gift"), 3, gift=True)
    assert_identical_on_all_ranks(weights(model), "Trainer + GIFT's weights")
    assert_follows(held_out_loss(model), held_out_loss(plain), callback.state)
    saved = os.path.join(folder, "gift", f"checkpoint-{2 * STEPS_AN_EPOCH}")
    assert os.path.exists(os.path.join(saved, f"gift-rank{torch.distributed.get_rank()}.pt"))

    resumed, _ = hf_train(os.path.join(folder, "gift"), 3, gift=True, resume=saved)
    for a, b in zip(weights(resumed), weights(model)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- GIFT asked for, not running
def test_a_hook_the_engine_never_called_raises_at_the_first_optimizer_step():
    """The engine reduces without GIFT (here no_sync: DDP calls no hook; a trainer that replaced
    the model or its hook does the same): the optimizer's step raises, naming the cause."""
    model = DistributedDataParallel(tiny_gpt2())
    engines.install(model, **GIFT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    other.step()                    # an optimizer over other parameters is not the model's
    x = sequences(4, seed=3)
    with model.no_sync():
        model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="stepped before the engine called GIFT once"):
        optimizer.step()


def test_a_compiled_model_gets_gift_on_the_model_it_compiled():
    model = DistributedDataParallel(tiny_gpt2())
    state = engines.install(torch.compile(model), **GIFT)
    assert state.stats()["payload_bytes"] == 0
    x = sequences(4, seed=3)
    model(input_ids=x, labels=x).loss.backward()
    assert state.stats()["payload_bytes"] > 0


def test_a_rank_the_saving_job_lacked_resumes_from_rank_0s_shared_state(tmp_path):
    """A job that grows: a rank with no file of its own takes rank 0's shared part (its
    residuals restart at zero), so the ranks agree on the step and train on."""
    folder = shared_folder(tmp_path)
    model = DistributedDataParallel(tiny_gpt2())
    state = engines.install(model, **GIFT)
    x = sequences(4, seed=3 + torch.distributed.get_rank())
    model(input_ids=x, labels=x).loss.backward()
    files = engines.RankFiles(state)
    if torch.distributed.get_rank() == 0:
        files.save(folder)
    torch.distributed.barrier()
    model = DistributedDataParallel(tiny_gpt2())
    resumed = engines.install(model, **GIFT)
    engines.RankFiles(resumed).load(folder)
    model(input_ids=x, labels=x).loss.backward()        # the ranks' agreement check passes
    assert resumed.step == state.step + 1


def test_engines_gift_cannot_serve_are_refused_by_name():
    with pytest.raises(TypeError, match="DataParallel runs in one process"):
        engines.install(torch.nn.DataParallel(tiny_gpt2()))
    with pytest.raises(TypeError, match="GPT2LMHeadModel on .* neither DistributedDataParallel"):
        engines.install(tiny_gpt2())
    model = DistributedDataParallel(tiny_gpt2())
    model.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(RuntimeError, match="already has a comm hook"):
        engines.install(model, **GIFT)


def local_shards(model):
    """This rank's shard of every parameter (a forward outside training leaves them gathered)."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return [p.to_local().detach().clone() for p in model.parameters()]


def test_lightning_trains_fsdp2_with_gift_and_resumes_bit_for_bit(tmp_path):
    folder = shared_folder(tmp_path)
    _, plain, _ = lightning_fit(folder, 3, gift=False, fsdp=True)
    plain_loss = held_out_loss(plain)
    trainer, model, callback = lightning_fit(folder, 3, gift=True, fsdp=True)
    assert_follows(held_out_loss(model), plain_loss, callback.state)

    trainer, _, _ = lightning_fit(folder, 2, gift=True, fsdp=True)
    checkpoint = os.path.join(folder, "two-epochs")
    trainer.save_checkpoint(checkpoint)
    _, resumed, _ = lightning_fit(folder, 3, gift=True, fsdp=True, resume=checkpoint)
    for a, b in zip(local_shards(resumed), local_shards(model)):
        assert torch.equal(a, b)

