"""InputWhitening (geometry/whitening.py): whitening flattens the spectrum, exact inverses, the
statistic, against dense references."""
import pathlib
import sys

import pytest
import torch

import horovod_gift as gift

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from dense_whitening import DenseCovariance, whitening  # noqa: E402  (exact references)


def spiked_activations(n_in=96, rank=8, tokens=100_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n_in, rank, generator=g)
    diag = torch.rand(n_in, generator=g) + 0.1
    return (
        torch.randn(tokens, rank, generator=g) @ u.t() * 3
        + torch.randn(tokens, n_in, generator=g) * diag.sqrt()
    )


def covariance(x):
    return (x.t().double() @ x.double()) / len(x)


def test_whitening_with_full_rank_gives_identity_covariance():
    x = spiked_activations()
    w = gift.InputWhitening(96, rank=96, damping=1e-6)
    w.update(x)
    c = covariance(w.whiten_activations(x))
    assert torch.allclose(c, torch.eye(96, dtype=torch.float64), atol=2e-3)


@pytest.mark.parametrize("sqrt", ["diagonal", "cholesky", "symmetric"])
def test_low_rank_whitening_flattens_the_spectrum(sqrt):
    """Every square root of low rank + diagonal, from the exact top eigenpairs (the dense
    statistic). The sketch's eigenpairs are approximate on this flat noise floor:
    tests/geometry/test_sketch.py."""
    x = spiked_activations()
    before = torch.linalg.cond(covariance(x))
    w = whitening(96, rank=8, damping=1e-3, sqrt=sqrt, statistic=DenseCovariance(96))
    w.update(x)
    after = torch.linalg.cond(covariance(w.whiten_activations(x)))
    assert before > 1000 and after < 2.5


def test_isotropic_root_flattens_the_spikes_and_keeps_the_diagonal_floor():
    """The isotropic remainder replaces the diagonal noise floor (0.1 ... 1.1 here) by its mean:
    the spikes go, the floor's own spread (11x) stays."""
    x = spiked_activations()
    w = gift.InputWhitening(96, rank=8, damping=1e-3, statistic=DenseCovariance(96))
    w.update(x)
    after = torch.linalg.cond(covariance(w.whiten_activations(x)))
    assert after < 15


