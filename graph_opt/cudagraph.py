"""Per-size CUDA-graph runtime: warmup -> capture -> replay, framework-neutral.

A call follows GraphRunner.__call__ -> CapturedSize.run: flatten the arguments, look the padded
size up in a table, copy the real rows into static buffers, replay, return views of the captured
outputs. Nothing on that path logs or allocates device memory.

How a size is captured is a strategy's business: EagerStrategy (level 0) captures the eager forward
here; the static strategies (level >= 1) live in backends/ because they hook the framework's
translator. The runner does not care which: it trusts the strategy it is given.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import gc
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import capture_checks, guards, output_layout, output_sharing, ranks, split
from .errors import CaptureError, GraphOptConfigError, GraphOptError, GraphOptInputError, GuardFailed, ReplayDivergence
from .failures import describe
from .pytree import TENSOR, flatten, leaf_paths, tensor_leaf_owners, unflatten
from .replay_guards import ModelState, Unwatched
from .padding import Padding
from .sizes import PaddingTable
from .stats import Counters
from .host_outputs import HostRingFull, SizeCopies, _pending as _pending_host_copies, land_pending_copies
from .testing import HostGraph, simulation_enabled

logger = logging.getLogger("graph_opt")

_MISMATCH = object()  # CapturedSize.run could not use its graph for these inputs
_ALIASED = object()  # two arguments share memory and the forward writes one: separate static buffers differ
_HOST_VALUE = object()  # a host tensor argument holds another value than the level-0 graph baked
REQUIRED = object()  # a forward parameter without default


@dataclass
class Captured:
    """What a strategy hands back after capturing one size."""

    outputs: Any  # the forward's output at capture
    replay: Callable[[], Any]  # runs the captured work; returns the outputs when they are not stable
    stable_outputs: bool  # replay writes the captured output tensors in place
    pieces: int
    graphs: int
    keepalive: List[Any] = field(default_factory=list)  # graphs and tensors the replay reads
    # The framework's guards (level >= 1): None when a replay may run, else (key, what changed).
    check: Optional[Callable[[], Optional[Tuple[str, str]]]] = None


@dataclass
class CapturedSize:
    """Everything one padded size needs at replay."""

    padded_size: int
    sig: "Signature"  # its call structure: static buffers, padding, output layout, mutated inputs
    inputs: List[Any]  # the tensors the graph reads, one per tensor leaf, at the padded size
    dims: List[Optional[int]]  # dynamic dim of each leaf, None for static leaves
    copy_inputs: bool
    input_ptrs: List[int]
    captured: Captured
    capture_ms: float
    memory_bytes: Optional[int]
    copies: Optional[SizeCopies] = None  # host_outputs copied by the graph itself
    views: Dict[int, tuple] = field(default_factory=dict)
    pending_check: Optional[tuple] = None  # (capture inputs, eager's outputs) until finish_captures()
    # Level 0 on a device: (index, value at capture) of each host tensor argument. A kernel takes a host
    # scalar (x / t, t a CPU tensor) by value when it is launched, so the graph holds the capture's.
    host_values: List[tuple] = field(default_factory=list)

    def run(self, adapter, leaves: Sequence[Any], real: int):
        copies = self.copies
        if copies is not None:
            copies.owner.check_slot()  # before anything is written: the ring slot must be free
        views = self.views.get(real)
        if views is None:
            views = self._views_for(adapter, real)
        dsts, shapes, dtypes, strides, output = views
        if _pending_host_copies:  # simulated slow copies (tests) still reading outputs land first
            land_pending_copies()
        sig = self.sig
        if self.copy_inputs:
            # The dtype check matters: copy_ would cast silently (torch) or fail inside the framework (Paddle).
            for dst, shape, dtype, src in zip(dsts, shapes, dtypes, leaves):
                if src is not dst:
                    if adapter.shape(src) != shape or adapter.dtype(src) != dtype:
                        return _MISMATCH
                    adapter.copy_(dst, src)
            padding = sig.padding
            if padding.dirty > real:  # an earlier call left real rows where this one pads
                padding.wrote(real)
            else:
                padding.dirty = real
        else:
            # The caller's own buffers: the very memory, shape and strides the graph read at capture
            # (buf.t() has buf's address and another meaning).
            for ptr, shape, dtype, stride, src in zip(self.input_ptrs, shapes, dtypes, strides, leaves):
                if adapter.data_ptr(src) != ptr or adapter.shape(src) != shape or adapter.dtype(src) != dtype \
                        or adapter.stride(src) != stride:
                    return _MISMATCH
        if sig.mutated and _aliased(adapter, leaves):
            return _ALIASED
        if self.host_values:
            for i, value in self.host_values:
                if not adapter.same_values(leaves[i], value):
                    return _HOST_VALUE
        fresh = self.captured.replay()
        if sig.mutated:
            self._write_back(adapter, sig, dsts, leaves)
        if self.captured.stable_outputs:
            if copies is not None:
                return copies.after_replay(output, real)
            return output
        return self._cut_outputs(adapter, fresh, real)

    def _write_back(self, adapter, sig, dsts, leaves) -> None:
        """The forward writes some inputs in place: eager would have written the caller's tensors."""
        for i in sig.mutated:
            if leaves[i] is not dsts[i]:
                adapter.copy_(leaves[i], dsts[i])
        if sig.padding is not None:
            sig.padding.touched(self.padded_size)  # the forward wrote the padding rows too

    def _views_for(self, adapter, real: int):
        dsts = [t if d is None else adapter.narrow(t, d, real) for t, d in zip(self.inputs, self.dims)]
        shapes = [adapter.shape(t) for t in dsts]
        dtypes = [adapter.dtype(t) for t in dsts]
        strides = [adapter.stride(t) for t in dsts]
        output = self._cut_outputs(adapter, self.captured.outputs, real) if self.captured.stable_outputs else None
        views = (dsts, shapes, dtypes, strides, output)
        self.views[real] = views
        return views

    def _cut_outputs(self, adapter, outputs, real: int):
        if real == self.padded_size:
            return outputs
        return self.sig.layout.cut(adapter, outputs, real)

    def release(self) -> None:
        for obj in self.captured.keepalive:
            reset = getattr(obj, "reset", None)
            if callable(reset):
                reset()
        self.captured.keepalive.clear()
        self.views.clear()
        self.inputs = []
        self.copies = None


