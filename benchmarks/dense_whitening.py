"""Dense whitening, for comparison with the library's low-rank maps
(horovod_gift/geometry/whitening.py): not part of the library, since it costs O(in^2) memory and
O(out * in^2) time per layer.

- DenseCovariance: the dense input statistic A = E[x x^T] (fp64, exact eigenpairs), against
  the library's Nystrom sketch: InputWhitening(n, statistic=DenseCovariance(n)).
- DenseRootWhitening: input whitening with a dense root of A_hat = U_r Lam_r U_r^T + D (the
  "diagonal" approximation): sqrt="cholesky" (the paper's L = chol(A_hat)) or "symmetric"
  (A_hat^{1/2}); u = G S^{-T}, G = u S^T as two dense products.
- whitening(in_features, sqrt=..., ...): the class that has that root.
benchmarks/fidelity.py and codec.py compare with them; tests use them as exact references.
"""
import torch

from horovod_gift.geometry.sketch import EmaStatistic
from horovod_gift.geometry.whitening import InputWhitening, diagonal_remainder

DENSE_ROOTS = ("cholesky", "symmetric")


class DenseCovariance(EmaStatistic):
    """state = A (in x in, row-major), fp64: O(in^2) memory, O(in^3) eigh. For comparison only."""

    dtype = torch.float64

    def __init__(self, in_features):
        self.in_features = int(in_features)
        self.numel = self.in_features ** 2
        self.state = None

    def accumulate(self, x, into):
        """into (numel, fp64) += X^T X for a (tokens, in) fp64 X."""
        into.view(self.in_features, self.in_features).addmm_(x.t(), x)

    @property
    def diagonal(self):
        return self.state.view(self.in_features, self.in_features).diagonal()

    def eigenpairs(self, rank):
        a = self.state.view(self.in_features, self.in_features)
        lam, vec = torch.linalg.eigh(a)
        return lam[-rank:].clamp_min(0), vec[:, -rank:], a.diagonal()


class DenseRootWhitening(InputWhitening):
    SQUARE_ROOTS = DENSE_ROOTS

    def _factors(self, lam, vec, diagonal, trace, delta):
        d = diagonal_remainder(lam, vec, diagonal, delta)
        a_hat = (vec * lam) @ vec.t() + torch.diag(d)
        if self.sqrt == "cholesky":
            s = torch.linalg.cholesky(a_hat)
        else:
            e, u = torch.linalg.eigh(a_hat)
            s = (u * e.clamp_min(0).sqrt()) @ u.t()
        return {"s": s.float(), "s_inv": torch.linalg.inv(s).float()}

    def _apply(self, g, f, inverse, out):
        result = g.to(torch.float32) @ f["s" if inverse else "s_inv"].t()
        return result if out is None else out.copy_(result)


def whitening(in_features, sqrt="isotropic", **options):
    """InputWhitening, or DenseRootWhitening for a dense root."""
    kind = DenseRootWhitening if sqrt in DENSE_ROOTS else InputWhitening
    return kind(in_features, sqrt=sqrt, **options)
