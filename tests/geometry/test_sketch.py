"""The Nystrom sketch of A = E[x x^T] behind InputWhitening, and shared statistics in
WhiteningStatistics (one process: Horovod of size 1)."""
import pathlib
import sys

import horovod.torch as hvd
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import horovod_gift as gift
from horovod_gift.geometry import sketch
from horovod_gift.hvd.comm import HorovodCommunicator
from horovod_gift.geometry.sketch import NystromSketch, sketching_matrix
from horovod_gift.geometry.statistics import WhiteningStatistics
from test_whitening import spiked_activations

# test_geometry has put benchmarks/ on the path
from dense_whitening import DenseCovariance  # noqa: E402

CPU = torch.device("cpu")


def decaying_activations(n_in=256, tokens=8192, decay=0.85, seed=0):
    """Rows x = Q diag(decay^(i/2)) z: A = E[x x^T] has eigenvalues decay^i, i = 0, 1, ..."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n_in, n_in, generator=g, dtype=torch.float64)).Q
    scale = decay ** (torch.arange(n_in, dtype=torch.float64) / 2)
    return ((torch.randn(tokens, n_in, generator=g, dtype=torch.float64) * scale) @ q.t()).float()


def covariance(x):
    return (x.t().double() @ x.double()) / len(x)


def whitened_condition(w, x):
    return float(torch.linalg.cond(covariance(w.whiten_activations(x))))


def test_sketch_finds_the_top_eigenpairs_of_a_decaying_spectrum():
    """Eigenvalues 0.8^i, rank 16, the default oversampling (l = 36 of 256 columns)."""
    x = decaying_activations(decay=0.8)
    w = gift.InputWhitening(256, rank=16)
    w.update(x)
    lam, vec, diagonal = w.statistic.eigenpairs(16)
    exact_lam, exact_vec = torch.linalg.eigh(covariance(x))
    exact_lam, exact_vec = exact_lam.flip(0)[:16], exact_vec.flip(1)[:, :16]
    order = lam.argsort(descending=True)
    lam, vec = lam[order], vec[:, order]
    assert torch.allclose(lam[:8], exact_lam[:8], rtol=3e-2)
    assert torch.allclose(lam, exact_lam, rtol=0.1)
    # The leading eigenvectors, and the top-8 subspace as a whole (its principal angles).
    assert (vec[:, :4] * exact_vec[:, :4]).sum(0).abs().min() > 0.999
    assert torch.linalg.svdvals(vec[:, :8].t() @ exact_vec[:, :8]).min() > 0.99
    assert torch.allclose(diagonal, covariance(x).diagonal(), rtol=1e-4)
    assert torch.allclose(w.trace, covariance(x).trace(), rtol=1e-5)


def test_sketch_whitening_on_a_flat_noise_floor_tends_to_the_dense_one():
    """Rank-8 spikes over a flat diagonal noise floor (geometry/test_whitening.py): the Nystrom
    error in the spike directions is about the noise mass beyond l over the oversampling, so at the
    default l = 28 of 96 the whitened spectrum is flat only to a factor of a few; with l =
    in_features the sketch is exact and whitens as the dense statistic does (up to fp32
    rounding)."""
    x = spiked_activations()
    common = dict(rank=8, damping=1e-3, sqrt="diagonal")   # the floor's spread kept by isotropic
    dense = gift.InputWhitening(96, statistic=DenseCovariance(96), **common)
    default = gift.InputWhitening(96, **common)
    exact = gift.InputWhitening(96, oversampling=88, **common)
    for w in (dense, default, exact):
        w.update(x)
    assert float(torch.linalg.cond(covariance(x))) > 1000
    assert whitened_condition(dense, x) < 2.5 and whitened_condition(default, x) < 8
    assert whitened_condition(exact, x) == pytest.approx(whitened_condition(dense, x), rel=1e-2)


def test_sketch_whitening_round_trip_is_the_identity():
    w = gift.InputWhitening(256, rank=16)
    w.update(decaying_activations())
    g = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    u = w.forward(g)
    assert not torch.allclose(u, g, rtol=0.1)
    assert torch.allclose(w.inverse(u), g, atol=1e-4, rtol=1e-4)
    assert torch.allclose(w.forward(w.inverse(g)), g, atol=1e-4, rtol=1e-4)


def held_tensors(obj, seen=None):
    """Every tensor reachable from obj through attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [t for child in children for t in held_tensors(child, seen)]


