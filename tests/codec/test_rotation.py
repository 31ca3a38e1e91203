"""HadamardRotation (codec/rotation.py): exact inverse, orthonormal at awkward sizes, the block
interleave, seeds."""
import pytest
import torch

import horovod_gift as gift
from horovod_gift.kernels.hadamard import random_signs_torch


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(), (1,), (15,), (17,), (3, 37), (128,), (300, 129)])
def test_rotation_is_invertible_and_keeps_the_norm(backend, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    rotation = gift.HadamardRotation(block_size=128, seed=3)
    with gift.use_kernels(backend):
        u = rotation.forward(x)
        back = rotation.inverse(u)
    assert u.shape == x.shape and back.shape == x.shape
    assert torch.allclose(back, x, atol=1e-6, rtol=1e-5)
    assert torch.allclose(u.norm(), x.norm(), rtol=1e-5)


def test_rotation_is_orthonormal_matrix_at_awkward_sizes():
    for n in (1, 7, 37, 200):
        rotation = gift.HadamardRotation(block_size=16, seed=1)
        m = torch.stack([rotation.forward(e) for e in torch.eye(n)], dim=1).double()
        assert torch.allclose(m.t() @ m, torch.eye(n, dtype=torch.float64), atol=1e-6)
        if n >= 16:
            assert (m[:16, :16].abs() > 0.2).all(), "a 16-block is not mixed"


def sylvester(b):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotation_blocks_interleave_sixteen_to_a_span_then_run_contiguous(backend):
    """Block j of each 16 * 128-element span holds elements j, j + 16, ...; the remainder has
    contiguous blocks of 128, then powers of two. Checked against H D x worked out in fp64."""
    n = 2 * 2048 + 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    with gift.use_kernels(backend):
        u = gift.HadamardRotation(128, seed=2).forward(x).double()
    signs = random_signs_torch(2, 0, n, x.device).double()
    dx = x.double() * signs
    head = (
        torch.einsum("ik,skc->sic", sylvester(128), dx[:4096].view(2, 128, 16)).reshape(-1)
        / 128**0.5
    )
    assert torch.allclose(u[:4096], head, atol=1e-5)
    for start, b in ((4096, 128), (4224, 128), (4352, 32), (4384, 8), (4392, 4)):
        assert torch.allclose(
            u[start : start + b], sylvester(b) @ dx[start : start + b] / b**0.5, atol=1e-5
        ), (start, b)
    spike = torch.zeros(n)
    spike[2048 + 5] = 1.0
    spread = gift.HadamardRotation(128, seed=2).forward(spike)
    assert torch.equal(spread.nonzero().flatten(), torch.arange(2048 + 5, 4096, 16))


def test_rotation_depends_on_seed_and_spreads_a_spike():
    x = torch.zeros(256)
    x[5] = 1.0
    a = gift.HadamardRotation(128, seed=0).forward(x)
    y = torch.randn(256)
    assert not torch.equal(
        gift.HadamardRotation(128, seed=0).forward(y), gift.HadamardRotation(128, seed=1).forward(y)
    )
    assert torch.allclose(a[:128].abs(), torch.full((128,), 128**-0.5))
    with pytest.raises(ValueError, match="power of two"):
        gift.HadamardRotation(block_size=100)
