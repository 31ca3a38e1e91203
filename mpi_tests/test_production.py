"""What production users rely on: warm-up, logging and profiler ranges, per-rank checkpoints that
survive a change in the number of ranks, and fp16 GradScaler training."""
import logging
import time

import pytest
import torch
import horovod.torch as hvd

import horovod_gift as gift
from helpers import assert_identical_on_all_ranks
from test_gift import TinyLM, batch

LATE_SECONDS = 0.5


def loss_of(model, step_index):
    x, y = batch(step_index, hvd.rank())
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def averaged_gradients(model, opt, step_index, scale=1.0):
    """One step's averaged gradients (before the optimizer step), then the step."""
    opt.zero_grad()
    (loss_of(model, step_index) * scale).backward()
    opt.synchronize()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    return grads


def wrapped(model, compression, lr=0.05):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                    named_parameters=model.named_parameters(),
                                    compression=compression)


def test_warm_up_steps_are_horovods_fp32_bit_for_bit_then_compression_starts():
    reference, model = TinyLM(), TinyLM()
    reference_opt = wrapped(reference, hvd.Compression.none)
    compression = gift.GIFT(model, format="nvfp4", start_step=3, verbose=False)
    opt = wrapped(model, compression)
    for k in range(5):
        expected = averaged_gradients(reference, reference_opt, k)
        if k == 3:
            assert not compression.reducer.feedback.stage1, \
                "residuals exist before compression started"
        got = averaged_gradients(model, opt, k)
        same = all(torch.equal(a, b) for a, b in zip(got, expected))
        assert same == (k < 3), f"step {k}: warm-up must be exactly Horovod fp32, then compressed"
        if k >= 3:      # the first compressed steps: the codec's error, no more
            err = sum(float((a - b).square().sum()) for a, b in zip(got, expected))
            assert err ** 0.5 < 0.3 * sum(float(b.square().sum()) for b in expected) ** 0.5
            # the parameters moved apart at step 3; from then on compare each run with itself
            reference.load_state_dict(model.state_dict())
        assert_identical_on_all_ranks(got, f"averaged gradients at step {k}")
    assert compression.stats()["warmup_steps"] == 3
    assert compression.reducer.feedback.stage1, "error feedback runs once compression has started"