def test_memory_held_per_statistic_is_in_times_sketch_columns():
    n_in, rank = 512, 8
    w = gift.InputWhitening(n_in, rank=rank)
    for seed in range(3):
        w.update(decaying_activations(n_in=n_in, tokens=2048, seed=seed))
    tensors = held_tensors(w)
    columns = w.statistic.columns
    assert columns == rank + sketch.OVERSAMPLING
    assert max(t.numel() for t in tensors) < n_in * n_in // 8, "an in x in tensor is held"
    held = sum(t.numel() * t.element_size() for t in tensors)
    sketch_bytes = 4 * n_in * (columns + 1)           # Y and diag(A), fp32
    assert held <= sketch_bytes + 4 * w.factor_numel(), (held, sketch_bytes)


def test_ema_of_the_sketch_is_the_sketch_of_the_ema():
    """Y is linear in A: the blend of two batches' sketches is the sketch of their blended A."""
    a, b = decaying_activations(seed=1), decaying_activations(seed=2) * 3
    blended = gift.InputWhitening(256, rank=16, ema=0.25)
    blended.update(a)
    blended.update(b)
    alone = []
    for x in (a, b):
        w = gift.InputWhitening(256, rank=16)
        w.update(x)
        alone.append(w.statistic.state)
    expected = 0.25 * alone[0] + 0.75 * alone[1]
    assert torch.allclose(blended.statistic.state, expected, rtol=1e-5, atol=1e-6)
    a_blend = 0.25 * covariance(a) + 0.75 * covariance(b)
    y = blended.statistic.state[:-256].view(256, -1).double()
    y_expected = a_blend @ blended.statistic.omega(CPU).double()
    assert torch.allclose(y, y_expected, rtol=1e-4, atol=1e-4 * float(y.abs().max()))
    assert torch.allclose(blended.trace, a_blend.trace(), rtol=1e-5)


def test_sketching_matrix_is_orthonormal_deterministic_and_sized():
    omega = sketching_matrix(300, 42, 7, CPU)
    assert omega.shape == (300, 42) and omega.dtype == torch.float32
    assert torch.allclose(omega.t() @ omega, torch.eye(42), atol=1e-5)
    sketching_matrix.cache_clear()
    assert torch.equal(sketching_matrix(300, 42, 7, CPU), omega), "regenerated from the seed"
    assert not torch.equal(sketching_matrix(300, 42, 8, CPU), omega)
    assert gift.InputWhitening(20, rank=16).statistic.columns == 20, "l is at most in_features"
    with pytest.raises(ValueError, match="columns must be in"):
        NystromSketch(8, 9)


def test_a_zero_statistic_and_an_indefinite_sketch_still_factor(monkeypatch):
    """All-zero inputs (Y = 0: only the floor of the shift is positive; with no scale to damp
    relative to, the map is the identity), and a Y perturbed so that Omega^T Y_nu is indefinite at
    the first shift, which then grows."""
    for sqrt in ("isotropic", "diagonal"):
        w = gift.InputWhitening(64, rank=8, sqrt=sqrt)
        w.update(torch.zeros(100, 64))
        g = torch.randn(5, 64)
        assert torch.allclose(w.forward(g), g) and torch.allclose(w.inverse(g), g)
    w = gift.InputWhitening(64, rank=8)
    w.update(decaying_activations(n_in=64, tokens=4000, decay=0.5))
    y = w.statistic.state[:-64]
    noise = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.add_(noise * 1e-3 * float(y.abs().max()))
    attempts = []
    cholesky_ex = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda m: attempts.append(m) or cholesky_ex(m))
    lam, vec, _ = w.statistic.eigenpairs(8)
    assert len(attempts) > 1, "the first shift was enough: the test no longer tests the retry"
    assert torch.isfinite(lam).all() and torch.isfinite(vec).all() and lam[0] > 0


# ---------------------------------------------------------------- WhiteningStatistics


@pytest.fixture(scope="module")
def horovod():
    """Horovod cannot start again in a process it was shut down in; shut down, tests that check
    the uninitialised state (test_misuse.py) pass in any order."""
    hvd.init()
    yield hvd
    hvd.shutdown()


class SharedInputs(torch.nn.Module):
    """q and k read the same normed tensor; o reads the raw input, a tensor of the same shape."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.q, self.k = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
        self.o = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h).sum() + self.k(h).sum() + self.o(x).sum()


def statistics_of(model):
    return WhiteningStatistics(model, dict(model.named_parameters()), whitening_rank=4,
                               damping=1e-3, refresh_every=1, window=10,
                               comm=HorovodCommunicator())


def statistics_step(model, stats, x):
    """One step as GIFT runs it: forward and backward, refresh at the first gradient (from the
    steps before), then this step's sums go into the history."""
    model(x).backward()
    changed = stats.refresh()
    stats.advance()
    return changed


