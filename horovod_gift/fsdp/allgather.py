"""FSDP2's parameter all-gather in 8 bits (attach(model, param_format="fp8_e4m3")): each rank
sends its shard as FP8 with block scales, every rank decodes all of them into the unsharded
parameters. The sharded fp32 parameters (the optimizer's master copy) are never rounded: only
what forward and backward compute with is, and it is the same on every rank, own shard included
(it is decoded from the same bytes). Parameters under min_elements (norms, biases) travel in
fp32, as GIFT's small gradients do. As ZeRO++'s qwZ, whose users report losses that drift with
quantized weights: benchmarks/results/fsdp_cluster.md measures the held-out loss it costs.

Under 1-D FSDP the all-gathers cross the nodes twice a step (forward, and backward after
resharding); `fully_shard(..., reshard_after_forward=<ranks a node>)` keeps the backward one in
the node (ZeRO++'s hpZ) for (ranks a node) / (ranks) more memory a rank. Under HSDP they stay in
the node already.
"""
import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ..codec.tensor_codec import Codec
from ..torch_comm import ALL_GATHER
from .internals import all_fsdp_params, param_group
from .state import GroupLayout


class QuantizedAllGather(AllGather):
    """The all-gather of one fully_shard module's parameters in `format`; falls back to FSDP's
    own (with a count in telemetry) where the input is not fp32 parameters laid out as FSDP's
    plain copy-in lays them (a MixedPrecisionPolicy's param_dtype, tensor subclasses)."""

    def __init__(self, module, format, min_elements, telemetry):
        params = all_fsdp_params(param_group(module))
        self.names = [str(i) for i in range(len(params))]
        self.shards = [shard for _, shard in params]
        self.small = [param.numel() < min_elements for param, _ in params]
        self.codec = Codec(format, None, "nearest", 0)
        self.telemetry = telemetry
        self.layouts = {}       # ranks -> (layout of this rank's row, of every rank's rows)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if input_tensor.dtype != torch.float32 or sum(self.shards) != input_tensor.numel():
            self.telemetry.add(uncompressed_elements=input_tensor.numel())
            return ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)
        ranks = group.size()
        mine, every = self._layouts(ranks)
        send = torch.empty(mine.row_bytes, dtype=torch.uint8, device=input_tensor.device)
        if len(mine.pieces.starts):
            self.codec.encode_pieces(input_tensor, None, mine.pieces, send, 0)
        small = [i for i, is_small in enumerate(self.small) if is_small and self.shards[i]]
        for i in small:
            mine.columns(send.view(1, -1), i, 4 * self.shards[i]).view(torch.float32).copy_(
                mine.columns(input_tensor.view(1, -1), i))
        received = torch.empty(ranks * mine.row_bytes, dtype=torch.uint8, device=send.device)
        ALL_GATHER(received, send, group=group)
        rows = output_tensor.view(ranks, -1)
        if len(every.pieces.starts):
            self.codec.decode_pieces(received, every.pieces, output_tensor)
        for i in small:
            every.columns(rows, i).copy_(every.columns(received.view(ranks, -1), i,
                                                        4 * self.shards[i]).view(torch.float32))
        self.telemetry.add(param_bytes_sent=(ranks - 1) * mine.row_bytes)
        return None

    def _layouts(self, ranks):
        if ranks not in self.layouts:
            self.layouts[ranks] = tuple(
                GroupLayout(self.names, self.shards, self.small, n, self.codec)
                for n in (1, ranks))
        return self.layouts[ranks]


def use_quantized_all_gather(modules, param_format, min_elements, telemetry):
    """Set a QuantizedAllGather on every module (param_format None: leave FSDP's own)."""
    if param_format is None:
        return
    for module in modules:
        module.set_custom_all_gather(QuantizedAllGather(module, param_format, min_elements,
                                                        telemetry))


__all__ = ["QuantizedAllGather", "use_quantized_all_gather"]
