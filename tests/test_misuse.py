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
