"""What torch's DistributedDataParallel asks of a graphed block inside it (contracts.DataParallel)."""
from __future__ import annotations

import weakref

from ...contracts import DataParallel


def data_parallel(wrapper) -> DataParallel:
    """static_graph: DDP then refuses a replayed backward that hands an unused parameter an empty gradient.

    ready: DDP lays out its gradient buckets in the order of a backward it watched (its first synced one;
    with static_graph, a later one) and keeps that layout. A replayed backward hands every gradient at
    once, so a layout taken from one would make the all-reduce sum more than two ranks' values in another
    order than eager's: keys with a backward wait, eagerly, until DDP has laid out its buckets. With
    find_unused_parameters (and no static_graph) DDP never lays them out again: nothing to wait for."""
    static = getattr(wrapper, "static_graph", False) is True
    if not hasattr(wrapper, "_has_rebuilt_buckets") or \
            not static and getattr(wrapper, "find_unused_parameters", False):
        return DataParallel(static_graph=static)
    held = weakref.ref(wrapper)
    return DataParallel(static_graph=static, ready=lambda: getattr(held(), "_has_rebuilt_buckets", True))
