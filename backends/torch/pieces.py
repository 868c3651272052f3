"""What runs the pieces of a split Dynamo graph: one explicit state, and per-size graphs per piece.

The strategy sets GraphState before each call of the compiled forward (eager, warmup, capture or
replay, and the padded size's key); every piece reads it. Pieces trust the state they are given:
the strategy is the one place that decides.

Memory at piece boundaries, which would otherwise grow with every captured size:
- a tensor an eager piece hands to a capturable piece is fresh at every replay and is copied to
  where the graph reads. That landing place is one buffer per (piece, input), shared by all sizes;
- a tensor one graph writes and a later piece reads lives in the graph pool. From its piece's capture
  on, the pieces keep only a non-owning alias of it (adapter.weak_alias): the split module's own
  references decide when its block returns to the pool, as in eager, so later pieces of the same size
  and every smaller size reuse it (they replay after its last reader; sizes never replay at the same
  time). This is vLLM's weak_ref_tensors. Outputs of the compiled forward itself end up owned:
  callers keep them.
"""
from __future__ import annotations

import enum
import functools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...replay.static_address import overlaps
from ...errors import CaptureError, ReplayDivergence
from ...replay.output_sharing import SharedOutputs
from ...pytree import flatten, unflatten
from ...replay.static_address import same_memory
from .replay_plan import EagerCall, ReplayPlan, memory_of


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
    recorder: Any = None  # capture: the graphs that record the pieces (contracts.Recorder)
    forwards_run: List[Any] = field(default_factory=list)  # CompiledForwards entered while capturing
    share_key: Any = None  # capture: a larger size whose owned outputs this size's outputs go into
    padded: int = 0
    # capture: id(graph-written tensor) -> (weakref to it, its alias); id(alias) -> weakref to the tensor
    aliases: Dict[int, tuple] = field(default_factory=dict)
    strong_of: Dict[int, Any] = field(default_factory=dict)
    # capture: the pieces' calls in order, for CompiledForward's replay plan (kept past end(), as strong_of)
    calls: List[Any] = field(default_factory=list)
    made: Dict[int, tuple] = field(default_factory=dict)  # id(eager result) -> (weakref, EagerCall, leaf, in place)
    plannable: bool = True  # no eager piece reads another's result, and none returns a non-tensor
    adapter: Any = None  # the framework adapter: where a tensor's bytes are, whether two read the same

    def begin(self, mode: Mode, key: Any = None, pool: Any = None, recorder: Any = None,
              share_key: Any = None, padded: int = 0) -> None:
        self.mode, self.key, self.pool, self.recorder = mode, key, pool, recorder
        self.share_key, self.padded = share_key, padded
        self.forwards_run.clear()
        self.aliases.clear()
        self.strong_of.clear()  # kept past end(): CompiledForward.finish reads it
        self.calls.clear()
        self.made.clear()
        self.plannable = True

    def end(self) -> None:
        self.mode, self.key, self.pool, self.share_key, self.recorder = Mode.EAGER, None, None, None, None
        self.aliases.clear()

    def alias(self, t, adapter):
        """The non-owning alias of a tensor a graph of this capture wrote (one per tensor), or t itself."""
        known = self.known_alias(t)
        if known is not t:
            return known
        alias = adapter.weak_alias(t)
        if alias is not t:
            self.aliases[id(t)] = (weakref.ref(t), alias)
            self.strong_of[id(alias)] = weakref.ref(t)
        return alias

    def made_by_eager(self, t) -> Optional[tuple]:
        """(the EagerCall, leaf index, whether t is its argument's memory) that returned t in this
        capture, or None."""
        hit = self.made.get(id(t))
        return hit[1:] if hit is not None and hit[0]() is t else None

    def known_alias(self, t):
        """t's alias when a graph of this capture wrote t, else t."""
        hit = self.aliases.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else t  # the id of a dead tensor may be reused


