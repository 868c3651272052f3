"""What torch's DistributedDataParallel asks of a graphed block inside it (contracts.DataParallel)."""
from __future__ import annotations

import weakref

from ...contracts import DataParallel


def data_parallel(wrapper) -> DataParallel:
    """static_graph: DDP then refuses a replayed backward that hands an unused parameter an empty gradient
    (asked at each capture, as DDP._set_static_graph() may come after autocudagraph).

    ready: DDP lays out its gradient buckets in the order of a backward it watched (its first synced one;
    with static_graph, a later one) and keeps that layout. A replayed backward hands every gradient at
    once, so a layout taken from one would make the all-reduce sum more than two ranks' values in another
    order than eager's: keys with a backward wait, eagerly, until DDP has laid out its buckets. With
    find_unused_parameters (and no static_graph) DDP never lays them out again: nothing to wait for."""
    held = weakref.ref(wrapper)

    def static() -> bool:  # read when asked: DDP._set_static_graph() may turn it on after autocudagraph
        return getattr(held(), "static_graph", False) is True

    if not hasattr(wrapper, "_has_rebuilt_buckets"):
        return DataParallel(static_graph=static)

    def ready() -> bool:
        ddp = held()
        return ddp is None or getattr(ddp, "_has_rebuilt_buckets", True) or \
            not static() and getattr(ddp, "find_unused_parameters", False)

    return DataParallel(static_graph=static, ready=ready)
