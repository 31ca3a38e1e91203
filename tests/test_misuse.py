"""Misuse that needs no second process: clear errors."""
import pytest
import torch

import horovod_gift as gift


def test_gift_before_hvd_init():
    import horovod.torch as hvd
    assert not hvd.is_initialized()
    with pytest.raises(RuntimeError, match=r"call hvd.init\(\) before creating GIFT"):
        gift.GIFT(torch.nn.Linear(4, 4))


def test_codec_names():
    with pytest.raises(ValueError, match="unknown format"):
        gift.encode(torch.ones(3), format="int8")
    with pytest.raises(ValueError, match="unknown sqrt"):
        gift.InputWhitening(4, sqrt="qr")
    with pytest.raises(ValueError, match="unknown sqrt"):     # a comparison root, not the library's
        gift.InputWhitening(4, sqrt="cholesky")
    with pytest.raises(ValueError, match="statistic must be 'sketch' or an EmaStatistic"):
        gift.InputWhitening(4, statistic="dense")


def test_rotation_is_a_hadamard_rotation():
    from horovod_gift.codec import formats
    with pytest.raises(TypeError, match="rotation must be a HadamardRotation or None, got tuple"):
        formats.quantize(torch.ones(64), "nvfp4", rotation=(16, 0))
    with pytest.raises(ValueError, match="block_size must be a power of two, got 12"):
        gift.HadamardRotation(12)
