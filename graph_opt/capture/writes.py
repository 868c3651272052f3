"""What a run of the forward wrote in place: version counters that moved, and, for a write the counters
do not show (Paddle's copy_ and set_value, torch's .data), the values that changed against copies."""
from __future__ import annotations

from typing import Optional


def snapshot(adapter, tensors, skip=frozenset()) -> list:
    """Copies of the tensors (None for those in `skip`): a write that their version counters do not
    show (Paddle's copy_ and set_value, torch's .data) is found by the values it changed."""
    return [None if i in skip else adapter.clone(t) for i, t in enumerate(tensors)]


def buffer_snapshot(capturer) -> Optional[list]:
    """Copies of the model's buffers where the captured path may drop a write into one (level >= 1: Paddle's
    SOT drops `self.cache[:b].set_value(new)`), and that write may not move the buffer's version counter (a
    write through a view, Paddle's copy_ and set_value): it is found by the values it changed. Capture time
    only; None at level 0, whose graphs record the plain forward's writes."""
    if capturer.replays_graphs_alone():
        return None
    return snapshot(capturer.adapter, [t for _, t in capturer.model_state.buffers()])


def buffers_changed(capturer, copies: Optional[list]) -> set:
    """Names of the buffers whose values differ from their buffer_snapshot()."""
    if copies is None:
        return set()
    names, tensors = zip(*capturer.model_state.buffers()) if copies else ((), ())
    return {names[i] for i in changed(capturer.adapter, tensors, copies)}


def changed(adapter, tensors, copies) -> set:
    """Indices of the tensors whose values differ from their snapshot()."""
    return {i for i, (t, c) in enumerate(zip(tensors, copies)) if c is not None and not adapter.same_values(t, c)}


def written(before, after) -> set:
    """Names whose version counter moved between two buffer_versions() lists."""
    return {name for (name, v0), (_, v1) in zip(before, after) if v0 != v1}