@dataclass
class PieceGraph:
    """One capturable piece captured at one padded size."""

    graph: Any  # a TorchGraph, or the host stand-in's HostGraph
    inputs: List[Any]  # the objects the piece got at capture; the graph reads the tensors among them
    tensor_slots: List[int]  # positions of the tensors in inputs
    outputs: Any  # the piece's outputs at capture; replay writes these very tensors
    pick: Callable = None  # args -> the tensors at tensor_slots, as a tuple
    captured: tuple = ()  # inputs at tensor_slots
    owned: Optional[List[bool]] = None  # per output leaf, once finished: owned (a forward output)
    values: tuple = ()  # (position, value) of the Python numbers among inputs: the graph baked them
    written: tuple = ()  # positions of the tensor inputs the graph writes in place (a buffer the forward advances)
    in_place: tuple = ()  # positions of eager pieces' results that were their arguments' memory (not landed)
    overlapping: frozenset = frozenset()  # (i, k), i < k: a landed eager result and another input over its memory
    by_memory: Dict[Any, tuple] = field(default_factory=dict)  # storage of an input -> its positions

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
        self.values = tuple((i, a) for i, a in enumerate(self.inputs)
                            if i not in slots and type(a) in (int, float, bool))


class CapturablePiece:
    """A piece of the split graph that gets one graph per padded size."""

    def __init__(self, name: str, fn: Callable, state: GraphState, adapter, input_names: Sequence[str] = ()):
        self.name = name
        self.fn = fn
        self.input_names = input_names  # per input, what the forward read it from (Dynamo's source), for messages
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
            fresh = not all(map(operator.is_, entry.pick(args), entry.captured))
            if fresh:
                self._copy_fresh(entry, args)
            for i, value in entry.values:  # a dynamic int (an attribute Dynamo saw change) read afresh
                if args[i] != value:
                    raise ReplayDivergence(f"piece {self.name}: {self._input_name(i)} is {args[i]!r}, and its "
                                           f"graph was captured with {value!r}")
            entry.graph.replay()
            if fresh and entry.written:
                self._copy_back(entry, args)
            return entry.outputs
        if state.mode is Mode.CAPTURE:
            return self._capture(args)
        return self.fn(*args)

    def _input_name(self, i: int, what: str = ", a number Dynamo took as a graph input") -> str:
        if i < len(self.input_names):
            return f"input {i} ({self.input_names[i]}{what})"
        return f"input {i}"

    @staticmethod
    def _copy_back(entry: PieceGraph, args) -> None:
        """A tensor the graph writes, given anew (a buffer replaced since capture: `m.cache = torch.zeros(...)`):
        the graph wrote its captured copy; the forward writes the new one."""
        for i in entry.written:
            src, dst = args[i], entry.inputs[i]
            if src is not dst:
                src.copy_(dst)

    def _copy_fresh(self, entry: PieceGraph, args) -> None:
        captured = entry.inputs
        adapter = self.adapter
        fresh = [i for i in entry.tensor_slots if args[i] is not captured[i]]
        for i in fresh:
            src, dst = args[i], captured[i]
            if i in entry.in_place:
                if not same_memory(adapter, src, dst):  # the graph reads it where the eager piece's argument is
                    raise ReplayDivergence(_NOT_IN_PLACE)
                continue
            # One memory at capture must be one now, and other memory other. Only inputs that are fresh,
            # were over src's storage at capture, or met i at capture can differ; the rest are the captured
            # tensors, away from src's storage.
            near = set(fresh).union(entry.by_memory.get(memory_of(src), ()),
                                    *(pair for pair in entry.overlapping if i in pair))
            for k in near:
                if k != i and (captured[k] is dst and args[k] is not src or captured[k] is not dst and
                               _spans_meet(adapter, args[k], src) != ((min(i, k), max(i, k)) in entry.overlapping)):
                    raise ReplayDivergence(f"piece {self.name}: {self._input_name(i, '')} and "
                                           f"{self._input_name(k, '')} share memory now and did not at capture, "
                                           "or the other way round")
            # A fresh tensor from an eager piece (or a splitting op): copy it where the graph reads.
            if src.shape != dst.shape:  # a parameter replaced by one of another shape (resize_token_embeddings)
                raise ReplayDivergence(f"piece {self.name}: {self._input_name(i, '')} has shape "
                                       f"{tuple(src.shape)}, captured {tuple(dst.shape)}; to keep the new "
                                       "shape, clear_graphs() and capture_model() again")
            dst.copy_(src)

    def _capture(self, args):
        state = self.state
        inputs = list(args)
        slots = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        made = {i: state.made_by_eager(inputs[i]) for i in slots}  # (eager call, leaf) of eager results
        overlapping = _overlapping(self.adapter, inputs, slots, made)
        landed = {}  # id(fresh tensor) -> its landing view: one tensor in two slots stays one memory
        for i, where in made.items():
            if where is not None and not where[2]:
                view = landed.get(id(inputs[i]))
                if view is None:
                    view = landed[id(inputs[i])] = self._land(i, inputs[i])
                inputs[i] = view
        share = self._sharing()
        versions = {i: inputs[i]._version for i in slots}
        fn = self.fn
        outputs, graph = state.recorder.record_outputs(lambda: fn(*inputs), state.pool, share)
        # Held through aliases from here on (module doc); the split module goes on with the tensors.
        held = [state.known_alias(a) if i in slots else a for i, a in enumerate(inputs)]
        leaves, spec = flatten(outputs, _is_tensor)
        written = tuple(i for i in slots if inputs[i]._version != versions[i])
        if any(made[i] is not None and not made[i][2] for i in written):
            # The graph writes its landing copy of an eager piece's new tensor: the split module copies
            # that back before the next piece reads the tensor; the replay plan would not.
            state.plannable = False
        if any(i in written or k in written for i, k in overlapping):
            raise CaptureError("a new tensor a splitting op returned reaches the next graph together with another "
                               "tensor over its memory (a view of it), and the graph writes one of them; graph_opt "
                               "copies such new tensors where the graph reads and cannot keep the two one memory "
                               "there. Take the view in the graph, after the splitting op")
        entry = PieceGraph(graph, held, slots, unflatten(spec, [state.alias(t, self.adapter) for t in leaves]),
                           written=written,
                           in_place=tuple(i for i, where in made.items() if where is not None and where[2]),
                           overlapping=overlapping, by_memory=_bymemory_of(inputs, slots))
        self.entries[state.key] = entry
        for i, where in made.items():  # for the replay plan: an eager piece's result lands in entry.inputs[i]
            if where is not None:
                if where[2]:
                    where[0].dests.append((where[1], entry.inputs[i], True))
                elif inputs[i] is args[i]:  # not landed (broadcast memory): nothing to copy into
                    state.plannable = False
                else:
                    where[0].dests.append((where[1], entry.inputs[i], False))
        state.calls.append(entry.graph)
        return outputs

    def _sharing(self) -> Optional[SharedOutputs]:
        """Outputs of this piece that a larger size kept owned (the forward's outputs) take this size's
        outputs into their first rows (graph_opt/replay/output_sharing.py)."""
        state = self.state
        larger = self.entries.get(state.share_key) if state.share_key is not None else None
        if larger is None or larger.owned is None or not any(larger.owned):
            return None
        # An output that is a view of one of the piece's inputs (`return y, x[:, :]`) is that input's memory
        reserved = [self.adapter.extent(t) for t in larger.captured]
        share = SharedOutputs(self.adapter, larger.outputs, state.padded, larger.owned, reserved=reserved)
        return share if any(share.usable) else None

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

    def finish(self, key, owners: Dict[int, torch.Tensor], keep: set) -> None:
        """Once the size is captured: the aliases of what the forward returned (ids in `keep`) become
        those tensors again.

        `owners` maps id(alias) -> the tensor the forward returned, so that a piece's input stays the
        very object the previous piece returns and replays skip the copy.
        """
        entry = self.entries.get(key)
        if entry is None:
            return
        leaves, spec = flatten(entry.outputs, self.adapter.is_tensor)
        leaves = [owners.get(id(t), t) for t in leaves]
        entry.owned = [id(t) in keep for t in leaves]
        entry.outputs = unflatten(spec, leaves)
        entry.inputs = [owners.get(id(a), a) for a in entry.inputs]
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
        state = self.state
        if state.mode is Mode.CAPTURE:
            leaves, _ = flatten(out, _is_tensor)
            if any(state.made_by_eager(a) is not None for a in flatten(args, _is_tensor)[0]) or \
                    not _tensors_or_none(out):
                state.plannable = False
            call = EagerCall(self.fn, [state.known_alias(a) for a in args])
            tensor_args = flatten(args, _is_tensor)[0]
            held = {memory_of(a) for a in tensor_args}
            first: Dict[int, int] = {}
            for j, t in enumerate(leaves):
                if id(t) in first:  # one tensor twice in the result: each replay checks it is again
                    call.same.append((j, first[id(t)]))
                    continue
                first[id(t)] = j
                passed = next((k for k, a in enumerate(tensor_args) if a is t), None)
                if passed is not None and state.made_by_eager(t) is not None:
                    # An earlier eager piece's result passed on as it is: it stays that piece's (landed
                    # once); each replay checks this piece passes it on again.
                    call.passed.append((j, passed))
                    continue
                # Its argument or a view of it (an identity op, out=) is no fresh memory to land where the
                # graph reads: the next graph reads and writes that very memory, or writes through one name
                # would miss the other (x * c after op(c).add_(1)). Each replay checks it is that memory.
                state.made[id(t)] = (weakref.ref(t), call, j, memory_of(t) in held)
            state.calls.append(call)
        return out


