"""What runs the pieces of a split Dynamo graph: one explicit state, and per-size graphs per piece.

The strategy sets GraphState before each call of the compiled forward (eager, warmup, capture or
replay, and the padded size's key); every piece reads it. Pieces trust the state they are given:
the strategy is the one place that decides.

Memory at piece boundaries, which would otherwise grow with every captured size:
- a tensor an eager piece hands to a capturable piece is fresh at every replay and is copied to
  where the graph reads. That landing place is one buffer per (piece, input), shared by all sizes;
- a tensor one graph writes and a later piece reads lives in the graph pool. Once a size is
  captured, the pieces keep only a non-owning alias of it (adapter.weak_alias), so its block returns to
  the pool and the next, smaller size reuses it: sizes never replay at the same time. This is
  vLLM's weak_ref_tensors. Outputs of the compiled forward itself stay owned: callers keep them.
"""
from __future__ import annotations

import contextlib
import enum
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ...errors import ReplayDivergence
from ...output_sharing import SharedOutputs
from ...pytree import flatten, unflatten
from ...testing import HostGraph


class Mode(enum.Enum):
    EAGER = "eager"  # no graphs: the pieces run as compiled
    WARMUP = "warmup"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class GraphState:
    """Shared by the strategy and every piece of every graph it compiled."""

    mode: Mode = Mode.EAGER
    key: Any = None  # the padded size (and call signature) being warmed, captured or replayed
    pool: Any = None
    simulate: bool = False
    forwards_run: List[Any] = field(default_factory=list)  # CompiledForwards entered while capturing
    fresh: set = field(default_factory=set)  # ids of tensors eager pieces made during this capture
    share_key: Any = None  # capture: a larger size whose owned outputs this size's outputs go into
    padded: int = 0

    def begin(self, mode: Mode, key: Any = None, pool: Any = None, simulate: bool = False,
              share_key: Any = None, padded: int = 0) -> None:
        self.mode, self.key, self.pool, self.simulate = mode, key, pool, simulate
        self.share_key, self.padded = share_key, padded
        self.forwards_run.clear()
        self.fresh.clear()

    def end(self) -> None:
        self.mode, self.key, self.pool, self.share_key = Mode.EAGER, None, None, None
        self.fresh.clear()


@dataclass
class PieceGraph:
    """One capturable piece captured at one padded size."""

    graph: Any  # a TorchGraph, or a HostGraph when simulating
    inputs: List[Any]  # the objects the piece got at capture; the graph reads the tensors among them
    tensor_slots: List[int]  # positions of the tensors in inputs
    outputs: Any  # the piece's outputs at capture; replay writes these very tensors
    pick: Callable = None  # args -> the tensors at tensor_slots, as a tuple
    captured: tuple = ()  # inputs at tensor_slots
    owned: Optional[List[bool]] = None  # per output leaf, once weakened: still owned (a forward output)

    def __post_init__(self):
        self.refresh()

    def refresh(self) -> None:
        slots = self.tensor_slots
        if len(slots) > 1:
            self.pick = operator.itemgetter(*slots)
        elif slots:
            index = slots[0]
            self.pick = lambda args: (args[index],)  # itemgetter of one index returns no tuple
        else:
            self.pick = lambda args: ()
        self.captured = tuple(self.inputs[i] for i in slots)