class Signature:
    """One call structure: its non-tensor arguments, where its tensors are, their static buffers."""

    def __init__(self, index: int, spec, dims: List[Optional[int]], template,
                 layout: Optional[List[Tuple[Any, list]]] = None, lazy: bool = False):
        self.index = index  # 1, 2, ...: this signature's number in its runner
        self.spec = spec
        self.dims = dims
        self.template = template  # the first call's (args, kwargs), to rebuild dataclass arguments
        # (dtype, shape with None at the dynamic dim) of each tensor leaf: what every call must match
        self.input_layout = layout or []
        self.dynamic = [i for i, d in enumerate(dims) if d is not None]
        self.lazy = lazy  # made by a call rather than by capture_model
        self.entries: Dict[int, CapturedSize] = {}
        self.buffers: Optional[List[Any]] = None  # static input buffers at the max size (copy_inputs)
        self.padding: Optional[Padding] = None  # their padding rows (copy_inputs)
        self.mutated: List[int] = []  # leaves the forward writes in place: written back after a replay
        self.observations: List[output_layout.Observation] = []  # outputs seen at each size
        self.layout = output_layout.OutputLayout()  # the outputs' batch dims, once seen at two sizes
        self.eager_writes: set = set()  # leaves the plain forward writes in place (capture_checks)
        self.eager_buffer_writes: set = set()  # model buffers it writes in place
        self.static_buffer_writes: set = set()  # model buffers the captured path writes in place

    def key(self, padded: int) -> int:
        """An integer naming (this signature, padded size): what strategies key their graphs by."""
        return self.index * (1 << 20) + padded

    def dynamic_leaves(self, args, kwargs, is_tensor):
        """(tensor, dynamic dim) for the tensors of (args, kwargs) that have one."""
        leaves, _ = flatten((args, kwargs), is_tensor)
        return [(leaf, dim) for leaf, dim in zip(leaves, self.dims) if dim is not None]

    def batch_size(self, adapter, leaves) -> int:
        """The common size of every dynamic dim, or -1 when they disagree (IndexError: a leaf's rank is too low)."""
        dyn = self.dynamic
        dims = self.dims
        real = adapter.shape(leaves[dyn[0]])[dims[dyn[0]]]
        for i in dyn[1:]:
            if adapter.shape(leaves[i])[dims[i]] != real:
                return -1
        return real

    def buffer_bytes(self, adapter) -> int:
        return sum(adapter.nbytes(b) for b in self.buffers) if self.buffers else 0

    def largest_above(self, padded: int) -> Optional[int]:
        """The largest size captured with this signature above `padded` (output_sharing), or None."""
        larger = [size for size in self.entries if size > padded]
        return max(larger) if larger else None

    def observe(self, observation: "output_layout.Observation") -> None:
        """Learn the output layout from one more size; cached replay views are cut anew if it changed."""
        self.observations.append(observation)
        layout = output_layout.learn(self.observations)
        layout.blocked = self.layout.blocked
        if layout != self.layout:
            self.layout = layout
            for entry in self.entries.values():
                entry.views.clear()

    def block(self, why: str) -> None:
        """From now on only calls of a captured size replay (capture_checks found padded calls differ)."""
        self.layout.blocked.append(why)


@contextlib.contextmanager
def frozen_gc(collect: bool = True):
    """Collect once, then keep the collector out of the capture phase.

    A collection during capture is slow (it walks every object) and could free tensors whose memory a
    graph being captured still uses; freezing moves today's objects out of the collector's reach.
    collect=False skips the first collection (a capture in the middle of training, where one costs
    about 0.1 s of a large heap and frees little).
    """
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


