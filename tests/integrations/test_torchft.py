"""GiftDiLoCo (integrations/torchft.py) over a real torchft Lighthouse, Managers and gloo process
groups, replicas as threads (torchft_replicas.py, beside this file): the same global weights on
every replica, close to torchft's own DiLoCo, fewer bytes, a failed collective that discards the
step on every replica and no hang, and DiLoCo's options honoured or refused by name."""
import inspect
import logging
from unittest import mock

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

from torchft.local_sgd import DiLoCo  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from horovod_gift.integrations import torchft_internals as internals  # noqa: E402
from horovod_gift.integrations.torchft import GiftDiLoCo  # noqa: E402
from torchft_replicas import make_model, run_replicas  # noqa: E402


def distance(a, b):
    """The largest relative distance over the weight matrices (a one-element bias that is near
    zero says little)."""
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a if k.endswith("weight"))


def test_replicas_agree_bit_for_bit_and_follow_torchfts_diloco():
    gift = run_replicas(steps=16, gift=dict(format="int3"), fragments=2)
    fp32 = run_replicas(steps=16, fragments=2)
    plain = fp32[0].weights
    w0, w1 = gift[0].weights, gift[1].weights
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert distance(w0, plain) < 0.1, distance(w0, plain)
    # error feedback is what keeps INT3 near fp32's outer steps
    without = run_replicas(steps=16, gift=dict(format="int3", error_feedback=False), fragments=2)
    assert distance(w0, plain) < 0.6 * distance(without[0].weights, plain)
    # INT3 against fp32: about a tenth of the bytes torchft's DiLoCo hands the same process
    # group (counted there, whoever sends them: GIFT's fingerprints and small tensors included)
    assert all(0 < g.sent < 0.15 * f.sent for g, f in zip(gift, fp32)), (
        [g.sent for g in gift], [f.sent for f in fp32])
    # and GIFT's own count of the last sync agrees with what reached the process group
    last = sum(gift[0].engine.stats()["bytes_sent"])
    assert 0.2 * gift[0].sent / 4 < last <= gift[0].sent / 4, (last, gift[0].sent)


def test_the_default_format_nvfp4_keeps_replicas_identical_and_nearer_fp32_than_int3():
    default = run_replicas(steps=16, gift={}, fragments=2)
    assert default[0].engine.config.format == "nvfp4"
    w0, w1 = default[0].weights, default[1].weights
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    plain = run_replicas(steps=16, fragments=2)[0].weights
    int3 = run_replicas(steps=16, gift=dict(format="int3"), fragments=2)[0].weights
    nvfp4_gap, int3_gap = distance(w0, plain), distance(int3, plain)
    assert nvfp4_gap < int3_gap, (nvfp4_gap, int3_gap)


def test_a_failed_collective_discards_the_step_on_every_replica_and_training_goes_on(caplog):
    caplog.set_level(logging.INFO, logger="horovod_gift")
    results = run_replicas(steps=16, gift=dict(format="int3"), fragments=2, fail_at={1: (2,)})
    w0, w1 = results[0].weights, results[1].weights
    assert "the outer step is discarded" in caplog.text
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    healthy = run_replicas(steps=16, gift=dict(format="int3"), fragments=2)
    # one outer step fewer than a healthy run, but not lost: close to it, not equal
    assert 0 < distance(w0, healthy[0].weights) < 0.5


def test_a_resumed_run_ends_with_the_bits_of_an_uninterrupted_one():
    """Train 8, save every replica's state (GIFT's residuals included), resume to 16."""
    gift = dict(format="int3")
    whole = run_replicas(steps=16, gift=gift, fragments=2, save_at=8)
    resumed = run_replicas(steps=16, gift=gift, fragments=2,
                           resume=[replica.saved for replica in whole])
    for a, b in zip(whole, resumed):
        assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    # the residuals matter: resumed without them, the bits differ
    cleared = [dict(r.saved, gift=dict(r.saved["gift"], fragments=[
        dict(f, residual1={}, residual2={}) for f in r.saved["gift"]["fragments"]]))
        for r in whole]
    fresh = run_replicas(steps=16, gift=gift, fragments=2, resume=cleared)
    assert not all(torch.equal(whole[0].weights[k], fresh[0].weights[k])
                   for k in whole[0].weights)


