"""The dense input statistic A = E[x x^T] of a layer, for comparison with the library's Nystrom
sketch (horovod_gift/sketch.py): O(in^2) fp64 memory and an O(in^3) eigendecomposition, exact
eigenpairs. benchmarks/fidelity.py measures the sketch against it; tests use it as the exact
reference. Pass an instance as InputWhitening(in_features, statistic=DenseCovariance(in_features)).
"""
import torch

from horovod_gift.sketch import EmaStatistic


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