def test_isotropic_root_is_the_symmetric_root_of_low_rank_plus_mean():
    """forward = G A_hat^{-1/2}, inverse = G A_hat^{1/2} for A_hat = U L U^T + sigma (I - U U^T)
    + delta I (sigma: mean of the rest of the spectrum, delta = damping tr(A) / in), worked out
    densely in fp64 from the exact eigenpairs."""
    x = spiked_activations(n_in=48, tokens=20_000)
    a = covariance(x)
    e, v = torch.linalg.eigh(a)
    lam, u = e[-8:], v[:, -8:]
    sigma, delta = (a.trace() - lam.sum()) / 40, 0.1 * a.trace() / 48
    a_hat = (u * lam) @ u.t() + sigma * (torch.eye(48, dtype=torch.float64) - u @ u.t())
    e_hat, v_hat = torch.linalg.eigh(a_hat + delta * torch.eye(48, dtype=torch.float64))
    w = gift.InputWhitening(48, rank=8, damping=0.1, statistic=DenseCovariance(48))
    w.update(x)
    g = torch.randn(20, 48, generator=torch.Generator().manual_seed(1))
    root_inv, root = ((v_hat * e_hat.pow(p)) @ v_hat.t() for p in (-0.5, 0.5))
    assert torch.allclose(w.forward(g).double(), g.double() @ root_inv, rtol=1e-4, atol=1e-5)
    assert torch.allclose(w.inverse(g).double(), g.double() @ root, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sqrt", ["isotropic", "diagonal", "symmetric"])
def test_damping_is_relative_to_the_activations_scale(sqrt):
    """Activations 1000x larger give a map 1000x smaller, whatever the damping: a damping in
    absolute units would whiten small and large activations differently."""
    x = spiked_activations(n_in=48, tokens=5000)
    small, large = (whitening(48, rank=8, damping=0.1, sqrt=sqrt) for _ in range(2))
    small.update(x)
    large.update(x * 1000)
    g = torch.randn(10, 48, generator=torch.Generator().manual_seed(2))
    scaled, expected = large.forward(g) * 1000, small.forward(g)
    assert (scaled - expected).norm() < 1e-4 * expected.norm()


def test_square_roots_agree_on_the_whitened_spectrum():
    """S S^T = A_hat for every square root of low rank + diagonal, so S^{-1} A S^{-T} has the
    same eigenvalues."""
    x = spiked_activations(n_in=48, tokens=20_000)
    spectra = []
    for sqrt in ("diagonal", "cholesky", "symmetric"):
        w = whitening(48, rank=8, damping=1e-3, sqrt=sqrt)
        w.update(x)
        spectra.append(torch.linalg.eigvalsh(covariance(w.whiten_activations(x))))
    assert torch.allclose(spectra[0], spectra[1], rtol=1e-3) and torch.allclose(
        spectra[0], spectra[2], rtol=1e-3
    )


@pytest.mark.parametrize("sqrt", ["isotropic", "diagonal", "cholesky", "symmetric"])
def test_whitening_inverse_undoes_forward(sqrt):
    w = whitening(64, rank=16, sqrt=sqrt)
    g = torch.randn(10, 64)
    assert torch.equal(w.inverse(w.forward(g)), g), "before any update the map is the identity"
    w.update(spiked_activations(n_in=64, tokens=5000))
    u = w.forward(g)
    assert u.shape == g.shape and not torch.allclose(u, g)
    assert torch.allclose(w.inverse(u), g, atol=1e-4, rtol=1e-4)


def test_low_rank_map_in_row_blocks_equals_its_formula(monkeypatch):
    """forward: G D^{-1/2} (I + P diag(c-) P^T); inverse: G (I + P diag(c+) P^T) D^{1/2}, worked
    out in fp64 here, against the CPU path that runs in blocks of rows (several, and a short last
    one)."""
    from horovod_gift.geometry import whitening as geometry

    monkeypatch.setattr(geometry, "ROW_BLOCK_ELEMENTS", 64 * 7)
    w = gift.InputWhitening(64, rank=16, sqrt="diagonal")
    w.update(spiked_activations(n_in=64, tokens=5000))
    g = torch.randn(30, 64, generator=torch.Generator().manual_seed(4))
    f = {k: v.double() for k, v in w.factors.items()}
    forward = (g.double() / f["d_sqrt"]) @ (
        torch.eye(64, dtype=torch.float64) + (f["p"] * f["c_minus"]) @ f["p"].t()
    )
    inverse = (
        g.double()
        @ (torch.eye(64, dtype=torch.float64) + (f["p"] * f["c_plus"]) @ f["p"].t())
        * f["d_sqrt"]
    )
    assert torch.allclose(w.forward(g).double(), forward, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.inverse(g).double(), inverse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sqrt", ["isotropic", "diagonal", "cholesky"])
def test_whitening_into_out_or_in_place_gives_the_same_bits(sqrt, monkeypatch):
    """GIFT whitens a gradient in its own storage: the result must not depend on where it is
    written, also when the rows run in blocks (several, and a short last one)."""
    from horovod_gift.geometry import whitening as geometry

    monkeypatch.setattr(geometry, "ROW_BLOCK_ELEMENTS", 64 * 7)
    w = whitening(64, rank=16, sqrt=sqrt)
    w.update(spiked_activations(n_in=64, tokens=5000))
    g = torch.randn(30, 64, generator=torch.Generator().manual_seed(5))
    for direction in (w.forward, w.inverse):
        expected = direction(g)
        into = torch.full_like(g, float("nan"))
        assert direction(g, out=into) is into and torch.equal(into, expected)
        in_place = g.clone()
        assert direction(in_place, out=in_place) is in_place and torch.equal(in_place, expected)
    with pytest.raises(ValueError, match=r"out must be float32 of shape \(30, 64\)"):
        w.forward(g, out=torch.empty(30, 64, dtype=torch.float64))


@pytest.mark.parametrize("statistic", ["sketch", "dense"])
def test_whitening_statistic_is_an_ema_and_checks_shapes(statistic):
    make = {"sketch": lambda: "sketch", "dense": lambda: DenseCovariance(4)}[statistic]
    w = gift.InputWhitening(4, rank=2, ema=0.5, statistic=make())
    a, b = torch.randn(100, 4), torch.randn(100, 4) * 3
    w.update(a)
    w.update(b)
    blend = 0.5 * covariance(a) + 0.5 * covariance(b)
    if statistic == "dense":
        assert torch.allclose(w.statistic.state.view(4, 4), blend)
    else:  # Y = A Omega and diag(A), fp32
        y = w.statistic.state[:-4].view(4, -1).double()
        assert torch.allclose(y, blend @ w.statistic.omega("cpu").double(), rtol=1e-5, atol=1e-5)
        assert torch.allclose(w.statistic.diagonal.double(), blend.diagonal(), rtol=1e-5)
    with pytest.raises(ValueError, match="activations have 5 features, expected 4"):
        w.update(torch.randn(3, 5))
    with pytest.raises(ValueError, match="the statistic has 5 features, expected 4"):
        gift.InputWhitening(4, statistic=DenseCovariance(5))
    with pytest.raises(ValueError, match=r"expected a \(out, 4\) tensor"):
        w.forward(torch.randn(4, 3))
    restored = gift.InputWhitening(4, rank=2, ema=0.5, statistic=make())
    restored.load_state_dict(w.state_dict())
    g = torch.randn(3, 4)
    assert torch.equal(restored.forward(g), w.forward(g))
