"""Calls of one graphed block whose backwards are pending together (a GAN discriminator on real and fake
images in one loss): each slot is a set of graphs per key in a memory pool of its own, so a call made
while the backward of slot 0's replay is pending replays slot 1's graphs and leaves slot 0's activations
as that backward reads them. A slot past the first is captured only when such a call happens; calls
beyond SLOTS pending backwards run eagerly."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from ..watch.fallbacks import Reason

if TYPE_CHECKING:
    from .block import GraphedBlock
    from .graphs import KeyState

logger = logging.getLogger("graph_opt")

SLOTS = 2  # calls of one block whose backwards may be pending at once, each replaying its own graphs


class Slot:
    """One depth of pending backwards: its memory pool (all keys of the slot share it, as their calls
    never overlap), whether a replay's backward is pending in it, and its forward replays so far (a
    backward checks that none overwrote its activations)."""

    __slots__ = ("pool", "pending", "generation")

    def __init__(self):
        self.pool = None
        self.pending = 0
        self.generation = 0


def free_slot(block: GraphedBlock) -> Optional[int]:
    """The first slot with no pending backward (a new one where all are taken and fewer than SLOTS are
    made), or None."""
    slots = block.slots
    for i, slot in enumerate(slots):
        if not slot.pending:
            return i
    if len(slots) < SLOTS:
        slots.append(Slot())
        return len(slots) - 1
    return None


def call_in_slot(block: GraphedBlock, state: KeyState, leaves, spec, args, kwargs, needs_grad: bool):
    """Replay this key's graphs of the first free slot, captured there first where it has none yet."""
    slot = free_slot(block)
    if slot is None:
        return _beyond(block, args, kwargs)
    here = state.in_slot(slot)
    graphs = here.graphs
    if graphs is not None:
        watch = block.watch
        if watch is not None and watch.own_at and not watch.own_as_captured(here):
            return block._own_changed_call(here, args, kwargs)
        return block._replay(graphs, leaves, needs_grad)
    if here.failed is not None:
        return block._fallback(Reason.CAPTURE_FAILED, args, kwargs, None)
    block.slot_now = slot  # block.pool is this slot's while it captures
    try:
        graphs = block.capturer.capture(here, leaves, spec, args, kwargs, needs_grad=needs_grad)
    finally:
        block.slot_now = 0
    if graphs is None:
        return block._eager(block.call, args, kwargs)
    graphs.slot = slot
    return block._replay(graphs, leaves, needs_grad)


def _beyond(block: GraphedBlock, args, kwargs):
    if "backward_pending" not in block.warned:
        block.warned.add("backward_pending")
        logger.warning(_PENDING_WARNING.format(name=block.name, n=block.pending, slots=SLOTS, nth=_ORDINAL[SLOTS + 1]))
    return block._fallback(Reason.BACKWARD_PENDING, args, kwargs, None)


_ORDINAL = {2: "second", 3: "third", 4: "fourth", 5: "fifth"}

_PENDING_WARNING = (
    "{name}: called while the backwards of its {n} previous graphed calls have not run. {slots} calls of one "
    "block may await their backwards at once (each replays graphs of its own); a {nth} call would overwrite "
    "the activations one of them reads, so such calls (and any made while {slots} backwards are pending) run "
    "eagerly, counted in fallback_reasons['backward_pending']. Run a backward (or drop the outputs) before "
    "calling the block a {nth} time, or make the calls whose outputs need no gradient under no_grad (they "
    "leave no backward pending)")