def test_log_every_logs_one_line_on_rank_0_and_the_profiler_sees_the_codec(caplog):
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", refresh_every=2, log_every=2, verbose=False)
    opt = wrapped(model, compression)
    with caplog.at_level(logging.INFO, logger="horovod_gift"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for k in range(4):
                averaged_gradients(model, opt, k)
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_gift"]
    if hvd.rank() == 0:
        assert len(lines) == 2, lines
        assert lines[0].startswith("step 2: ") and "bits/element" in lines[0]
        assert "MB sent/step" in lines[0] and "whiten" in lines[0]
    else:
        assert lines == []
    names = {event.key for event in prof.key_averages()}
    assert set(gift.telemetry.PROFILER_RANGES) - {"horovod_gift.vote"} <= names, names


def test_waiting_for_a_late_rank_is_not_counted_as_codec_time():
    """The codec seconds are GIFT's own work: a rank that starts its step late makes the others
    wait in GIFT's first collective of the step, and that wait is network time."""
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = wrapped(model, compression)
    averaged_gradients(model, opt, 0)
    before = compression.stats()
    opt.zero_grad()
    if hvd.rank() == 1:
        time.sleep(LATE_SECONDS)
    loss_of(model, 1).backward()
    opt.step()
    after = compression.stats()
    if hvd.rank() != 1:
        assert after["wait_seconds"] - before["wait_seconds"] > 0.8 * LATE_SECONDS
        assert after["codec_seconds"] - before["codec_seconds"] < 0.5 * LATE_SECONDS


def test_state_dict_is_this_ranks_own_and_not_collective():
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = wrapped(model, compression)
    for k in range(3):
        averaged_gradients(model, opt, k)
    if hvd.rank() == 0:       # alone: a collective here would hang the test (timeout)
        state = compression.state_dict()
        mine = state["rank_state"]
        assert (mine["rank"], mine["ranks"]) == (0, hvd.size())
        residual_elements = sum(r.numel() for key in ("residual1", "residual2")
                                for r in mine["feedback"][key].values())
        parameters = sum(p.numel() for p in model.parameters())
        assert residual_elements <= parameters * (1 + 1 / hvd.size()) + 64
        assert compression.state_dict(rank_state=False)["rank_state"] is None


def test_without_error_feedback_each_state_dict_is_its_own():
    """A caller may edit a checkpoint before saving it: that must not leak into the next one."""
    compression = gift.GIFT(TinyLM(), format="nvfp4", error_feedback=False, verbose=False)
    first = compression.state_dict()["rank_state"]["feedback"]
    first["residual1"]["edited"] = torch.ones(1)
    assert compression.state_dict()["rank_state"]["feedback"] == {"residual1": {},
                                                                 "residual2": {}, "spread": []}


def test_reset_rank_state_restarts_the_residuals_and_training_goes_on():
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", verbose=False)
    opt = wrapped(model, compression)
    for k in range(2):
        averaged_gradients(model, opt, k)
    assert compression.reducer.feedback.stage1 and compression.reducer.feedback.stage2
    compression.reset_rank_state()
    assert not compression.reducer.feedback.stage1 and not compression.reducer.feedback.stage2
    got = averaged_gradients(model, opt, 2)
    assert compression.reducer.feedback.stage1, "error feedback resumes after the reset"
    assert_identical_on_all_ranks(got, "averaged gradients after reset_rank_state")


@pytest.mark.parametrize("change", ["ranks", "shared only"])
def test_a_state_from_another_number_of_ranks_keeps_all_but_the_residuals(change, caplog):
    model = TinyLM()
    compression = gift.GIFT(model, format="nvfp4", refresh_every=2, verbose=False)
    opt = wrapped(model, compression)
    for k in range(5):
        averaged_gradients(model, opt, k)
    state = compression.state_dict(rank_state=change != "shared only")
    if change == "ranks":
        state["rank_state"]["ranks"] = hvd.size() + 2      # as saved by a larger job
    resumed_model = TinyLM()
    resumed_model.load_state_dict(model.state_dict())
    # the process set given: the state applies at once (else at the first step, once known)
    resumed = gift.GIFT(resumed_model, format="nvfp4", refresh_every=2, verbose=False,
                        process_set=hvd.global_process_set)
    resumed_opt = wrapped(resumed_model, resumed)
    with caplog.at_level(logging.WARNING, logger="horovod_gift"):
        resumed.load_state_dict(state)
    warnings = [r.getMessage() for r in caplog.records if r.name == "horovod_gift"]
    assert len(warnings) == (1 if hvd.rank() == 0 else 0), warnings
    assert not resumed.reducer.feedback.stage1 and not resumed.reducer.feedback.stage2
    factors = compression.statistics.whitening["up.weight"].factors
    kept = resumed.statistics.whitening["up.weight"].factors
    assert all(torch.equal(factors[k], kept[k]) for k in factors), "the shared state is kept"
    assert resumed.step == compression.step
    grads = averaged_gradients(resumed_model, resumed_opt, 5)
    assert_identical_on_all_ranks(grads, "averaged gradients after the resume")


def test_residuals_follow_the_grad_scalers_scale():
    """fp16 training's pattern (Horovod's docs): the loss is scaled, synchronize(), unscale_,
    step under skip_synchronize(). The scale drops 1024x mid-run (as after overflows): with the
    scaler given to GIFT the residuals follow it and the unscaled average stays within the
    codec's error; without, the old residuals, 1024x too large, swamp the new gradients."""
    errors = {}
    for follows in (True, False):
        model, reference = TinyLM(), TinyLM()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        compression = gift.GIFT(model, format="nvfp4", transform="none", verbose=False,
                                grad_scaler=scaler if follows else None)
        opt, reference_opt = wrapped(model, compression), wrapped(reference, hvd.Compression.none)
        worst = 0.0
        for k in range(8):
            exact = averaged_gradients(reference, reference_opt, k)
            opt.zero_grad()
            scaler.scale(loss_of(model, k)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            got = [p.grad.detach().clone() for p in model.parameters()]
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update(new_scale=2.0 ** 6 if k == 3 else None)
            reference.load_state_dict(model.state_dict())
            err = sum(float((a - b).square().sum()) for a, b in zip(got, exact)) ** 0.5
            norm = sum(float(b.square().sum()) for b in exact) ** 0.5
            if k >= 4:
                worst = max(worst, err / norm)
        errors[follows] = worst
    assert errors[True] < 0.3, errors
    assert errors[False] > 3, errors


def test_a_resumed_run_with_a_grad_scaler_continues_bit_for_bit():
    """Saved right after the scale changed: the residuals' scale travels with them, so the
    resumed run rescales them as the uninterrupted one did."""
    def make():
        model = TinyLM()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        compression = gift.GIFT(model, format="nvfp4", verbose=False, grad_scaler=scaler)
        return model, scaler, compression, wrapped(model, compression)

    def scaled_step(model, scaler, opt, k):
        opt.zero_grad()
        scaler.scale(loss_of(model, k)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        grads = [p.grad.detach().clone() for p in model.parameters()]
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update(new_scale=2.0 ** 10 if k == 3 else None)
        return grads

    model, scaler, compression, opt = make()
    straight = [scaled_step(model, scaler, opt, k) for k in range(6)][4:]
    model, scaler, compression, opt = make()
    for k in range(4):
        scaled_step(model, scaler, opt, k)
    saved = {"model": {n: t.clone() for n, t in model.state_dict().items()},
             "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
             "compressor": compression.state_dict()}
    model, scaler, compression, opt = make()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    compression.load_state_dict(saved["compressor"])
    # saved again before any step: the loaded per-rank state, not the empty live one
    assert compression.state_dict()["rank_state"] is saved["compressor"]["rank_state"]
    resumed = [scaled_step(model, scaler, opt, k) for k in (4, 5)]
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "resumed run differs"


@pytest.mark.parametrize("argument,value", [("hadamard_block", 100), ("hadamard_block", 0),
                                            ("hadamard_block", True), ("refresh_every", 0),
                                            ("stat_window", 0),
                                            ("damping", 0.0), ("start_step", -1),
                                            ("log_every", -2), ("grad_scaler", object())])
def test_bad_arguments_are_refused_by_name(argument, value):
    with pytest.raises((ValueError, TypeError), match=argument):
        gift.GIFT(TinyLM(), **{argument: value})
