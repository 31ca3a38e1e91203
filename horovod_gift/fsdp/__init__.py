"""The FSDP2 frontend: GIFT as FSDP2's reduce-scatter (reduce_scatter.py: attach, the module
docstring tells how it works), the state and the reduction of its rows under each topology of
reduce/topology.py (state.py), the 8-bit parameter all-gather (allgather.py) and the private
FSDP2 attributes GIFT reads (internals.py).

    from horovod_gift.fsdp import attach
    state = attach(model, format="nvfp4")
"""
from .state import FsdpGiftState, GroupLayout
from .reduce_scatter import GiftReduceScatter, attach

__all__ = ["attach", "GiftReduceScatter", "FsdpGiftState", "GroupLayout"]