def _overlapping(adapter, inputs, slots, made) -> frozenset:
    """(i, k) with i < k where a fresh eager result at i (copied to a landing buffer where the graph
    reads) and the input at k, another tensor, span common memory. Reads through both copies are right;
    a graph writing one of them is refused (CaptureError), and a replay checks the relation still holds."""
    pairs = set()
    for i in slots:
        where = made[i]
        if where is None or where[2]:
            continue
        for k in slots:
            if k != i and inputs[k] is not inputs[i] and _spans_meet(adapter, inputs[k], inputs[i]):
                pairs.add((min(i, k), max(i, k)))
    return frozenset(pairs)


def _spans_meet(adapter, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two non-empty tensors meet (interleaved strided views count as meeting)."""
    return bool(a.numel() and b.numel()) and overlaps((adapter.extent(a),), adapter.extent(b))


def _bymemory_of(inputs, slots) -> Dict[Any, tuple]:
    out: Dict[Any, list] = {}
    for k in slots:
        out.setdefault(memory_of(inputs[k]), []).append(k)
    return {m: tuple(ks) for m, ks in out.items()}


def _tensors_or_none(value) -> bool:
    if value is None or isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and all(_tensors_or_none(v) for v in value)


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
        self.plans: Dict[Any, Optional[ReplayPlan]] = {}  # key -> its replay without the split module

    def __call__(self, *args):
        if self.state.mode is not Mode.CAPTURE:
            return self._forward(*args)
        self.state.forwards_run.append(self)
        self.captured_args[self.state.key] = args
        out = self._forward(*args)
        self.captured_outputs[self.state.key] = {id(t) for t in flatten(out, _is_tensor)[0]}
        return out

    def finish(self, key) -> None:
        """After a size is captured: the pieces own what the forward returned, and nothing else (module doc)."""
        keep = self.captured_outputs.pop(key, set())
        owners: Dict[int, torch.Tensor] = {}
        for alias_id, ref in self.state.strong_of.items():
            t = ref()
            if t is not None and id(t) in keep:
                owners[alias_id] = t
        self.state.strong_of.clear()
        for piece in self.pieces:
            piece.finish(key, owners, keep)
        self.plans[key] = ReplayPlan.build(self.state, owners)
        self.state.calls.clear()
        self.state.made.clear()

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
            self.plans.clear()
        else:
            self.captured_args.pop(key, None)
            self.plans.pop(key, None)