class GraphRunner:
    """Dispatch, pad, copy and replay for one model; capture sizes on demand."""

    def __init__(self, *, adapter, config, strategy, eager: Callable, dynamic_arg_dims,
                 params: Sequence[Tuple[str, Any]], name: str, host_outputs=None, guard=None,
                 model_state: Optional[ModelState] = None, pad_values: Optional[Dict[str, Any]] = None):
        self.adapter = adapter
        self.host_outputs = host_outputs  # HostOutputs whose copies captured sizes make in their graphs
        self.config = config
        self.strategy = strategy
        # The plain forward, without the module's hooks (the decorated call runs those around the
        # runner): what runs once a capture has failed, and what capture_checks probes.
        self.eager = eager
        self.dynamic_arg_dims = dynamic_arg_dims  # None: dim 0 of every tensor argument
        # forward's positional-or-keyword parameters after self: (name, default or REQUIRED)
        self.params = list(params)
        self.arg_names = [name for name, _ in self.params]
        self.name = name
        self.pad_values = pad_values or {}
        # Training flags, autocast, replaced parameters, level-0 attributes: checked before every replay.
        self.model_state = model_state if model_state is not None else Unwatched()
        self.table = PaddingTable(config.capture_sizes)
        self.max_size = self.table.max_size
        self.signatures: Dict[Any, Signature] = {}
        self._sig_numbers = itertools.count(1)  # not reused for a signature dropped unused (restarts on release)
        self.counters = Counters()
        self.fallback_reasons: Dict[str, int] = {}  # why calls ran without graphs, by kind
        self.capture_notes: List[str] = []  # what capture_checks found, for the capture report
        self.capture_seconds = 0.0
        self.memory_bytes: Optional[int] = None
        self.disabled_reason: Optional[str] = None
        self.capture_model_done = False
        self.pool = None
        self.group = None  # the ranks that agree on every replay (graph_opt.ranks), set when capturing
        self._warned: set = set()
        self._is_tensor = adapter.is_tensor
        # Held by the call (and capture_model, clear_graphs) using the static buffers. Calls from two
        # threads at once would copy into and replay from the same buffers, and each returns views of
        # the same output tensors: the second one is refused (non-blocking acquire: no waiting, no
        # allocation). Re-entrant, so the forward or make_inputs may call the model on the same thread.
        # Runners of one model's graph kinds (graph_opt.dispatch) share one.
        self.guard = guard if guard is not None else threading.RLock()
        self._acquire = self.guard.acquire
        self._release = self.guard.release

    # -- hot path ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.disabled_reason is not None:
            # After a failed capture or replay the translated path is suspect too: run the plain forward.
            self.counters.fallbacks += 1
            return self.eager(*args, **kwargs)
        if not self._acquire(False):
            raise self.busy_error()
        try:
            return self._dispatch(args, kwargs)
        finally:
            self._release()

    def _dispatch(self, args, kwargs):
        if not kwargs and len(args) == len(self.params) and all(map(self._is_tensor, args)):
            # The common call, m(x) or m(x, lens): its spec is known without walking the arguments.
            leaves, spec = list(args), _all_tensors_spec(len(args))
        else:
            if kwargs or len(args) < len(self.params):
                args, kwargs = self.canonical(args, kwargs)
            leaves, spec = flatten((args, kwargs), self._is_tensor)
        sig = self.signatures.get(spec)
        if sig is None:
            refusal = self._refuse_lazy_signature(spec)
            sig = None if refusal is not None else self._new_signature(spec, leaves, args, kwargs, lazy=True)
            if sig is None:
                return self._fallback(args, kwargs, refusal or _NO_BATCH)
        try:
            real = sig.batch_size(self.adapter, leaves)
        except IndexError:  # a tensor with fewer dimensions than its dynamic dim
            real = -1
        padded = self.table.padded_size(real) if real > 0 else 0
        if not padded:
            if real < 0:
                if not sig.entries:  # nothing captured with it: the next call may define it afresh
                    del self.signatures[spec]
                raise self._bad_call(sig, leaves, self._misfit(sig, leaves, "argument"))
            return self._fallback(args, kwargs, None)
        if self.adapter.grad_enabled():
            return self._fallback(args, kwargs, ("grad", _FALLBACK_REASONS["grad"]))
        state = self.model_state
        # Never capture or replay in another mode than captured (training flag, autocast, ...).
        blocked = state.check() if state.captured else None
        group = self.group
        entry = sig.entries.get(padded)
        if entry is None:
            if group is not None:  # every rank captures lazily, or none does
                blocked = ranks.agree_on_replay(group, blocked)
            if blocked is not None:
                return self._fallback(args, kwargs, blocked)
            misfit = self._misfit(sig, leaves, "argument")
            if misfit is not None:
                if misfit[0] != "shape":
                    raise self._bad_call(sig, leaves, misfit)
                return self._fallback(args, kwargs, ("mismatch", _FALLBACK_REASONS["mismatch"]))
            entry = self._capture_lazily(sig, padded, real, leaves)
            if entry is None:
                return self._fallback(args, kwargs, None)
        if blocked is None:
            check = entry.captured.check
            if check is not None:
                blocked = check()
            if blocked is None and real != padded and sig.layout.exact_only:
                blocked = ("outputs", f"a call of {real} rows would replay size {padded}, and "
                                      f"{sig.layout.why_exact_only()}; calls of a size that is not captured run "
                                      "without graphs")
        if group is not None:  # a replay runs on every rank or on none: their collectives must match
            blocked = ranks.agree_on_replay(group, blocked)
        if blocked is not None:
            return self._fallback(args, kwargs, blocked)
        try:
            out = entry.run(self.adapter, leaves, real)
        except HostRingFull:
            raise  # the caller's error, found before anything ran: the graphs are fine
        except GuardFailed as exc:
            return self._fallback(args, kwargs, ("guard", exc.guard))
        except ReplayDivergence as exc:
            return self._fallback(args, kwargs, ("divergence", f"{exc}; this call runs without graphs"))
        except Exception as exc:
            return self._replay_failed(exc, padded, args, kwargs)
        if out is _ALIASED:
            return self._fallback(args, kwargs, ("aliased", "two tensor arguments share memory and the forward "
                                                 "writes one of them in place: the graph reads them from separate "
                                                 "buffers, so this call runs without graphs"))
        if out is _HOST_VALUE:
            return self._fallback(args, kwargs, ("host_argument", _FALLBACK_REASONS["host_argument"]))
        if out is _MISMATCH:
            # The slow path: a rank or dtype the graph cannot take is the caller's error; another
            # non-batch shape (or, without copied inputs, another address or strides) runs without graphs.
            misfit = self._misfit(sig, leaves, "argument")
            if misfit is not None and misfit[0] != "shape":
                raise self._bad_call(sig, leaves, misfit)
            return self._fallback(args, kwargs, ("mismatch", _FALLBACK_REASONS["mismatch"]))
        self.counters.replays += 1
        return out

    def canonical(self, args, kwargs):
        """Arguments as one positional tuple in forward's order, defaults filled in, so that m(x),
        m(x=x) and m(x, scale=1.0) (the default) share one signature."""
        args = list(args)
        kwargs = dict(kwargs)
        for name, default in self.params[len(args):]:
            if name in kwargs:
                args.append(kwargs.pop(name))
            elif default is not REQUIRED:
                args.append(default)
            else:
                break
        return tuple(args), kwargs

    def _fallback(self, args, kwargs, why: Optional[tuple]):
        """Run this call without graphs. why: (kind, message[, warning key]) for stats().fallback_reasons
        and one warning per key (default: kind and message); None for the silent, expected cases (a
        size above the max)."""
        self.counters.fallbacks += 1
        if why is not None:
            kind, message = why[0], why[1]
            self.fallback_reasons[kind] = self.fallback_reasons.get(kind, 0) + 1
            self._warn_once(why[2] if len(why) > 2 else why[:2],
                            message if message.endswith("without graphs") else f"{message}; this call runs without graphs")
            if kind in _EAGER_KINDS:
                # The static path would not see these either: Paddle's SOT runs its programs on the
                # parameters it traced with, and neither translator guards every hook.
                return self.eager(*args, **kwargs)
        return self.strategy.run(args, kwargs)

    def _replay_failed(self, exc: Exception, padded: int, args, kwargs):
        """A replay raised. The call is answered by the plain eager forward; if that raises too, the
        inputs are at fault: its error propagates and the graphs stay. Otherwise the graphs are: they are
        dropped, as after a failed capture (one warning, stats().disabled_reason), until clear_graphs()
        and capture_model() capture again."""
        self.counters.fallbacks += 1
        try:
            out = self.eager(*args, **kwargs)
        except Exception as eager_exc:
            raise eager_exc from None  # the caller's error, as without graphs; not chained to the replay's
        self.counters.replay_failures += 1
        self.release()
        self.disabled_reason = f"replay of size {padded} failed: {type(exc).__name__}: {exc}"
        logger.warning("%s: %s; running without graphs (clear_graphs() and capture_model() capture again)",
                       self.name, self.disabled_reason)
        return out

    def busy_error(self) -> GraphOptError:
        return GraphOptError(
            f"{self.name} is being called from two threads at once; graph replay is not thread-safe: every call "
            "copies into the same static input buffers and returns views of the same captured outputs. Serialize "
            "the calls (one lock around each call and the use of its outputs) or give each thread its own model"
        )

    def _warn_once(self, key, message: str) -> None:
        """One warning per key; at most a few per kind of key, so that a value changing at every call
        (an attribute used as a counter) does not warn at every call."""
        if key in self._warned:
            return
        kind = key[0] if isinstance(key, tuple) else key
        per_kind = sum(1 for k in self._warned if (k[0] if isinstance(k, tuple) else k) == kind)
        if per_kind >= _WARNINGS_PER_KIND:
            return
        self._warned.add(key)
        logger.warning("%s: %s", self.name, message)

    # -- inputs that do not fit (slow paths only) ---------------------------------------------------
    def _leaf_names(self, spec) -> List[str]:
        """A readable name per tensor leaf: the forward argument it belongs to."""
        owners = tensor_leaf_owners(spec)
        names = []
        for i, owner in enumerate(owners):
            if isinstance(owner, int):
                name = repr(self.arg_names[owner]) if owner < len(self.arg_names) else f"positional argument {owner}"
            else:
                name = repr(owner)
            if owners.count(owner) > 1:
                name += f" (tensor {owners[:i].count(owner) + 1} of {owners.count(owner)} in it)"
            names.append(name)
        return names

    def _describe(self, shape, dim) -> str:
        dims = ", ".join("batch" if i == dim else str(n) for i, n in enumerate(shape))
        return f"a {len(shape)}-dimensional tensor of shape [{dims}]"

    def _misfit(self, sig: Signature, leaves, what: str, size: Optional[int] = None) -> Optional[Tuple[str, str]]:
        """(kind, message) saying why `leaves` cannot use `sig`'s graphs and buffers, or None when they can.

        kind "rank" or "dtype" is the caller's error; "rows" (capture only: not `size` rows) too; "shape"
        (another non-batch dimension) is reported only when nothing worse is found: a call runs it
        without graphs."""
        adapter = self.adapter
        names = self._leaf_names(sig.spec)
        found = None
        for name, leaf, dim, (dtype, shape) in zip(names, leaves, sig.dims, sig.input_layout):
            got = list(adapter.shape(leaf))
            if len(got) != len(shape):
                return "rank", (f"{what} {name} has {len(got)} dimensions (shape {got}); "
                                f"{self.name} takes {self._describe(shape, dim)} there")
            if adapter.dtype(leaf) != dtype:
                return "dtype", f"{what} {name} has dtype {adapter.dtype(leaf)}; {self.name} takes dtype {dtype} there"
            if dim is not None and size is not None and got[dim] != size:
                return "rows", (f"{what} {name} has {got[dim]} rows in its batch dimension {dim} (shape {got}); "
                                f"expected {size}, the size being captured")
            bad = [i for i, (g, s) in enumerate(zip(got, shape)) if i != dim and g != s]
            if bad and found is None:
                found = "shape", (f"{what} {name} has shape {got}, dimension {bad[0]} differs; "
                                  f"{self.name} takes {self._describe(shape, dim)} there")
        return found

    def _bad_call(self, sig: Signature, leaves, misfit) -> GraphOptInputError:
        """The error for a call whose tensors cannot replay; raised before anything is copied or replayed."""
        if misfit is None or misfit[0] == "shape":
            return GraphOptInputError(f"{self.name}: {self._disagreement(sig, leaves)}")
        return GraphOptInputError(f"{self.name}: {misfit[1]}")

    def _disagreement(self, sig: Signature, leaves) -> str:
        names = self._leaf_names(sig.spec)
        sizes = [f"{names[i]} has {self.adapter.shape(leaves[i])[sig.dims[i]]} (dim {sig.dims[i]})" for i in sig.dynamic]
        return ("the batch dimensions of the arguments disagree: " + ", ".join(sizes) + "; every dynamic dimension "
                "(dynamic_arg_dims, by default dim 0 of every tensor argument) must have the same size. "
                "Pass dynamic_arg_dims={'arg': dim} to @support_graph_optimization to name only the batch dimensions")

    def batch_disagreement(self, args, kwargs) -> Optional[str]:
        """Why the batch dimensions of (args, kwargs) disagree, or None when they agree. For a call that
        failed on a path without graphs, to name the arguments instead of the framework's kernel."""
        args, kwargs = self.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), self._is_tensor)
        try:
            sig = Signature(0, spec, self._dynamic_dims(spec, leaves), (args, kwargs))
            if not sig.dynamic or sig.batch_size(self.adapter, leaves) >= 0:
                return None
        except (GraphOptConfigError, IndexError):
            return None
        return self._disagreement(sig, leaves)

    # -- signatures --------------------------------------------------------------------------------
    def _opaque_arguments(self, spec) -> List[str]:
        """Level 0: non-tensor arguments that are objects a replay cannot check (a Hugging Face
        DynamicCache, a user's state object): the graph bakes whatever the forward read from them at
        capture, and they are compared by identity, so a call with the same object mutated would replay
        stale. Plain values, containers, dataclasses, enums, functions and the framework's dtypes and
        devices are fine. Level >= 1: the framework guards what the forward reads from them."""
        if self.config.graph_opt_level != 0:
            return []
        value_types = self.adapter.value_types
        found = []
        for path, leaf in self._named_leaves(spec):
            if leaf is TENSOR:
                continue
            value = getattr(leaf, "value", getattr(leaf, "obj", None))
            if not isinstance(value, _PLAIN + value_types) and not callable(value):
                found.append(f"{path} (a {type(value).__name__})")
        return found

    def _refuse_lazy_signature(self, spec) -> Optional[Tuple[str, str]]:
        """Why a call with a structure or non-tensor value never seen before may not get graphs of its
        own at call time, or None. Replaying a graph captured with another value would be wrong; a
        graph per value without bound would capture (and hold static buffers) at every new value."""
        opaque = self._opaque_arguments(spec)
        if opaque:
            return ("object_argument", f"{_opaque_message(opaque)}; these calls run without graphs",
                    ("object_argument",))
        if self.capture_model_done and self.signatures:
            return ("new_signature", f"{self._new_values(spec)}: a call with a structure or non-tensor value not "
                    "seen at capture runs without graphs (capture_model() with inputs of that value captures it too)",
                    ("new_signature",))
        limit = self.config.cudagraph_max_signatures
        if sum(1 for sig in self.signatures.values() if sig.lazy) >= limit:
            return ("signature_limit", f"{self._new_values(spec)}; graphs are captured per non-tensor argument value "
                    f"and {limit} were captured at call time (cudagraph_max_signatures={limit}), so calls with "
                    "further values run without graphs. Pass a value that changes from call to call as a tensor",
                    ("signature_limit",))
        return None

    def _new_values(self, spec) -> str:
        """What differs between a call's structure and the nearest one seen before, naming the argument."""
        new = self._named_leaves(spec)
        best = None
        for sig in self.signatures.values():
            old = self._named_leaves(sig.spec)
            diffs = [(path, value, dict(old).get(path, _ABSENT)) for path, value in new if dict(old).get(path, _ABSENT) != value]
            diffs += [(path, _ABSENT, value) for path, value in old if path not in dict(new)]
            if best is None or len(diffs) < len(best):
                best = diffs
        if not best:
            return "a call with another structure or non-tensor argument value than the calls seen before"
        path, value, before = best[0]
        return (f"forward argument {path} is {_show_value(value)}; the calls seen before had "
                f"{_show_value(before)}")

    def _named_leaves(self, spec) -> List[Tuple[str, Any]]:
        """(argument path, leaf) for every leaf of a call's spec: ('scale', <1.0>), ("cfg['k']", TENSOR)."""
        args_spec, kwargs_spec = spec[1]
        out: List[Tuple[str, Any]] = []
        for i, child in enumerate(args_spec[1]):
            name = self.arg_names[i] if i < len(self.arg_names) else f"args[{i}]"
            out.extend(leaf_paths(child, root=name))
        for key, child in zip(kwargs_spec[1], kwargs_spec[2]):
            out.extend(leaf_paths(child, root=key))
        return out

    def _new_signature(self, spec, leaves, args, kwargs, lazy: bool = False) -> Optional[Signature]:
        dims = self._dynamic_dims(spec, leaves)
        if not any(d is not None for d in dims):
            return None
        adapter = self.adapter
        layout = [(adapter.dtype(t), [None if i == d else n for i, n in enumerate(adapter.shape(t))])
                  for t, d in zip(leaves, dims)]
        self._check_pad_values(spec, leaves, dims)
        sig = Signature(next(self._sig_numbers), spec, dims, (args, kwargs), layout, lazy=lazy)
        self.signatures[spec] = sig
        return sig

    def _check_pad_values(self, spec, leaves, dims) -> None:
        """GraphOptConfigError where a pad value does not fit its argument's dtype (1e20 in int64, -1.5)."""
        if not self.pad_values:
            return
        for owner, leaf, dim in zip(tensor_leaf_owners(spec), leaves, dims):
            name = self.arg_names[owner] if isinstance(owner, int) and owner < len(self.arg_names) else owner
            value = self.pad_values.get(name)
            if dim is not None and value is not None and not self.adapter.fits(value, self.adapter.dtype(leaf)):
                raise GraphOptConfigError(
                    f"{self.name}: pad_values[{name!r}]={value!r} does not fit argument {name!r} of dtype "
                    f"{self.adapter.dtype(leaf)}; give a value that dtype holds exactly (e.g. -1 for an index)")

    def _dynamic_dims(self, spec, leaves) -> List[Optional[int]]:
        owners = tensor_leaf_owners(spec)
        dims: List[Optional[int]] = []
        for owner, leaf in zip(owners, leaves):
            name = self.arg_names[owner] if isinstance(owner, int) and owner < len(self.arg_names) else owner
            ndim = len(self.adapter.shape(leaf))
            if self.dynamic_arg_dims is None:
                dim = 0 if ndim > 0 else None
            else:
                dim = self.dynamic_arg_dims.get(name)
                if dim is not None and not -ndim <= dim < ndim:
                    raise GraphOptConfigError(
                        f"{self.name}: dynamic_arg_dims[{name!r}]={dim} is out of range for argument {name!r} of "
                        f"shape {list(self.adapter.shape(leaf))}: a dim of a {ndim}-dimensional tensor must be in "
                        f"{-ndim}..{ndim - 1}" if ndim else
                        f"{self.name}: dynamic_arg_dims[{name!r}]={dim} names a dimension of argument {name!r}, "
                        "which is a 0-dimensional tensor: a dynamic argument must have at least one dimension"
                    )
                if dim is not None and dim < 0:
                    dim += ndim
            dims.append(dim)
        return dims

    # -- capture -----------------------------------------------------------------------------------
    def capture(self, args, kwargs, size: int) -> CapturedSize:
        """Capture `size` for the call structure of (args, kwargs); inputs must have `size` rows."""
        sig, leaves = self.check_capture_inputs(args, kwargs, size)
        entry = self.capture_checked(sig, leaves, size)
        self.finish_captures()
        return entry

    def check_capture_inputs(self, args, kwargs, size: int):
        """(signature, tensor leaves) for capturing `size` from these inputs; GraphOptInputError (or
        GraphOptConfigError for dynamic_arg_dims) when they cannot be captured. Changes nothing then."""
        args, kwargs = self.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), self._is_tensor)
        sig = self.signatures.get(spec)
        new = sig is None
        if new:
            opaque = self._opaque_arguments(spec)
            if opaque:
                raise GraphOptInputError(f"{self.name}: make_inputs({size}) returned {_opaque_message(opaque)}")
            sig = self._new_signature(spec, leaves, args, kwargs)
        if sig is None:
            raise GraphOptInputError(
                f"{self.name}: make_inputs({size}) returned no tensor with a batch dimension; it must return the "
                f"forward's tensors with {size} rows (dim 0 of every tensor argument, or the dims named by "
                "dynamic_arg_dims={'arg': dim} on @support_graph_optimization)"
            )
        reason = None
        misfit = self._misfit(sig, leaves, f"make_inputs({size}): argument", size)
        if misfit is not None:
            reason = misfit[1]
            if misfit[0] in ("rank", "dtype", "shape") and sig.entries:
                reason += ", as make_inputs gave it for the sizes captured before (every size must agree)"
        elif sig.batch_size(self.adapter, leaves) != size:
            reason = f"make_inputs({size}) returned inputs where {self._disagreement(sig, leaves)}"
        if reason is not None:
            if new:
                del self.signatures[spec]
            raise GraphOptInputError(f"{self.name}: {reason}")
        return sig, leaves

    def capture_checked(self, sig: Signature, leaves, size: int) -> CapturedSize:
        return sig.entries.get(size) or self._capture_size(sig, size, leaves)

    def _capture_lazily(self, sig: Signature, padded: int, real: int, leaves) -> Optional[CapturedSize]:
        if not self.config.cudagraph_copy_inputs and real != padded:
            return None  # the caller's buffers must hold the padded rows; nothing can be captured from them
        logger.info("%s: capturing padded size %d lazily (first seen at call time)", self.name, padded)
        error = None
        try:
            with frozen_gc():
                entry = self._capture_size(sig, padded, leaves)
        except Exception as exc:  # the model must keep working: run without graphs from now on
            error = exc
        self.group = ranks.group_for(self.adapter)
        across_ranks = ranks.agree_on_capture(self.group, padded, error)
        if error is not None or across_ranks is not None:
            self.capture_failed(error, padded, across_ranks)
            return None
        self.finish_captures()
        self.counters.lazy_captures += 1
        return entry

    def capture_failed(self, exc: Optional[BaseException], size: int, across_ranks: Optional[str] = None) -> None:
        """Drop every graph and run without them. across_ranks: why, when the ranks agreed on it
        (graph_opt.ranks); exc is then this rank's own error, or None where only a peer failed."""
        self.counters.capture_failures += 1
        self.adapter.after_failed_capture()
        self.release()
        self.disabled_reason = across_ranks or f"capture of size {size} failed: {describe(exc)}"
        logger.warning("%s: %s; running without graphs", self.name, self.disabled_reason)

    def _static_inputs(self, sig: Signature, padded: int, leaves) -> List[Any]:
        """The tensors a graph of size `padded` reads, holding `leaves` (their padding rows the pad values)."""
        adapter = self.adapter
        if not self.config.cudagraph_copy_inputs:
            return list(leaves)
        if sig.buffers is None:
            # Allocated once at the max size; every size reads a view of them, so the addresses a
            # graph captured stay valid for as long as the runner lives.
            sig.buffers = [
                adapter.zeros_like(t, d, self.max_size) if d is not None else adapter.zeros_like(t, None, 0)
                for t, d in zip(leaves, sig.dims)
            ]
            owners = tensor_leaf_owners(sig.spec)
            values = [self.pad_values.get(self.arg_names[o] if isinstance(o, int) and o < len(self.arg_names) else o, 0)
                      for o in owners]
            sig.padding = Padding(adapter, sig.buffers, sig.dims, values)
        views = [b if d is None else adapter.narrow(b, d, padded) for b, d in zip(sig.buffers, sig.dims)]
        self._copy_in(sig, views, leaves, padded)
        return views

    def _copy_in(self, sig: Signature, views, leaves, padded: int) -> None:
        adapter = self.adapter
        real = padded
        for dst, src, d in zip(views, leaves, sig.dims):
            if d is None:
                adapter.copy_(dst, src)
            else:
                real = adapter.shape(src)[d]
                adapter.copy_(adapter.narrow(dst, d, real), src)
        if sig.padding is not None:
            sig.padding.wrote(real)

    def _capture_size(self, sig: Signature, padded: int, leaves) -> CapturedSize:
        adapter = self.adapter
        static = self._static_inputs(sig, padded, leaves)
        if not self.config.cudagraph_copy_inputs:
            for t, d in zip(static, sig.dims):
                if d is not None and adapter.shape(t)[d] != padded:
                    raise CaptureError(
                        f"{self.name}: with cudagraph_copy_inputs=false the inputs used to capture size {padded} "
                        f"must have {padded} rows, got {adapter.shape(t)[d]}"
                    )
        args, kwargs = unflatten(sig.spec, static, template=sig.template)
        if self.pool is None and self.config.use_unique_memory_pool:
            self.pool = adapter.new_pool() if not simulation_enabled() else None
        if not self.model_state.captured:
            self.model_state.snapshot()  # training flags and autocast, as every replay must find them
        mem_before = None if simulation_enabled() else adapter.memory_in_use()
        start = time.perf_counter()
        host = self.host_outputs
        copies = None
        self.model_state.paused = True
        try:
            with _capture_phase(adapter):
                versions = [adapter.version(t) for t in static]
                buffers = self.model_state.buffer_versions()
                warm = None
                for _ in range(self.config.cudagraph_num_of_warmups):
                    warm = self.strategy.warmup(args, kwargs, padded, sig)
                mutated = {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
                sig.static_buffer_writes |= capture_checks.written(buffers, self.model_state.buffer_versions())
                # Before the capture, so that the first size already knows its outputs' batch dims
                # (output sharing and host_outputs rings use them), and on the capture's branch.
                expected = capture_checks.expect(self, sig, static, leaves, padded, warm)
                self._copy_in(sig, static, leaves, padded)
                versions = [adapter.version(t) for t in static]
                buffers = self.model_state.buffer_versions()
                folds = getattr(self.strategy, "folds_tail", False)
                if folds:
                    # The output copies into a larger size's storage and the host copies become the last
                    # nodes of the forward's own graph: one launch per step.
                    if host is not None and warm is not None:
                        copies = host.copies_for_size(adapter, warm, padded, self._batch_dims(sig, warm, padded))
                    captured = self.strategy.capture(args, kwargs, padded, sig, self.pool,
                                                     tail=copies.tail if copies is not None else None,
                                                     share=output_sharing.for_size(adapter, sig, padded))
                else:
                    captured = self.strategy.capture(args, kwargs, padded, sig, self.pool)
                    if host is not None and captured.stable_outputs:
                        copies = host.copies_for_size(adapter, captured.outputs, padded,
                                                      self._batch_dims(sig, captured.outputs, padded))
                        if copies is not None:
                            self._capture_tail(captured, copies)
                mutated |= {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
                sig.static_buffer_writes |= capture_checks.written(buffers, self.model_state.buffer_versions())
                adapter.synchronize()
                sig.observe(output_layout.observe(adapter, captured.outputs, padded))
        finally:
            self.model_state.paused = False
        if mutated:
            sig.mutated = sorted(set(sig.mutated) | mutated)
        self._check_writes_kept(sig)
        if sig.padding is not None:
            sig.padding.touched(padded)
        capture_ms = (time.perf_counter() - start) * 1e3
        mem_after = None if mem_before is None else adapter.memory_in_use()
        memory = None if mem_before is None or mem_after is None else max(0, mem_after - mem_before)
        entry = CapturedSize(
            padded_size=padded,
            sig=sig,
            inputs=static,
            dims=sig.dims,
            copy_inputs=self.config.cudagraph_copy_inputs,
            input_ptrs=[adapter.data_ptr(t) for t in static],
            captured=captured,
            capture_ms=capture_ms,
            memory_bytes=memory,
            copies=copies,
        )
        if self.config.graph_opt_level == 0 and not simulation_enabled():
            entry.host_values = [(i, adapter.clone(t)) for i, (t, d) in enumerate(zip(static, sig.dims))
                                 if d is None and adapter.on_host(t)]
        sig.entries[padded] = entry
        # Checked by finish_captures(), once the ranks agreed that every one captured this size: the
        # check replays, and with several ranks a replay's collectives need every rank.
        entry.pending_check = (leaves, expected)
        self.counters.captures += 1
        self.capture_seconds += capture_ms / 1e3
        if memory is not None:
            self.memory_bytes = (self.memory_bytes or 0) + memory
        return entry

    def finish_captures(self) -> None:
        """Check each size captured since the last call against eager (capture_checks.validate)."""
        for sig in list(self.signatures.values()):
            for entry in list(sig.entries.values()):
                pending, entry.pending_check = entry.pending_check, None
                if pending is not None:
                    capture_checks.validate(self, sig, entry, *pending)

    def _batch_dims(self, sig: Signature, outputs, padded: int) -> list:
        """Each output leaf's batch dimension: learned (output_layout), or before that, dim 0 where it
        has the padded size (the first size of a forward the probes could not run)."""
        if sig.layout.known:
            return sig.layout.dims
        leaves = flatten(outputs, self.adapter.is_tensor)[0]
        return [0 if len(self.adapter.shape(t)) and self.adapter.shape(t)[0] == padded else None for t in leaves]

    def _check_writes_kept(self, sig: Signature) -> None:
        """CaptureError where the plain forward writes an argument or a buffer in place and the captured
        path does not (Paddle's SOT drops writes into its programs' inputs): replays would differ."""
        dropped = sig.eager_writes - set(sig.mutated)
        dropped_buffers = sig.eager_buffer_writes - sig.static_buffer_writes
        if not dropped and not dropped_buffers:
            return
        what = [f"its argument {self._leaf_names(sig.spec)[i]}" for i in sorted(dropped)]
        what += [f"the model's buffer {name!r}" for name in sorted(dropped_buffers)]
        path = getattr(self.strategy, "describe", "the captured path")
        raise CaptureError(
            f"forward writes {' and '.join(what)} in place, and at graph_opt_level={self.config.graph_opt_level} "
            f"{path} does not write it back: a replay (and this level without graphs) would differ from eager. "
            "Use graph_opt_level=0 for this model, or return the new value instead of writing in place")

    def _capture_tail(self, captured: Captured, copies: SizeCopies) -> None:
        """A strategy that cannot end its graph with the host copies: a small graph of them after it."""
        outputs = captured.outputs
        main = captured.replay
        if simulation_enabled():
            def replay():
                main()
                copies.tail(outputs)
        else:
            graph = self.adapter.new_graph(self.pool)
            graph.capture_begin()
            try:
                copies.tail(outputs)
            finally:
                graph.capture_end()
            tail = graph.replay
            captured.keepalive.append(graph)
            captured.graphs += 1

            def replay():
                main()
                tail()
        captured.replay = replay

    # -- bookkeeping -------------------------------------------------------------------------------
    def captured_sizes(self) -> List[int]:
        return sorted({size for sig in self.signatures.values() for size in sig.entries})

    def pieces(self) -> Dict[int, int]:
        return {size: e.captured.pieces for sig in self.signatures.values() for size, e in sig.entries.items()}

    def graphs(self) -> Dict[int, int]:
        return {size: e.captured.graphs for sig in self.signatures.values() for size, e in sig.entries.items()}

    def buffer_bytes(self) -> int:
        return sum(sig.buffer_bytes(self.adapter) for sig in self.signatures.values())

    def release(self) -> None:
        """Drop every graph, buffer and signature; the next capture starts from scratch."""
        for sig in self.signatures.values():
            for entry in sig.entries.values():
                entry.release()
            sig.entries.clear()
            sig.buffers = None
            sig.padding = None
        self.signatures.clear()
        self._sig_numbers = itertools.count(1)
        self.strategy.release()
        self.model_state.release()
        self._warned.clear()
        self.pool = None
        self.memory_bytes = None
        self.capture_model_done = False
        self.adapter.release_memory()


_WARNINGS_PER_KIND = 3
_EAGER_KINDS = frozenset({"replaced", "converted", "hooks"})  # model changes: the plain forward answers
_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, type)


def _opaque_message(opaque: List[str]) -> str:
    return (f"forward argument {', '.join(opaque)}: at graph_opt_level=0 a replay cannot see what the forward "
            "reads from an object (the graph bakes it at capture, and a mutated object looks the same). Pass its "
            "tensors as arguments (or in a dict, list or dataclass), or use graph_opt_level=1, whose guards see it")
_ABSENT = object()
_NO_BATCH = ("no_batch", "a call whose tensors have no batch dimension (dim 0, or dynamic_arg_dims) runs without graphs")


def _show_value(value) -> str:
    if value is _ABSENT:
        return "no such argument"
    if value is TENSOR:
        return "a tensor"
    inner = getattr(value, "value", getattr(value, "obj", value))
    return f"{inner!r} ({type(inner).__name__})"


_FALLBACK_REASONS = {
    "grad": "autograd is enabled: graphs replay only under no_grad, so this call runs without graphs",
    "mismatch": "an input does not match the captured buffers (shape, or address and strides with "
    "cudagraph_copy_inputs=false); this call runs without graphs",
    "host_argument": "a host (CPU) tensor argument holds another value than at capture, and a level-0 graph "
    "keeps the value its kernels were launched with; this call runs without graphs. Pass it as a device "
    "tensor, or use graph_opt_level=1, which runs host operations outside the graphs",
}


@contextlib.contextmanager
def _capture_phase(adapter):
    """Warmups and capture of one size: SOT/Dynamo translate here, on the capture branch of is_capturing().
    One size at a time in the process (guards.state_lock): the flags it sets are process-wide."""
    with guards.state_lock, guards.sot_warmup_guard(True), guards.capture_custom_allreduce(), adapter.no_grad(), \
            adapter.capture_stream():
        yield


# -- level 0: the eager forward, captured whole or in pieces ---------------------------------------
class _SplitStep:
    """A splitting op re-run eagerly between replayed pieces, on the tensors recorded at capture.

    Its result is copied where the next piece's graph reads it: the landing buffers (LandingBuffers).
    An op marked with out= writes it there itself (split.splitting_op); an op that returns a tensor it
    was given needs no copy either.
    """

    def __init__(self, adapter, op, args, kwargs, landed: List[Any], spec):
        self.adapter = adapter
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.landed = landed
        self.spec = spec
        self.single = landed[0] if spec is TENSOR else None  # the common case: one tensor out
        self._with_out()

    def _with_out(self) -> None:
        """The keyword arguments of a replay: an op marked out= also gets the landing buffer."""
        out = self.op.out
        with_out = out is not None and self.single is not None
        self.call_kwargs = dict(self.kwargs, **{out: self.single}) if with_out else self.kwargs

    def weaken(self) -> None:
        """Hold the tensors read from earlier pieces without owning them (see LandingBuffers). A result
        that is one of them becomes the same alias, so that a replay sees it come back and copies nothing."""
        leaves, spec = flatten((self.args, self.kwargs), self.adapter.is_tensor)
        aliases: Dict[int, Any] = {}
        for t in leaves:
            if id(t) not in aliases:
                aliases[id(t)] = self.adapter.weak_alias(t)
        self.args, self.kwargs = unflatten(spec, [aliases[id(t)] for t in leaves], template=(self.args, self.kwargs))
        self.landed = [aliases.get(id(t), t) for t in self.landed]
        self.single = self.landed[0] if self.spec is TENSOR else None
        self._with_out()

    def __call__(self) -> None:
        fresh = self.op.fn(*self.args, **self.call_kwargs)
        dst = self.single
        if dst is not None:
            if fresh is not dst:
                if self.adapter.shape(fresh) != self.adapter.shape(dst):
                    raise self._divergence(fresh)
                self.adapter.copy_(dst, fresh)
            return
        leaves, spec = flatten(fresh, self.adapter.is_tensor)
        if spec != self.spec:
            raise self._divergence(fresh)
        for dst, src in zip(self.landed, leaves):
            if src is not dst:
                self.adapter.copy_(dst, src)

    def _divergence(self, fresh) -> ReplayDivergence:
        return ReplayDivergence(
            f"splitting op {self.op.name!r} returned another structure, shape or non-tensor value at replay "
            "than at capture; the pieces after it baked what it returned at capture"
        )


class LandingBuffers:
    """Where splitting ops' results land, one buffer per (call site, output), shared by every size.

    A piece's graph reads its inputs at fixed addresses, so a splitting op's fresh result is copied
    there at each replay. Sizes are captured largest first and never replay at the same time, so one
    buffer at the largest size serves every size through views. Likewise the tensors a splitting op
    reads from earlier pieces live in the graph pool; from the op's capture on they are held through
    non-owning aliases (adapter.weak_alias), so later pieces and smaller sizes can reuse their blocks.
    Without both, piecewise graph memory grows with every captured size.
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.buffers: Dict[Tuple[int, int], Any] = {}

    def land(self, site: int, index: int, t):
        adapter = self.adapter
        shape = adapter.shape(t)
        if len(shape) == 0:
            return t
        buf = self.buffers.get((site, index))
        if buf is None or adapter.layout(buf) != adapter.layout(t) or adapter.shape(buf)[0] < shape[0]:
            buf = adapter.zeros_like(t, None, 0)
            self.buffers[(site, index)] = buf
        view = adapter.narrow(buf, 0, shape[0])
        if adapter.shape(view) != shape:  # not batch-major: a buffer of its own for this size
            view = adapter.zeros_like(t, None, 0)
        adapter.copy_(view, t)
        return view

    def clear(self) -> None:
        self.buffers.clear()


class _PieceRecorder:
    """Captures the eager forward as device graphs, cut at the selected splitting ops."""

    def __init__(self, adapter, pool, selection: Optional[split.SplitSelection], landing: LandingBuffers):
        self.adapter = adapter
        self.pool = pool
        self.selection = selection
        self.landing = landing
        self.steps: List[Any] = []
        self.graphs: List[Any] = []
        self.splits: List[_SplitStep] = []
        self._open = None
        self.thread = threading.get_ident()  # the split hook is process-wide; other threads run plain

    def begin(self) -> None:
        graph = self.adapter.new_graph(self.pool)
        graph.capture_begin()
        self._open = graph

    def end(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            graph.capture_end()
            self.graphs.append(graph)
            self.steps.append(graph.replay)

    def abort(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.capture_end()
            with contextlib.suppress(Exception):
                graph.reset()
        for g in self.graphs:
            with contextlib.suppress(Exception):
                g.reset()

    def on_split(self, op, args, kwargs):
        selected = self.selection is not None and self.selection.matches_function(op)
        if not selected or threading.get_ident() != self.thread:
            return op.fn(*args, **kwargs)
        self.selection.mark_seen(op.name)
        self.end()
        result = op.fn(*args, **kwargs)
        leaves, spec = flatten(result, self.adapter.is_tensor)
        site = len(self.splits)
        # An op that writes into a tensor it was given and returns it (an attention kernel's output
        # argument) hands back memory the next pieces already read at a fixed address: no landing.
        given = {id(t) for t in flatten((args, kwargs), self.adapter.is_tensor)[0]}
        landed = [t if id(t) in given else self.landing.land(site, i, t) for i, t in enumerate(leaves)]
        returned = unflatten(spec, landed, template=result)
        step = _SplitStep(self.adapter, op, args, kwargs, landed, spec)
        # Held weakly from here on: the model's own references decide when a block read here may be
        # reused, as in eager. Later pieces that reuse it replay after this op; held strongly until the
        # size's capture ended, every such block of every layer would be live at once.
        step.weaken()
        self.splits.append(step)
        self.steps.append(step)
        self.begin()
        return returned


class EagerStrategy:
    """Level 0: capture the eager forward, whole (full_cuda_graph) or split at splitting ops."""

    folds_tail = True  # capture(tail=, share=) records those copies at the end of the last graph

    def __init__(self, call: Callable, adapter, selection: Optional[split.SplitSelection]):
        self.call = call
        self.adapter = adapter
        self.selection = selection  # None: one graph for the whole forward
        self.landing = LandingBuffers(adapter)

    def run(self, args, kwargs):
        return self.call(*args, **kwargs)

    def warmup(self, args, kwargs, padded, sig):
        return self.call(*args, **kwargs)

    def capture(self, args, kwargs, padded, sig, pool, tail: Optional[Callable] = None,
                share: Optional[output_sharing.SharedOutputs] = None) -> Captured:
        if simulation_enabled():
            return self._capture_simulated(args, kwargs, tail, share)
        recorder = _PieceRecorder(self.adapter, pool, self.selection, self.landing)
        with split.active_hook(recorder.on_split if self.selection is not None else None):
            recorder.begin()
            try:
                outputs = self.call(*args, **kwargs)
                if share is not None:
                    kept = share.redirect(outputs)
                    share.copy(outputs, kept)
                    outputs = kept  # this size's own output blocks are free once the capture ends
                if tail is not None:
                    tail(outputs)
                recorder.end()
            except BaseException:
                recorder.abort()
                raise
        steps = tuple(recorder.steps)
        replay = steps[0] if len(steps) == 1 else _run_all(steps)
        pieces = len(recorder.graphs)
        return Captured(outputs, replay, True, pieces, pieces, keepalive=list(recorder.graphs) + recorder.splits)

    def _capture_simulated(self, args, kwargs, tail=None, share=None) -> Captured:
        splits = [0]
        selection = self.selection
        # The split hook is process-wide: a splitting op another thread calls meanwhile runs plain.
        owner = [threading.get_ident()]

        def count_split(op, a, k):
            if selection is not None and selection.matches_function(op) and threading.get_ident() == owner[0]:
                selection.mark_seen(op.name)
                splits[0] += 1
            return op.fn(*a, **k)

        with split.active_hook(count_split):
            outputs = self.call(*args, **kwargs)
        out_leaves, _ = flatten(outputs, self.adapter.is_tensor)
        kept = share.redirect(outputs) if share is not None else None

        def eager_split(op, a, k):
            if selection is None or not selection.matches_function(op) or threading.get_ident() != owner[0]:
                return op.fn(*a, **k)
            with guards.sot_warmup_guard(False), guards._capture_phase_guard(False):
                return op.fn(*a, **k)

        def rerun():
            # Re-run with the capture-time flags: pieces see is_capturing() true, splitting ops false.
            # The flags are process-wide: hold guards.state_lock, as a capture does.
            with guards.state_lock:
                owner[0] = threading.get_ident()
                with guards.sot_warmup_guard(True), guards._capture_phase_guard(True), self.adapter.no_grad():
                    with split.active_hook(eager_split):
                        out = self.call(*args, **kwargs)
                        if kept is not None:
                            share.copy(out, kept)
                        if tail is not None:
                            # as a real graph's tail reads them: the shared rows, and this run's other outputs
                            tail(share.merged(out, kept) if kept is not None else out)
                        return out

        graph = HostGraph(self.adapter, rerun, out_leaves)
        pieces = splits[0] + 1
        return Captured(outputs if kept is None else kept, graph.replay, True, pieces, pieces, keepalive=[graph])

    def release(self) -> None:
        self.landing.clear()


def _aliased(adapter, leaves) -> bool:
    """Whether two tensors share their first element's address (the same tensor, or views of it)."""
    ptrs = [adapter.data_ptr(t) for t in leaves]
    return len(set(ptrs)) != len(ptrs)


@functools.lru_cache(maxsize=None)
def _all_tensors_spec(n: int):
    """flatten()'s spec of (args, {}) where args are n tensors."""
    leaf = object()
    return flatten(((leaf,) * n, {}), lambda x: x is leaf)[1]


def _run_all(steps):
    def replay():
        for step in steps:
            step()

    return replay
