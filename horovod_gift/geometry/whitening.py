"""Transforms that make a gradient near-isotropic before it is quantized. Both keep the shape,
are linear, and are identical on every rank, so ranks may sum in the transformed space and map
back once.

(The other transform, the randomized Hadamard rotation, is rotation.HadamardRotation.)

InputWhitening: the K-FAC input-side factor of an nn.Linear. With A = E[x x^T] of the layer's
input activations, (U_r, Lam_r) its top r eigenpairs and the damping delta = damping * tr(A) / in
(relative to the activations' mean energy per feature, so one value suits every layer and scale),
u = G S^{-T} for a square root S S^T = A_hat. Any S whitens the activations, but the quantizer is
not rotation-invariant, so the choice of S can matter (benchmarks/results/fidelity.md):

- sqrt="isotropic" (the default): A_hat = U_r Lam_r U_r^T + sigma (I - U_r U_r^T) + delta I, the
  rest of the spectrum replaced by its mean sigma = (tr(A) - sum Lam_r) / (in - r). Its symmetric
  root is exactly low rank plus identity: with s = sigma + delta,
      A_hat^{-1/2} = s^{-1/2} (I + U_r diag(c-) U_r^T),   c- = (s / (Lam_r + delta))^{1/2} - 1
      A_hat^{+1/2} = (I + U_r diag(c+) U_r^T) s^{1/2},    c+ = ((Lam_r + delta) / s)^{1/2} - 1.
  Being symmetric (ZCA), it whitens with the least rotation of G's coordinates, so a hot input
  channel stays where it is instead of being spread over many.
- sqrt="diagonal": A_hat = U_r Lam_r U_r^T + D, D = max(diag(A - U_r Lam_r U_r^T), 0) + delta,
  and S = D^{1/2} X^{1/2} with X = I + V Lam_r V^T, V = D^{-1/2} U_r. With V = Q R (thin QR) and
  R Lam_r R^T = W Sig W^T, X^{+-1/2} = I + P diag(c+-) P^T, P = Q W, c+- = (1 + Sig)^{+-1/2} - 1.
  Not symmetric. At the default damping it measures within 2 % of "isotropic" (fidelity.md:
  the damping and the statistics' age decide the gain, the root much less).
Both are applied as  forward: u = (G / d) (I + P diag(c-) P^T),  inverse: G = (u (I + P diag(c+)
P^T)) d, with d = D^{1/2} (a constant s^{1/2} for "isotropic"): O(out * in * r) each.
A is kept as a Nystrom sketch (statistic="sketch", the default: O(in * (r + oversampling)) memory,
(U_r, Lam_r) are those of its approximation; sketch.py), or as any other EmaStatistic given as
statistic=. The dense A and the dense roots (the paper's Cholesky factor, the full symmetric
root: O(out * in^2)) are benchmarks/dense_whitening.py's, for comparison only.
"""

import torch

from .sketch import OVERSAMPLING, EmaStatistic, NystromSketch

# The factors of the identity map: those of a layer before its first refresh.
IDENTITY_FACTORS: dict[str, torch.Tensor] = {}


