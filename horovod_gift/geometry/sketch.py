"""The statistic behind input whitening: A = E[x x^T] of an nn.Linear's inputs (an EMA over
batches), kept as a streaming Nystrom sketch (benchmarks/dense_whitening.py keeps the dense
matrix, for comparison).

Input whitening needs the top r eigenpairs of A and diag(A) (whitening.py). The dense A costs in^2
memory, an allreduce of in^2 numbers per refresh and an O(in^3) eigh: about 12 GB per rank at
Llama-1B shapes. A sketch of in x l numbers (l = r + oversampling) is enough; of three candidates,

- the randomized range finder (Halko, Martinsson, Tropp 2011) keeps Y = A Omega and takes
  Q = orth(Y), but the eigenvalues need Q^T A Q, a second pass over A; the batches that made the
  EMA are gone, so it needs a second sketch, or the one-pass estimate, which is less accurate;
- frequent directions (Liberty 2013) has deterministic bounds, but its shrinking step is not
  linear: the sketch of a sum is not the sum of the sketches, so neither the EMA nor Horovod's
  allreduce (a sum) can act on it, and merging ranks would take an allgather and an SVD;
- the Nystrom sketch (Tropp, Yurtsever, Udell, Cevher 2017) keeps Y = A Omega for a fixed Omega.
  Y is linear in A: ema * Y + (1 - ema) * Y_batch and the sum over ranks are exactly the sketches
  of the blended and of the rank-summed A, so the EMA and the allreduce work on Y directly. For
  PSD A its approximation A_nys = Y (Omega^T Y)^+ Y^T = A^{1/2} P A^{1/2}, with P the projector
  onto range(A^{1/2} Omega), is the range finder applied to A^{1/2}: the accuracy of one power
  iteration, from one pass. Chosen.

Per statistics step (X: tokens x in): Y_batch = X^T (X Omega) / tokens, O(tokens * in * l), and
diag_batch = (sum of x^2 over the tokens) / tokens, O(tokens * in). diag(A) gives the diagonal
remainder of the factorization, and its sum is tr(A). Both are kept in one flat fp32 tensor on
the activations' device, in * (l + 1) numbers: at l = 52, 0.41 MiB for in = 2048 and 1.7 MiB for
in = 8192, against 32 MiB and 512 MiB for the dense fp64 A. Omega (in x l, orthonormal columns:
the Q of a standard Gaussian matrix drawn from a seed with a CPU generator, the same on every
rank) is not part of the state: it is regenerated on demand and cached per shape and device, so
the layers of one width share one.

Factors (stable recipe of Tropp et al. 2017, in fp64): with the shift nu = sqrt(in) * eps_fp32 *
||Y||_F (just above the rounding error of the fp32 Y), Y_nu = Y + nu Omega,
C = chol(Omega^T Y_nu) (lower here, C C^T = Omega^T Y_nu), B = Y_nu C^{-T}, thin SVD B = U S V^T;
then B B^T = U S^2 U^T is the Nystrom approximation of A + nu I, and the top r of
(U, Lam = max(S^2 - nu, 0)) are returned, in O(in * l^2). If rounding still leaves
Omega^T Y_nu indefinite, nu grows tenfold and is retried.

Oversampling. The Nystrom error in the top directions is about the eigenvalue mass beyond l
divided by the oversampling, so the sketch underestimates the top eigenvalues, the more so the
heavier the tail: it whitens more softly than the dense statistic. On the gradients of
benchmarks/fidelity.py (rank 32, NVFP4 and FP8 E5M2, with and without the Hadamard rotation,
steps 10, 100, 300) the sketch's round-trip RelL2 against the dense statistic's is, at
oversampling 10 / 20 / 40: at most -14 % / -1 % / -7 % with the EMA statistic
(benchmarks/results/fidelity-sketch.md; softer whitening is better there, as whitening itself
hurts), and at most +6.1 % / +3.7 % / +4.2 % with the current batch's statistic, where whitening
helps most (fidelity-sketch-current-batch.md). 20 is the smallest of these within +5 % in both.
On a flat noise floor the whitened spectrum is flat only to a factor of a few
(tests/geometry/test_sketch.py); l = in_features makes the sketch exact.
"""
import functools
import math

