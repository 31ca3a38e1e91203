"""The arithmetic of GIFT's FSDP layouts (fsdp.state.GroupLayout) in one process: where each
parameter's shard lies in FSDP's rows and in the bytes GIFT sends, for the one-hop (every row),
two-hop (N rows a rank) and HSDP (one row) reductions of fsdp/state.py."""
import numpy as np
import pytest
import torch

from horovod_gift.codec.tensor_codec import Codec
from horovod_gift.fsdp.state import GroupLayout

SHARDS = [96 * 32, 96, 32 * 96, 32, 64, 2048]         # a group's padded shards, FSDP's order
SMALL = [False, True, False, True, True, False]       # under min_elements: fp32 on the wire


@pytest.mark.parametrize("format", ["nvfp4", "int3", "fp8_e4m3"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_rows_round_trip_through_the_bytes_of_every_piece(format, rows):
    codec = Codec(format, 32 if format.startswith("fp8") else None, "nearest", 0)
    layout = GroupLayout([str(i) for i in range(len(SHARDS))], SHARDS, SMALL, rows, codec)
    assert layout.shard == sum(SHARDS)
    assert layout.offsets == np.cumsum([0] + SHARDS[:-1]).tolist()
    # a payload for every coded piece of every row, fp32 for the small ones, 4-byte aligned
    coded = sum(codec.payload_bytes(m) for m, s in zip(SHARDS, SMALL) if not s)
    assert layout.row_bytes >= coded + 4 * sum(m for m, s in zip(SHARDS, SMALL) if s)
    assert all(offset % 4 == 0 for offset in layout.byte_offsets)
    assert len(layout.pieces.starts) == rows * SMALL.count(False)
    g = torch.Generator().manual_seed(rows)
    values = torch.randn(rows * layout.shard, generator=g)
    sent = torch.zeros(rows * layout.row_bytes, dtype=torch.uint8)
    codec.encode_pieces(values, None, layout.pieces, sent, 0)
    decoded = torch.full_like(values, float("nan"))
    codec.decode_pieces(sent, layout.pieces, decoded)
    value_rows, decoded_rows = values.view(rows, -1), decoded.view(rows, -1)
    for i, (m, tiny) in enumerate(zip(SHARDS, SMALL)):
        mine, back = layout.columns(value_rows, i), layout.columns(decoded_rows, i)
        assert mine.shape == (rows, m)
        if tiny:            # not a codec piece: decode leaves it alone
            assert torch.isnan(back).all()
            continue
        for r in range(rows):  # each piece is the codec's round trip of that row's shard alone
            alone = codec.decode(codec.encode(mine[r].contiguous()), m)
            assert torch.equal(back[r], alone), (i, r)
    byte_rows = sent.view(rows, -1)
    assert layout.columns(byte_rows, 1, 4 * SHARDS[1]).shape == (rows, 4 * SHARDS[1])