class InputWhitening:
    """K-FAC input-side whitening of an nn.Linear weight gradient (out_features x in_features).
    The statistic is created on the device of the first activations (or mean) it is given.

    rank: eigenpairs of A kept (r); damping: delta / (tr(A) / in), see the module docstring;
    ema: weight of the old statistic in update() and fold(); sqrt, statistic: module docstring."""

    SQUARE_ROOTS = ("isotropic", "diagonal")

    def __init__(
        self,
        in_features,
        rank=32,
        damping=0.1,
        ema=0.9,
        sqrt="isotropic",
        statistic="sketch",
        oversampling=OVERSAMPLING,
        seed=0,
    ):
        if sqrt not in self.SQUARE_ROOTS:
            raise ValueError(
                f"InputWhitening: unknown sqrt {sqrt!r}; expected one of {self.SQUARE_ROOTS}"
            )
        if statistic != "sketch" and not isinstance(statistic, EmaStatistic):
            raise ValueError(
                f"InputWhitening: statistic must be 'sketch' or an EmaStatistic, got {statistic!r}"
            )
        if not 0 <= ema < 1:
            raise ValueError(f"InputWhitening: ema must be in [0, 1), got {ema!r}")
        if damping <= 0:
            raise ValueError(f"InputWhitening: damping must be positive, got {damping!r}")
        if oversampling < 0:
            raise ValueError(f"InputWhitening: oversampling must be >= 0, got {oversampling!r}")
        self.in_features, self.rank = int(in_features), min(int(rank), int(in_features))
        self.damping, self.ema, self.sqrt = float(damping), float(ema), sqrt
        if statistic == "sketch":
            columns = min(self.rank + int(oversampling), self.in_features)
            self.statistic = NystromSketch(self.in_features, columns, seed)
        elif statistic.in_features != self.in_features:
            raise ValueError(
                f"InputWhitening: the statistic has {statistic.in_features} features, "
                f"expected {self.in_features}"
            )
        else:
            self.statistic = statistic
        self.factors = None  # identity until the first fold with refresh

    # ---------------------------------------------------------------- statistics
    def update(self, activations):
        """Fold a (tokens, in_features) batch (any leading dims) into the EMA of A = E[x x^T] and
        recompute the factors."""
        x = activations.detach().reshape(-1, activations.shape[-1])
        if x.shape[1] != self.in_features:
            raise ValueError(
                f"InputWhitening.update: activations have {x.shape[1]} features, "
                f"expected {self.in_features}"
            )
        sums = torch.zeros(self.statistic.numel, dtype=self.statistic.dtype, device=x.device)
        self.statistic.accumulate(x.to(self.statistic.dtype), sums)
        self.fold(sums.div_(max(1, x.shape[0])))

    def fold(self, mean, refresh=True):
        """Blend a batch statistic (the statistic's accumulate() over the batch's tokens, e.g.
        averaged over ranks) into the EMA; recompute the factors unless told not to (another rank
        computes them and broadcasts them: see compute_factors and factors_to_tensor)."""
        self.statistic.fold(mean, self.ema)
        if refresh:
            self.factors = self.compute_factors()

    @property
    def trace(self):
        """tr(A) in fp64 (exact for the sketch too: it keeps diag(A)); None before any statistic."""
        return None if self.statistic.state is None else self.statistic.trace

    def factor_numel(self):
        return self.in_features * (self.rank + 1) + 2 * self.rank

    def factors_to_tensor(self, factors=None):
        """The low-rank factors (given, or the current ones) as one flat fp32 tensor."""
        f = self.factors if factors is None else factors
        return torch.cat([f["d_sqrt"], f["p"].reshape(-1), f["c_minus"], f["c_plus"]])

    def factors_from_tensor(self, flat):
        n, r = self.in_features, self.rank
        d_sqrt, p, c_minus, c_plus = torch.split(flat.to(torch.float32), [n, n * r, r, r])
        return {
            "d_sqrt": d_sqrt.clone(),
            "p": p.reshape(n, r).clone(),
            "c_minus": c_minus.clone(),
            "c_plus": c_plus.clone(),
        }

    def compute_factors(self):
        """The factors of the current statistic (module docstring): fp64 math, fp32 result."""
        lam, vec, diagonal = self.statistic.eigenpairs(self.rank)
        trace = float(diagonal.sum())
        # all-zero inputs (A = 0) have no scale to damp relative to: the map is the identity
        delta = self.damping * trace / self.in_features if trace > 0 else 1.0
        return self._factors(lam, vec, diagonal, trace, delta)

    def _factors(self, lam, vec, diagonal, trace, delta):
        """The factors of the root from A's top eigenpairs, its diagonal, trace and damping."""
        if self.sqrt == "isotropic":
            rest = self.in_features - lam.numel()
            sigma = max(trace - float(lam.sum()), 0.0) / rest if rest else 0.0
            s = sigma + delta
            return {
                "d_sqrt": torch.full_like(diagonal, s**0.5).float(),
                "p": vec.float(),
                "c_minus": ((s / (lam + delta)).sqrt() - 1).float(),
                "c_plus": (((lam + delta) / s).sqrt() - 1).float(),
            }
        d = diagonal_remainder(lam, vec, diagonal, delta)
        v = vec / d.sqrt()[:, None]
        q, r = torch.linalg.qr(v)
        sig, w = torch.linalg.eigh((r * lam) @ r.t())
        sig = sig.clamp_min(0)
        return {
            "d_sqrt": d.sqrt().float(),
            "p": (q @ w).float(),
            "c_minus": ((1 + sig).rsqrt() - 1).float(),
            "c_plus": ((1 + sig).sqrt() - 1).float(),
        }

    # ---------------------------------------------------------------- the map
    def _check(self, g, what):
        if g.dim() != 2 or g.shape[1] != self.in_features:
            raise ValueError(
                f"InputWhitening.{what}: expected a (out, {self.in_features}) tensor, "
                f"got {tuple(g.shape)}"
            )

    def forward(self, g, factors=None, out=None):
        """u = G S^{-T} (with the given factors, or the current ones); into out (fp32, g's shape,
        g itself allowed) if given."""
        return self._map(g, factors, out, "forward")

    def inverse(self, u, factors=None, out=None):
        """G = u S^T (with the given factors, or the current ones); into out as in forward."""
        return self._map(u, factors, out, "inverse")

    def _map(self, g, factors, out, what):
        self._check(g, what)
        f = self.factors if factors is None else factors
        if out is not None and (out.shape != g.shape or out.dtype != torch.float32):
            raise ValueError(
                f"InputWhitening.{what}: out must be float32 of shape {tuple(g.shape)}, "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        if not f:  # None or IDENTITY_FACTORS: no statistic yet
            return g.clone() if out is None else out.copy_(g)
        result = self._apply(g, f, what == "inverse", out)
        return result if out is not None else result.to(g.dtype)

    def _apply(self, g, f, inverse, out):
        """The map with factors f, into out if given (fp32)."""
        return _lowrank_map(g, f, inverse=inverse, out=out)

    def whiten_activations(self, x):
        """S^{-1} x for each row x of a (tokens, in_features) batch: covariance ~ I after
        whitening."""
        return self.forward(x)

    def state_dict(self):
        """Copies on the host: the EMA updates the live tensors in place, and a checkpoint of a
        model on the GPU must not pin GPU memory (or, gathered, land on other ranks' GPUs)."""
        factors = (
            None
            if self.factors is None
            else {k: v.to("cpu", copy=True) for k, v in self.factors.items()}
        )
        statistic = self.statistic.state
        return {
            "statistic": None if statistic is None else statistic.to("cpu", copy=True),
            "factors": factors,
        }

    def load_state_dict(self, state, device="cpu"):
        """Restores the factors as saved (not recomputed), so a resumed run continues bit for
        bit; copies on `device` (the layer's)."""
        statistic, factors = state["statistic"], state["factors"]
        self.statistic.state = None if statistic is None else statistic.to(device, copy=True)
        self.factors = (
            None if factors is None else {k: v.to(device, copy=True) for k, v in factors.items()}
        )


def diagonal_remainder(lam, vec, diagonal, delta):
    """D = max(diag(A - U_r Lam_r U_r^T), 0) + delta: the diagonal of what the top eigenpairs
    leave, damped."""
    return (diagonal - (vec * vec) @ lam).clamp_min(0) + delta


# On CPU the low-rank map runs on blocks of whole rows of about this many elements: each block's
# three passes stay in L2 (forward + inverse of 1024 x 256 ... 1024 x 4096: about 2x faster).
ROW_BLOCK_ELEMENTS = 1 << 18


def _lowrank_map(g, f, inverse, out=None):
    """forward: G D^{-1/2} (I + P diag(c-) P^T);  inverse: G (I + P diag(c+) P^T) D^{1/2}. Into
    out (fp32; g itself is fine: each block of rows is read whole, by its first op, before it is
    written)."""
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device) if out is None else out
    rows = max(1, g.shape[0] if g.is_cuda else ROW_BLOCK_ELEMENTS // max(1, g.shape[1]))
    for start in range(0, g.shape[0], rows):
        x, y = g[start : start + rows].to(torch.float32), out[start : start + rows]
        if inverse:
            torch.addmm(x, (x @ f["p"]) * f["c_plus"], f["p"].t(), out=y).mul_(f["d_sqrt"])
        else:
            torch.div(x, f["d_sqrt"], out=y).addmm_((y @ f["p"]) * f["c_minus"], f["p"].t())
    return out