class CapturablePiece:
    """A piece of the split graph that gets one graph per padded size."""

    def __init__(self, name: str, fn: Callable, state: GraphState, adapter):
        self.name = name
        self.fn = fn
        self.state = state
        self.adapter = adapter
        self.entries: Dict[Any, PieceGraph] = {}
        self.landing: Dict[int, torch.Tensor] = {}  # input position -> bytes shared by every size

    def __call__(self, *args):
        state = self.state
        if state.mode is Mode.REPLAY:
            entry = self.entries.get(state.key)
            if entry is None:
                raise ReplayDivergence(f"piece {self.name} has no graph for {state.key!r}")
            # Parameters, static inputs and earlier pieces' outputs are the captured objects themselves:
            # one C-level identity pass, and the per-slot loop only when some input is fresh.
            if not all(map(operator.is_, entry.pick(args), entry.captured)):
                self._copy_fresh(entry, args)
            entry.graph.replay()
            return entry.outputs
        if state.mode is Mode.CAPTURE:
            return self._capture(args)
        return self.fn(*args)

    def _copy_fresh(self, entry: PieceGraph, args) -> None:
        captured = entry.inputs
        for i in entry.tensor_slots:
            src = args[i]
            dst = captured[i]
            if src is not dst:
                # A fresh tensor from an eager piece (or a splitting op): copy it where the graph reads.
                if src.shape != dst.shape:
                    raise ReplayDivergence(f"piece {self.name}: input {i} has shape {tuple(src.shape)}, "
                                           f"captured {tuple(dst.shape)}")
                dst.copy_(src)

    def _capture(self, args):
        state = self.state
        inputs = list(args)
        slots = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        for i in slots:
            if id(inputs[i]) in state.fresh:
                inputs[i] = self._land(i, inputs[i])
        share = self._sharing()
        if state.simulate:
            outputs = self.fn(*inputs)
            if share is not None:
                outputs = share.redirect(outputs)  # the stand-in copies each replay's values there
            fn = self.fn
            graph = HostGraph(self.adapter, lambda: fn(*inputs), flatten(outputs, self.adapter.is_tensor)[0])
        else:
            graph = self.adapter.new_graph(state.pool)
            graph.capture_begin()
            try:
                outputs = self.fn(*inputs)
                if share is not None:
                    kept = share.redirect(outputs)
                    share.copy(outputs, kept)
                    outputs = kept  # this size's own output blocks are free once the capture ends
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                with contextlib.suppress(Exception):
                    graph.reset()
                raise
            graph.capture_end()
        self.entries[state.key] = PieceGraph(graph, inputs, slots, outputs)
        return outputs

    def _sharing(self) -> Optional[SharedOutputs]:
        """Outputs of this piece that a larger size kept owned (the forward's outputs) take this size's
        outputs into their first rows (graph_opt/output_sharing.py)."""
        state = self.state
        larger = self.entries.get(state.share_key) if state.share_key is not None else None
        if larger is None or larger.owned is None or not any(larger.owned):
            return None
        return SharedOutputs(self.adapter, larger.outputs, state.padded, larger.owned)

    def _land(self, index: int, fresh: torch.Tensor) -> torch.Tensor:
        """A view with fresh's shape and strides over this input's landing buffer, holding fresh's values.

        Called before capture_begin: the buffer comes from the ordinary allocator, not the graph pool,
        and the copy is not part of the graph (at replay, the runner copies before replaying).
        """
        if any(st == 0 and n > 1 for st, n in zip(fresh.stride(), fresh.shape)):
            return fresh  # broadcast memory cannot be copied into; keep this one for its size
        span = 1 + sum((n - 1) * st for n, st in zip(fresh.shape, fresh.stride())) if fresh.numel() else 0
        nbytes = -(-span * fresh.element_size() // 16) * 16
        buffer = self.landing.get(index)
        if buffer is None or buffer.device != fresh.device or buffer.numel() < nbytes:
            # Largest size first, so this happens once; a larger lazy capture gets a new buffer and
            # the graphs of earlier sizes keep theirs alive through their views.
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=fresh.device)
            self.landing[index] = buffer
        view = buffer[:nbytes].view(fresh.dtype).as_strided(fresh.shape, fresh.stride())
        view.copy_(fresh)
        return view

    def output_ids(self, key) -> set:
        entry = self.entries.get(key)
        return set() if entry is None else {id(t) for t in flatten(entry.outputs, self.adapter.is_tensor)[0]}

    def weaken(self, key, aliases: Dict[int, torch.Tensor], keep: set) -> None:
        """Hold this size's graph-written tensors through non-owning aliases, except those in `keep`.

        `aliases` maps id(tensor) -> alias across all pieces of the forward, so a piece's input stays
        the very object the previous piece returns and replays still skip the copy.
        """
        entry = self.entries.get(key)
        if entry is None:
            return
        leaves, spec = flatten(entry.outputs, self.adapter.is_tensor)
        entry.owned = [id(t) in keep for t in leaves]
        for t in leaves:
            if id(t) not in keep and id(t) not in aliases:
                aliases[id(t)] = self.adapter.weak_alias(t)
        entry.outputs = unflatten(spec, [aliases.get(id(t), t) for t in leaves])
        entry.inputs = [aliases.get(id(a), a) for a in entry.inputs]
        entry.refresh()

    def release(self, key=None) -> None:
        keys = list(self.entries) if key is None else [key]
        for k in keys:
            entry = self.entries.pop(k, None)
            if entry is not None:
                entry.graph.reset()


class EagerPiece:
    """A piece that never gets a graph (splitting ops, host ops). While capturing it notes what it
    returns, so that the capturable piece reading it knows the tensor is fresh at every replay."""

    def __init__(self, fn: Callable, state: GraphState):
        self.fn = fn
        self.state = state

    def __call__(self, *args):
        out = self.fn(*args)
        if self.state.mode is Mode.CAPTURE:
            self.state.fresh.update(id(t) for t in flatten(out, _is_tensor)[0])
        return out


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class CompiledForward:
    """What the Dynamo backend returns for one FX graph: its split module, run piece by piece."""

    def __init__(self, split, pieces: List[CapturablePiece], state: GraphState):
        self.split = split  # fx_split.SplitGraph
        self.pieces = pieces
        self.state = state
        self._forward = split.module.forward
        self.captured_outputs: Dict[Any, set] = {}  # key -> ids of what the forward returned at capture
        self.captured_args: Dict[Any, tuple] = {}  # key -> the inputs the transformed code gathered at capture

    def __call__(self, *args):
        if self.state.mode is not Mode.CAPTURE:
            return self._forward(*args)
        self.state.forwards_run.append(self)
        self.captured_args[self.state.key] = args
        out = self._forward(*args)
        self.captured_outputs[self.state.key] = {id(t) for t in flatten(out, _is_tensor)[0]}
        return out

    def weaken(self, key) -> None:
        """After a size is captured: its intermediate graph tensors go back to the pool (see the module doc)."""
        aliases: Dict[int, torch.Tensor] = {}
        keep = self.captured_outputs.pop(key, set())
        for piece in self.pieces:
            piece.weaken(key, aliases, keep)

    def output_ids(self, key) -> set:
        ids = set()
        for piece in self.pieces:
            ids |= piece.output_ids(key)
        return ids

    def release(self, key=None) -> None:
        for piece in self.pieces:
            piece.release(key)
        if key is None:
            self.captured_args.clear()
        else:
            self.captured_args.pop(key, None)
