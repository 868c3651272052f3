"""Arguments the graphs read in place: graph_opt.mark_static_address(tensor).

By default every tensor argument is copied into a static buffer the plugin owns before each replay,
and an argument the forward writes in place is copied back after it. For a tensor the caller passes
at every call anyway (a KV cache, a rope table) those copies are pure cost: a 5-D KV cache is copied
in and out at every decode step. A marked tensor is instead read and written where it is: the graphs
are captured on it, and a replay copies nothing for it. A call that passes another tensor there (not
the same memory, shape, strides and dtype) runs without graphs, with one warning: the graphs would
read the marked one.

A marked tensor has no batch dimension (the same tensor serves every batch size): dim 0 is not taken
as its batch dimension, and dynamic_arg_dims may not name one for it. torch's own marker,
torch._dynamo.mark_static_address (transformers' StaticCache sets it), means the same and is honoured.
Capturing a size runs the forward on the marked tensor itself (warmups, the capture, its check): its
contents are saved first and put back after, which costs one copy of it for the length of the capture.
A replay that raises after it may have written a marked argument is not answered by running the forward
again (it would write twice): the call raises (GraphRunner.replay_raised).

Also here: whether two tensors are the same memory, and whether byte spans overlap.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

MARK = "_graph_opt_static_address"


def mark_static_address(tensor):
    """Mark `tensor` (a torch.Tensor or paddle.Tensor argument of a decorated forward) to be read in place
    by the graphs instead of copied into a static buffer; pass this very tensor at every call. Returns it."""
    if not (hasattr(tensor, "data_ptr") and hasattr(tensor, "shape") and hasattr(tensor, "dtype")):
        raise TypeError(f"graph_opt.mark_static_address takes a torch.Tensor or paddle.Tensor; got "
                        f"{type(tensor).__name__}")
    try:
        setattr(tensor, MARK, True)
    except AttributeError:
        raise TypeError(f"graph_opt.mark_static_address takes a torch.Tensor or paddle.Tensor; got "
                        f"{type(tensor).__name__}, which cannot be marked") from None
    return tensor


def same_memory(adapter, a, b) -> bool:
    """Whether a reads exactly what b does: the same address, shape, strides and dtype."""
    return (adapter.data_ptr(a) == adapter.data_ptr(b) and adapter.shape(a) == adapter.shape(b)
            and adapter.stride(a) == adapter.stride(b) and adapter.dtype(a) == adapter.dtype(b))


def saved(adapter, leaves: List[Any], indices) -> List[Tuple[Any, Any]]:
    """(tensor, a copy of it) for the leaves at `indices`: what restore() puts back."""
    return [(leaves[i], adapter.clone(leaves[i])) for i in sorted(indices)]


def restore(adapter, kept: List[Tuple[Any, Any]]) -> None:
    for tensor, copy in kept:
        adapter.copy_(tensor, copy)


def overlaps(spans: Sequence[Tuple[int, int]], span: Tuple[int, int]) -> bool:
    """Whether `span`, (start, end) bytes, overlaps one of `spans`."""
    start, end = span
    for a, b in spans:
        if a < end and start < b:
            return True
    return False