import torch

OVERSAMPLING = 20       # l = rank + OVERSAMPLING columns (module docstring)
SHIFT_ATTEMPTS = 8      # nu, 10 nu, ..., 10^7 nu


@functools.lru_cache(maxsize=64)     # one per (input width, device): models have a few
def sketching_matrix(in_features, columns, seed, device):
    """Omega: in_features x columns, orthonormal columns (the Q of a standard Gaussian matrix drawn
    on the CPU from `seed`, so identical on every rank), fp32 on `device`. Orthonormal columns make
    Omega^T Omega = I, so the shift nu lifts every eigenvalue of Omega^T Y_nu by nu; with
    columns == in_features the sketch is exact. Shared: callers must not write into it."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    gaussian = torch.randn(in_features, columns, generator=generator, dtype=torch.float64,
                           device="cpu")
    return torch.linalg.qr(gaussian).Q.to(device=device, dtype=torch.float32)


class EmaStatistic:
    """A statistic linear in A, kept as one flat tensor `state` (None until the first fold)."""

    def fold(self, mean, ema):
        """state = ema * state + (1 - ema) * mean (mean: a batch's accumulate() over its tokens)."""
        if self.state is None:
            self.state = mean.to(self.dtype, copy=True)
        else:
            self.state.mul_(ema).add_(mean, alpha=1 - ema)

    @property
    def trace(self):
        return self.diagonal.sum(dtype=torch.float64)


class NystromSketch(EmaStatistic):
    """state = [Y = A Omega (in x l, row-major), diag(A)], fp32."""

    dtype = torch.float32

    def __init__(self, in_features, columns, seed=0):
        if not 0 < columns <= in_features:
            raise ValueError(f"NystromSketch: columns must be in [1, {in_features}], got {columns}")
        self.in_features, self.columns, self.seed = int(in_features), int(columns), int(seed)
        self.numel = self.in_features * (self.columns + 1)
        self.state = None

    def _split(self, flat):
        n = self.in_features
        return flat[:-n].view(n, self.columns), flat[-n:]

    def omega(self, device):
        return sketching_matrix(self.in_features, self.columns, self.seed, torch.device(device))

    def accumulate(self, x, into):
        """into (numel, fp32) += [X^T X Omega, sum over rows of x^2] for a (tokens, in) fp32 X."""
        y, diagonal = self._split(into)
        y.addmm_(x.t(), x @ self.omega(x.device))
        diagonal.add_(torch.linalg.vector_norm(x, dim=0).square_())

    @property
    def diagonal(self):
        return self._split(self.state)[1]

    def eigenpairs(self, rank):
        """(Lam, U, diag(A)) in fp64: the top `rank` eigenpairs of A's Nystrom approximation."""
        omega = self.omega(self.state.device).double()
        y, diagonal = (t.double() for t in self._split(self.state))
        rounding = torch.finfo(self.dtype).eps * float(torch.linalg.matrix_norm(y))
        # All-zero inputs (A = 0) still need a positive shift for the Cholesky.
        shift = max(math.sqrt(self.in_features) * rounding, torch.finfo(torch.float64).tiny)
        for _ in range(SHIFT_ATTEMPTS):
            y_shifted = y + shift * omega
            core = omega.t() @ y_shifted
            chol, info = torch.linalg.cholesky_ex((core + core.t()) / 2)
            if int(info) == 0:
                break
            shift *= 10
        else:
            raise ValueError("NystromSketch: Omega^T Y is not positive definite at any shift: "
                             "the statistic is not finite")
        b = torch.linalg.solve_triangular(chol, y_shifted.t(), upper=False).t()
        u, s, _ = torch.linalg.svd(b, full_matrices=False)
        return (s[:rank].square() - shift).clamp_min(0), u[:, :rank], diagonal
