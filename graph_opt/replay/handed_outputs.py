"""Outputs handed to a caller: tensor objects of their own, which keep their values after later replays.

A replay writes its outputs into the graphs' memory, and every later replay of the model writes there
again: each size's outputs, and the smaller sizes' in the largest size's (output_sharing.py). Eager gives
each call new tensors. So a replay hands out new tensor objects over that memory (adapter.alias), held
weakly here; before the model's next replay, each one a caller still holds gets its values copied to
memory of its own (adapter.keep_values). `a = block(x); b = block(y); a + b` is then eager's answer, and
so is an output kept across decode steps.

Costs: per call, one alias and one weak reference per output tensor; at the next call, a device copy per
output tensor still held. A loop written `out = model(x)` still holds the previous `out` while the next
call runs, and pays that copy; `del out` before the call, or keep_outputs: false (outputs valid only
until the next call, as vLLM's and FastDeploy's are), does not.

Every tensor output is a new object per call, as eager's are. Only those in memory a replay writes are
kept: a view of a parameter, a buffer or a marked argument is the caller's or the model's memory, which it
goes on showing, as eager's view would; a parameter or buffer returned itself is that tensor.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .static_address import overlaps
from ..pytree import shallow_copier


class HandedOutputs:
    """The outputs of one model's replays that a caller may still hold (see the module doc)."""

    __slots__ = ("adapter", "held", "model_tensors", "enabled")

    def __init__(self, adapter, enabled: bool, model_tensors: Callable[[], Sequence[Any]]):
        self.adapter = adapter
        self.enabled = enabled
        self.held: List[Any] = []  # weak references to the last replay's outputs in the graphs' memory
        self.model_tensors = model_tensors  # the model's parameters and buffers, now

    def keep(self) -> None:
        """Before a replay: the outputs of earlier ones that a caller still holds keep their values."""
        held = self.held
        if held:
            keep_values = self.adapter.keep_values
            for ref in held:
                t = ref()
                if t is not None:
                    keep_values(t)
            held.clear()

    def model_spans(self) -> List[Tuple[int, int]]:
        """(start, end) bytes of the model's parameters and buffers: outputs there are the model's own."""
        extent = self.adapter.extent
        return [extent(t) for t in self.model_tensors()]

    def copier(self, output, written: Optional[Sequence[Tuple[int, int]]],
               as_is: frozenset = frozenset()) -> Optional[Callable[[], Any]]:
        """A function returning `output` (a size's stored outputs, cut) as a call hands it out: its
        containers new (pytree.shallow_copier) and, when enabled, each tensor a new alias, as eager's
        outputs are new objects (a caller's in-place `unsqueeze_` must not reach the next call's). Those in
        `written` memory (where the replay writes) are recorded for keep(). A tensor that is one of the
        model's parameters or buffers itself is handed out as it is, and one that appears twice gets one
        alias per call (`return y, y`: both the same object, as in eager). `written` None: every tensor may
        be the graphs' memory. `as_is`: ids of tensors handed out as they are (the caller's own). None:
        nothing to make anew."""
        if not self.enabled:
            return shallow_copier(output)
        adapter = self.adapter
        alias, ref = adapter.alias, weakref.ref
        append = self.held.append
        own = {id(t) for t in self.model_tensors()}
        # The same tensor in two places may be stored as two views of one memory (output_sharing.py makes
        # one per place): one alias per (address, shape, strides, dtype).
        cells = {}  # that key -> [weak reference to this call's alias]

        def fresh(leaf):
            if not adapter.is_tensor(leaf) or id(leaf) in own or id(leaf) in as_is:
                return None
            key = (adapter.data_ptr(leaf), tuple(adapter.shape(leaf)), tuple(adapter.stride(leaf)), adapter.dtype(leaf))
            cell = cells.get(key)
            if cell is not None:  # again in this output: the alias made at its first place, this call
                return lambda: cell[0]()
            cell = cells[key] = [None]
            tracked = written is None or overlaps(written, adapter.extent(leaf))

            def handed():
                t = alias(leaf)
                cell[0] = held_ref = ref(t)  # weak: it must not keep the alias alive for keep()
                if tracked:
                    append(held_ref)
                return t

            return handed

        return shallow_copier(output, fresh)

    def hand_out(self, output, written: Optional[Sequence[Tuple[int, int]]], as_is: frozenset = frozenset()):
        """`output` as copier() would hand it out, for outputs a replay returns anew (not stable)."""
        if not self.enabled:
            return output
        made = self.copier(output, written, as_is)
        return output if made is None else made()

    def release(self) -> None:
        self.held.clear()