def test_layers_reading_one_input_share_one_statistic(horovod, monkeypatch):
    torch.manual_seed(0)
    model = SharedInputs()
    stats = statistics_of(model)
    names = []
    for collective in ("allreduce_async", "broadcast_async_"):
        original = getattr(hvd, collective)
        monkeypatch.setattr(hvd, collective, lambda t, *a, original=original, **k:
                            names.append(k["name"]) or original(t, *a, **k))
    x = torch.randn(4, 6, 32)
    assert statistics_step(model, stats, x) == {}, "no earlier step: no factors"
    w = stats.whitening
    assert w["q.weight"] is w["k.weight"] and w["o.weight"] is not w["q.weight"]
    changed = statistics_step(model, stats, torch.randn(4, 6, 32))
    assert set(changed) == {"q.weight", "k.weight", "o.weight"}
    assert changed["k.weight"] is gift.geometry.whitening.IDENTITY_FACTORS     # no factors before
    # a fixed set of names, not one per layer: every statistic in one allreduce, the factors in
    # one broadcast per computing rank
    assert names == ["gift.sharing", "gift.stats", "gift.stats", "gift.factors.0"]
    # The shared statistic counts q's input once, not once per reader, and only the first step's.
    alone = gift.InputWhitening(32, rank=4)
    alone.update(model.norm(x))
    shared = w["q.weight"].statistic.state
    assert torch.allclose(shared, alone.statistic.state, rtol=1e-5, atol=1e-6)
    assert w["q.weight"].factors is not None and w["o.weight"].factors is not None
    previous = w["q.weight"].factors
    changed = statistics_step(model, stats, torch.randn(4, 6, 32))
    assert changed["k.weight"] is previous and w["k.weight"] is w["q.weight"]
    restored = statistics_of(SharedInputs())
    restored.load_state_dict(stats.state_dict())
    assert restored.whitening["q.weight"] is restored.whitening["k.weight"]
    g = torch.randn(16, 32)
    assert torch.equal(restored.whitening["k.weight"].forward(g), w["k.weight"].forward(g))
    stats.remove_hooks()
    restored.remove_hooks()


def test_refresh_uses_a_bias_corrected_ema_of_earlier_steps_only(horovod):
    """Steps of 4, 8 and 2 tokens, refresh on the fourth: (d^2 S1 + d S2 + S3) / (d^2 4 + d 8 + 2),
    d = 1 - 1/window; the fourth step's own batch (huge here) is not in it."""
    torch.manual_seed(0)
    model = SharedInputs()
    stats = WhiteningStatistics(model, dict(model.named_parameters()), whitening_rank=4,
                                damping=0.1, refresh_every=3, window=4,
                                comm=HorovodCommunicator())
    batches = [torch.randn(n, 1, 32) for n in (4, 8, 2)] + [torch.randn(5, 1, 32) * 100]
    for x in batches:
        statistics_step(model, stats, x)
    d = 0.75
    weights = [d * d, d, 1.0]
    sums = [sketch_sums(stats.whitening["o.weight"].statistic, x) for x in batches[:3]]
    expected = sum(w * s for w, s in zip(weights, sums)) / (d * d * 4 + d * 8 + 2)
    state = stats.whitening["o.weight"].statistic.state
    assert torch.allclose(state, expected, rtol=1e-5, atol=1e-6)
    stats.remove_hooks()


def sketch_sums(statistic, x):
    sums = torch.zeros(statistic.numel)
    statistic.accumulate(x.reshape(-1, x.shape[-1]), sums)
    return sums


def test_sharing_waits_for_a_statistics_step_that_ran(horovod):
    model = SharedInputs()
    stats = statistics_of(model)
    with torch.no_grad():
        model(torch.randn(2, 3, 32))
    assert stats.refresh() == {} and stats.whitening["q.weight"] is not stats.whitening["k.weight"]
    stats.advance()
    statistics_step(model, stats, torch.randn(2, 3, 32))
    assert stats.whitening["q.weight"] is stats.whitening["k.weight"]
    stats.remove_hooks()