def test_a_replica_that_dies_and_rejoins_heals_and_the_replicas_agree_again(caplog):
    """Replica 1 stops after 6 inner steps; a new replica 1 joins from the initial weights,
    heals from replica 0 (its residuals restart at zero) and both train to 6 outer steps."""
    caplog.set_level(logging.INFO, logger="horovod_gift")
    results = run_replicas(steps=40, gift=dict(format="int3"), until=6, rejoin=(1, 6))
    survivor, rejoined = results[0], results[2]
    assert survivor.error is None and rejoined.error is None, (survivor.error, rejoined.error)
    assert "heals from a peer: its residuals restart at zero" in caplog.text
    assert all(torch.equal(survivor.weights[k], rejoined.weights[k]) for k in survivor.weights)
    assert survivor.engine.syncs[0].state.layout is not None


def test_replicas_configured_differently_raise_on_every_replica():
    results = run_replicas(steps=8, gift=[dict(format="int3"), dict(format="nvfp4")])
    for replica in results:
        assert isinstance(replica.error, ValueError), replica.error
        assert "format differs across replicas" in str(replica.error)


@pytest.mark.parametrize("option, value, words", [
    ("should_quantize", True, "GIFT quantizes"),
    ("use_bucketization", True, "bucket_elements"),
    ("transform", "whiten", "transform must be one of"),
    ("start_step", 3, "start_step does not apply"),
    ("topology", "two-hop", "the replica group has one rank"),
])
def test_options_that_do_not_apply_are_refused_by_name(option, value, words):
    model = make_model()
    inner = torch.optim.AdamW(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    manager = mock.create_autospec(Manager, instance=True)
    manager._use_async_quorum = False
    with pytest.raises(ValueError, match=words):
        GiftDiLoCo(manager, [model], inner, outer, 4, **{option: value})


def test_an_outer_optimizer_that_spans_fragments_is_refused():
    """torchft would step it at each fragment's sync over the other fragment's parameters too."""
    model = make_model()
    parts = [model[:2], model[2:]]
    inner = torch.optim.AdamW(model.parameters())
    manager = mock.create_autospec(Manager, instance=True)
    manager._use_async_quorum = False
    with pytest.raises(ValueError, match="one outer_optimizer for 2 fragments"):
        GiftDiLoCo(manager, parts, inner, torch.optim.SGD(model.parameters(), lr=0.7), 4)
    swapped = [torch.optim.SGD(part.parameters(), lr=0.7) for part in reversed(parts)]
    with pytest.raises(ValueError, match=r"outer_optimizer\[0\] does not hold exactly"):
        GiftDiLoCo(manager, parts, inner, swapped, 4)
    GiftDiLoCo(manager, parts, inner, [torch.optim.SGD(p.parameters(), lr=0.7) for p in parts], 4)


def test_the_private_torchft_attributes_gift_reads():
    """Fails when torchft changes what torchft_internals.py relies on."""
    model = nn.Sequential(nn.Linear(4, 4))
    inner = torch.optim.AdamW(model.parameters())
    manager = mock.create_autospec(Manager, instance=True)
    manager._use_async_quorum = False
    diloco = DiLoCo(manager, [model], inner, torch.optim.SGD(model.parameters(), lr=0.7), 4)
    fragment = internals.fragments(diloco)[0]
    for name in internals.FRAGMENT_ATTRIBUTES:
        assert hasattr(fragment, name), name
    assert internals.fragment_module(fragment) is model and internals.fragment_id(fragment) == 0
    assert isinstance(internals.pseudo_gradients(fragment), dict)
    assert isinstance(internals.pending_works(fragment), list)
    # prepare_sync calls _average_grads after _save_grads; perform_sync returns should_commit
    prepare = inspect.getsource(type(fragment).prepare_sync)
    assert prepare.index("_save_grads") < prepare.index("_average_grads()")
    perform = inspect.getsource(type(fragment).perform_sync)
    assert "return should_commit" in perform and "work.wait()" in perform
    source = inspect.getsource(Manager.__init__)
    assert "self._pg = pg" in source and "self._group_world_size" in source
    assert hasattr(ProcessGroupGloo, "parent")
