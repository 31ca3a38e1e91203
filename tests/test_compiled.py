"""The CPU fast path (torch.compile of the torch references) gives the same bits as eager torch."""
import pytest
import torch

from horovod_gift import formats


@pytest.fixture
def compiled_path(monkeypatch):
    monkeypatch.setattr(formats, "COMPILE", True)
    monkeypatch.setattr(formats, "COMPILE_MIN_ELEMENTS", 1 << 12)


@pytest.mark.parametrize("fmt,block,rotation", [("nvfp4", None, (128, 5)), ("fp8_e4m3", None, None),
                                                ("fp8_e5m2", 32, (16, 1))])
def test_compiled_equals_eager(compiled_path, fmt, block, rotation):
    n = 70_000 + 37                                      # a rotation tail and a partial block
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[:3] = torch.tensor([0.0, 1e-30, -5e3])
    results = []
    for use_compiled in (False, True):
        formats.COMPILE = use_compiled
        residual = torch.full((n,), 1e-3)
        codes, scales, tensor_scale = formats.quantize(x, fmt, block, residual=residual, rotation=rotation)
        decoded = formats.dequantize(codes, scales, tensor_scale, n, fmt, block)
        results.append([codes, scales.view(torch.uint8), residual, decoded])
    for name, eager, compiled in zip(("codes", "scales", "residual", "decoded"), *results):
        assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8)), f"{name} differ"
