"""The randomized Hadamard rotation, named by one object: HadamardRotation(block_size, seed).

    rotation = HadamardRotation(block_size=128, seed=0)
    u = rotation.forward(g)          # any shape; rotation.inverse(u) gives g back
    rotation.apply(flat, inverse=False, out=None)    # flat fp32 data, the codec's form

u = H D x / sqrt(B) on blocks of B = block_size elements of the flattened tensor, D the seeded
random signs (the same on every rank). Each span of 16 * B elements holds 16 interleaved blocks
(block j: elements j, j + 16, ...); what is left after the last span is rotated in contiguous
blocks, and a tail shorter than a block in smaller power-of-two blocks (kernels/hadamard.py says
why). CUDA tensors run the Triton kernel, CPU tensors the native one (config.py).
"""
import functools
from dataclasses import dataclass

import torch

from horovod_gift.kernels import native
from horovod_gift.kernels.hadamard import (
    hadamard_torch,
    hadamard_triton,
    random_signs_torch,
    segments,
)

from .backend import runs_native, runs_triton


@functools.lru_cache(maxsize=64)
def random_signs(seed, n, device):
    """The rotation's signs (int8), kept per size: every step rotates the same tensors, and the
    hash costs more than reading them back."""
    return random_signs_torch(seed, 0, n, device)


@dataclass(frozen=True)
class HadamardRotation:
    """Orthonormal randomized Hadamard rotation on blocks of `block_size` (a power of two) of the
    flattened tensor, with signs drawn from `seed` (module docstring)."""

    block_size: int = 128
    seed: int = 0

    def __post_init__(self):
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
            raise ValueError(f"HadamardRotation: block_size must be a power of two, got {b!r}")
        object.__setattr__(self, "seed", int(self.seed))

    def apply(self, flat, inverse=False, out=None):
        """The rotation (or its inverse) of flat fp32 data, into out (a new tensor if None;
        flat itself rotates it in place)."""
        if runs_triton(flat):
            return hadamard_triton(flat, self.block_size, self.seed, inverse, out)
        signs = random_signs(self.seed, flat.numel(), flat.device)
        if runs_native(flat):
            out = torch.empty_like(flat) if out is None else out
            pieces = segments(flat.numel(), self.block_size)
            return native.rotate_native(flat, pieces, signs, inverse, out)
        result = hadamard_torch(flat, self.block_size, self.seed, inverse, signs)
        return result if out is None else out.copy_(result)

    def apply_folded(self, flat, residual, ends, out):
        """Native CPU only: out <- apply(flat) + residual (fp32, flat's size) in the rotation's
        pass, and the largest magnitude_bits of out over each piece [ends[k - 1], ends[k]) (an
        np.int32 array; ends ascending, the last flat.numel()), for formats.quantize_folded."""
        if not runs_native(flat):
            raise ValueError(f"HadamardRotation.apply_folded: the native CPU kernels only, "
                             f"got a tensor on {flat.device}")
        signs = random_signs(self.seed, flat.numel(), flat.device)
        return native.rotate_fold_native(flat, segments(flat.numel(), self.block_size), signs,
                                         residual, ends, out)

    def _map(self, x, inverse):
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        return self.apply(flat, inverse).view(x.shape).to(x.dtype)

    def forward(self, x):
        return self._map(x, inverse=False)

    def inverse(self, u):
        return self._map(u, inverse=True)
