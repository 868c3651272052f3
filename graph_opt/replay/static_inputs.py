"""The static input buffers of a signature: allocated once at the max size, the view each size's graph
reads, and a call's rows copied in (the padding rows hold the pad values, never an earlier call's data)."""
from __future__ import annotations

from typing import Any, List

from . import static_address
from ..errors import GraphOptInputError
from .padding import Padding
from .static_address import same_memory


def prepare(capturer, sig, padded: int, leaves) -> List[Any]:
    """The tensors a graph of size `padded` reads, holding `leaves` (their padding rows the pad values)."""
    adapter = capturer.adapter
    if not capturer.config.cudagraph_copy_inputs:
        return list(leaves)
    table = capturer.signatures
    if sig.buffers is None:
        # Allocated once at the max size; every size reads a view of them, so the addresses a
        # graph captured stay valid for as long as the runner lives. A marked argument is its own.
        sig.buffers = [
            t if i in sig.in_place else
            adapter.zeros_like(t, d, capturer.runner.max_size) if d is not None else adapter.zeros_like(t, None, 0)
            for i, (t, d) in enumerate(zip(leaves, sig.dims))
        ]
        values = [table.pad_values.get(name, 0) for name in table.owner_names(sig.spec)]
        sig.padding = Padding(adapter, sig.buffers, sig.dims, values)
    for i in sig.in_place:
        if leaves[i] is not sig.buffers[i] and not same_memory(adapter, leaves[i], sig.buffers[i]):
            raise GraphOptInputError(
                f"{capturer.name}: the inputs for size {padded} pass another tensor as argument "
                f"{table.leaf_names(sig.spec)[i]} than the sizes captured before, and it is marked with "
                "mark_static_address: the graphs read the one tensor in place. Pass the same tensor for "
                "every size")
    views = [b if d is None else adapter.narrow(b, d, padded) for b, d in zip(sig.buffers, sig.dims)]
    copy_in(adapter, sig, views, leaves, padded)
    return views


def copy_in(adapter, sig, views, leaves, padded: int) -> None:
    """Copy `leaves` into a size's static `views`; a marked argument's contents are put back instead."""
    real = padded
    for i, (dst, src, d) in enumerate(zip(views, leaves, sig.dims)):
        if d is None:
            if i not in sig.in_place:
                adapter.copy_(dst, src)
        else:
            real = adapter.shape(src)[d]
            adapter.copy_(adapter.narrow(dst, d, real), src)
    static_address.restore(adapter, sig.restore_point)
    if sig.padding is not None:
        sig.padding.wrote(real)