class DevicelessFactories(TorchFunctionMode):
    """Records tensor factory calls made from horovod_gift without an explicit device=."""

    def __init__(self):
        super().__init__()
        self.package = str(pathlib.Path(gift.__file__).parent)
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1)
        if (func in _device_constructors() and kwargs.get("device") is None
                and caller.f_code.co_filename.startswith(self.package)):
            self.calls.append(f"{func.__name__} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **kwargs)


def test_every_factory_call_names_its_device(horovod):
    """Users call torch.set_default_device("cuda"): a factory without device= would put a tensor
    there. Every call names its device; and under a default device of "meta" the statistics and
    factors of a CPU model stay on the CPU and finite."""
    model = SharedInputs()
    with DevicelessFactories() as recorder:
        stats = statistics_of(model)
        statistics_step(model, stats, torch.randn(4, 6, 32))
    assert recorder.calls == []
    with DevicelessFactories() as recorder:
        sketching_matrix.cache_clear()
        w = gift.InputWhitening(48, rank=8)
        w.update(decaying_activations(n_in=48, tokens=500))
        w.inverse(w.forward(torch.randn(3, 48)))
        assert w.trace > 0
    assert recorder.calls == []
    x = torch.randn(4, 6, 32)
    with torch.device("meta"):
        sketching_matrix.cache_clear()
        statistics_step(model, stats, x)
    for w in stats.whitening.values():
        assert w.statistic.state.device == CPU and torch.isfinite(w.statistic.state).all()
        assert all(f.device == CPU and torch.isfinite(f).all() for f in w.factors.values())
    stats.remove_hooks()


def test_statistics_are_taken_in_fp32_under_autocast(horovod):
    """Mixed-precision training runs the forward pass under autocast: the hooks' sketch products
    must not come out bf16 (an fp32 sum cannot take them)."""
    model = SharedInputs()
    stats = statistics_of(model)
    for _ in range(2):          # the second refresh has the first step's statistics
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 6, 32))
        loss.float().backward()
        changed = stats.refresh()
        stats.advance()
    assert set(changed) == {"q.weight", "k.weight", "o.weight"}
    assert stats.whitening["q.weight"].statistic.state.dtype == torch.float32


def test_state_is_copied_out_and_loaded_onto_the_layers_device(horovod):
    model = SharedInputs()
    stats = statistics_of(model)
    for _ in range(2):      # factors from the second step on
        statistics_step(model, stats, torch.randn(4, 6, 32))
    saved = stats.state_dict()
    before = {k: v.clone() for k, v in saved["whitening"]["q.weight"]["factors"].items()}
    statistics_step(model, stats, torch.randn(4, 6, 32) * 3)      # the EMA moves on in place
    after = saved["whitening"]["q.weight"]["factors"]
    assert all(torch.equal(before[k], after[k]) for k in before), "state_dict aliases live state"
    w = gift.InputWhitening(32, rank=4)
    w.load_state_dict(saved["whitening"]["q.weight"], device="meta")
    assert w.statistic.state.device.type == "meta"
    assert {t.device.type for t in w.factors.values()} == {"meta"}


def test_factors_that_cannot_be_computed_raise_on_every_rank(horovod, monkeypatch):
    """Only one rank computes a statistic's factors while the others wait in its broadcast: a
    failure there travels as NaN and every rank raises the same error (here, one rank)."""
    model = SharedInputs()
    stats = statistics_of(model)

    def fail(self):
        raise RuntimeError("linalg failed")
    monkeypatch.setattr(gift.InputWhitening, "compute_factors", fail)
    statistics_step(model, stats, torch.randn(4, 6, 32))        # no earlier step: no factors
    with pytest.raises(FloatingPointError, match="could not be computed"):
        statistics_step(model, stats, torch.randn(4, 6, 32))


def test_a_non_finite_step_does_not_stop_later_refreshes(horovod, caplog):
    """An inf in one step's activations (fp16 overflow) would stay in the EMA history for good:
    that refresh is skipped with a warning, the history restarts, and later refreshes work."""
    model = SharedInputs()
    stats = statistics_of(model)
    statistics_step(model, stats, torch.randn(4, 6, 32))
    bad = torch.randn(4, 6, 32)
    bad[0, 0, 0] = float("inf")
    statistics_step(model, stats, bad)
    before = {k: v.clone() for k, v in stats.whitening["o.weight"].factors.items()}
    with caplog.at_level("WARNING", logger="horovod_gift"):
        changed = statistics_step(model, stats, torch.randn(4, 6, 32))
    assert "o.weight" not in changed and "not finite" in caplog.text
    after = stats.whitening["o.weight"].factors
    assert all(torch.equal(before[k], after[k]) for k in before)
    changed = statistics_step(model, stats, torch.randn(4, 6, 32))
    assert "o.weight" in changed, "refreshes stopped after one non-finite step"
    assert all(torch.isfinite(f).all() for f in stats.whitening["o.weight"].factors.values())
    stats.remove_hooks()
