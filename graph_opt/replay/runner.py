"""Per-size CUDA-graph runtime, framework-neutral: GraphRunner dispatches, pads, copies and replays.

A call follows GraphRunner.__call__ -> CapturedSize.run (captured_size.py): flatten the arguments,
look the padded size up in a table, copy the real rows into static buffers, replay, return views of
the captured outputs. Nothing on that path logs or allocates device memory. The common call (every
argument a positional tensor) takes a shortcut once its size has replayed: fast_replay.py.

Beside the dispatch, in their own files and held by GraphRunner: its call signatures and the checks of
calls that do not fit them (SignatureTable, signature.py), warmup -> capture of one size (Capturer,
capture_phase.py).
How a size is captured is a strategy's business: EagerStrategy (level 0, level0.py) captures the eager
forward; the static strategies (level >= 1) live in backends/ because they hook the framework's
translator. The runner does not care which: it trusts the strategy it is given.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..capture import ranks
from . import static_address
from ..capture.capture_phase import Capturer
from ..capture.lazy_capture import CallCaptures
from .captured_size import _ALIASED, _HOST_VALUE, _MISMATCH, _MOVED, in_place
from ..errors import GraphOptError, GuardFailed, ReplayDivergence
from ..watch.fallbacks import Fallback, Reason
from ..guards import capture_phase_in_this_thread
from .fast_replay import MISS, FastReplay, plan_for
from .handed_outputs import HandedOutputs
from .host_outputs import HostRingFull
from ..pytree import flatten
from ..watch.replay_guards import ModelState, Unwatched
from .signature import Signature, SignatureTable
from .sizes import PaddingTable
from ..stats import Counters

logger = logging.getLogger("graph_opt")


class GraphRunner:
    """Dispatch, pad, copy and replay for one model; capture sizes on demand (its Capturer)."""

    def __init__(self, *, adapter, config, strategy, eager: Callable, dynamic_arg_dims,
                 params: Sequence[Tuple[str, Any]], name: str, host_outputs=None, guard=None, warned=None,
                 keyword_defaults: Sequence[Tuple[str, Any]] = (),
                 model_state: Optional[ModelState] = None, pad_values: Optional[Dict[str, Any]] = None,
                 on_capture_failure: Optional[Callable] = None):
        self.adapter = adapter
        # on_capture_failure(runner, exc, size): the model's offer to take a failed capture over
        # (graph_opt.capture.level_switch); True when it did, and this runner is then dropped.
        self.on_capture_failure = on_capture_failure
        self.host_outputs = host_outputs  # HostOutputs whose copies captured sizes make in their graphs
        self.config = config
        self.strategy = strategy
        # A strategy whose path without graphs cannot be trusted with autograd: such calls run the plain forward.
        self._eager_with_grad = strategy is not None and not strategy.traits.runs_autograd
        # The plain forward, without the module's hooks (the decorated call runs those around the
        # runner): what runs once a capture has failed, and what capture_checks probes.
        self.eager = eager
        self.params = list(params)
        self.name = name
        self.signatures = SignatureTable(adapter=adapter, config=config, name=name, params=params,
                                         keyword_defaults=keyword_defaults, dynamic_arg_dims=dynamic_arg_dims,
                                         pad_values=pad_values)
        self.canonical = self.signatures.canonical
        # Training flags, autocast, replaced parameters, level-0 attributes: checked before every replay.
        self.model_state = model_state if model_state is not None else Unwatched()
        self.table = PaddingTable(config.capture_sizes)
        self.max_size = self.table.max_size
        self.counters = Counters()
        self.fallback_reasons: Dict[str, int] = {}  # why calls ran without graphs, by kind
        self.disabled_reason: Optional[str] = None
        self.capture_model_done = False
        self.group = None  # the ranks that agree on every replay (graph_opt.capture.ranks), set when capturing
        self._warned: set = warned if warned is not None else set()  # warnings said; a model's kinds share one
        self._is_tensor = adapter.is_tensor
        # Held by the call (and capture_model, clear_graphs) using the static buffers. Calls from two
        # threads at once would copy into and replay from the same buffers, and each returns views of
        # the same output tensors: the second one is refused (non-blocking acquire: no waiting, no
        # allocation). Re-entrant, so the forward or make_inputs may call the model on the same thread.
        # Runners of one model's graph kinds (graph_opt.replay.dispatch) share one.
        self.guard = guard if guard is not None else threading.RLock()
        self._acquire = self.guard.acquire
        self._release = self.guard.release
        self.shortcut: Optional[FastReplay] = None  # the common call's shortcut, once one of its sizes replayed
        self.fast: Optional[Callable] = None  # its call(args), or None
        # The other graph kind of the same model (graph_opt.replay.dispatch): it shares this runner's model state,
        # which a failure here releases, so it stops with this one (disable()).
        self.siblings: List["GraphRunner"] = []
        # The outputs of earlier replays a caller may still hold (shared with the siblings: one pool).
        self.handed = HandedOutputs(adapter, config.keep_outputs, self._model_tensors)
        self.capturer = Capturer(self)
        self.at_calls = CallCaptures(self.capturer)  # sizes captured at a call, not by capture_model

    # -- capture (the capturer's; the interface capture_model and graph_opt.replay.dispatch use) --------------
    def capture(self, args, kwargs, size: int):
        return self.capturer.capture(args, kwargs, size)

    def check_capture_inputs(self, args, kwargs, size: int):
        return self.capturer.check_capture_inputs(args, kwargs, size)

    def capture_checked(self, sig: Signature, leaves, size: int):
        return self.capturer.capture_checked(sig, leaves, size)

    def finish_captures(self) -> None:
        self.capturer.finish_captures()

    def capture_failed(self, exc: Optional[BaseException], size: int, across_ranks: Optional[str] = None) -> None:
        self.capturer.capture_failed(exc, size, across_ranks)

    def batch_disagreement(self, args, kwargs) -> Optional[str]:
        return self.signatures.batch_disagreement(args, kwargs)

    @property
    def capture_notes(self) -> List[str]:
        return self.capturer.capture_notes

    @property
    def capture_seconds(self) -> float:
        return self.capturer.capture_seconds

    @property
    def memory_bytes(self) -> Optional[int]:
        return self.capturer.memory_bytes

    @property
    def pool(self):
        return self.capturer.pool

    def _model_tensors(self) -> list:
        """The model's parameters and buffers (none where the runner has no model: tests of the core)."""
        model = getattr(self.model_state, "model", None)
        return [] if model is None else self.adapter.model_tensors(model)

    # -- hot path ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        fast = self.fast
        if fast is not None and not kwargs:
            out = fast(args)
            if out is not MISS:
                return out
        return self.full_call(args, kwargs)

    def full_call(self, args, kwargs):
        """Any call, without the shortcut (the decorated class's __call__ tried it already)."""
        if capture_phase_in_this_thread():
            # Called while another model's size is being captured (this model is its submodule, called
            # from its forward): that graph records this model's work. A replay cannot run inside a
            # capture ("Cannot prepare for replay during capturing stage"), nor a graph of this model be
            # captured in another's. Not a fallback: the caller's graph holds it.
            return self.eager(*args, **kwargs)
        if self.disabled_reason is not None:
            return self._disabled_call(args, kwargs)
        if not self._acquire(False):
            raise self.busy_error()
        try:
            return self._dispatch(args, kwargs)
        finally:
            self._release()

    def _dispatch(self, args, kwargs):
        positional = not kwargs and len(args) == len(self.params) and all(map(self._is_tensor, args))
        if positional:
            # The common call, m(x) or m(x, lens): its spec is known without walking the arguments.
            leaves, spec = list(args), _all_tensors_spec(len(args))
        else:
            if kwargs or len(args) < len(self.params):
                args, kwargs = self.canonical(args, kwargs)
            leaves, spec = flatten((args, kwargs), self._is_tensor)
        sig = self.signatures.get(spec)
        if sig is None:
            refusal = self.signatures.refusal(spec, self.capture_model_done)
            sig = None if refusal is not None else self.signatures.make(spec, leaves, args, kwargs, lazy=True)
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
                raise self.signatures.bad_call(sig, leaves, self.signatures.misfit(sig, leaves, "argument"))
            return self._fallback(args, kwargs, self._above_max(real) if real > self.max_size else None)
        if self.adapter.grad_enabled():
            return self._fallback(args, kwargs, _GRAD)
        state = self.model_state
        # Never capture or replay in another mode than captured (training flag, autocast, ...).
        blocked = state.check() if state.captured else None
        group = self.group
        entry = sig.entries.get(padded)
        if entry is None:
            if blocked is None and sig.in_place and sig.buffers is not None \
                    and in_place(self.adapter, sig.in_place, sig.buffers, leaves) is None:
                blocked = Fallback(Reason.MOVED, self._moved(sig, leaves))  # a capture would read the marked tensor
            if group is not None:  # every rank captures lazily, or none does
                blocked = ranks.agree_on_replay(group, blocked)
            if blocked is not None:
                return self._fallback(args, kwargs, blocked)
            misfit = self.signatures.misfit(sig, leaves, "argument")
            if misfit is not None:
                if misfit[0] != "shape":
                    raise self.signatures.bad_call(sig, leaves, misfit)
                return self._fallback(args, kwargs, _MISMATCH_CALL)
            refusal = self.at_calls.refusal()
            if refusal is not None:
                return self._fallback(args, kwargs, refusal)
            entry = self.at_calls.capture(sig, padded, real, leaves)
            if entry is None:
                if self.disabled_reason is not None:  # the capture failed
                    return self._disabled_call(args, kwargs)
                return self._fallback(args, kwargs, None)
        if blocked is None:
            check = entry.captured.check
            if check is not None:
                blocked = check()
            if blocked is None and real != padded and sig.layout.exact_only:
                blocked = Fallback(Reason.OUTPUTS, f"a call of {real} rows would replay size {padded}, and "
                                                   f"{sig.layout.why_exact_only()}; calls of a size that is not "
                                                   "captured run without graphs")
        if group is not None:  # a replay runs on every rank or on none: their collectives must match
            blocked = ranks.agree_on_replay(group, blocked)
        if blocked is not None:
            return self._fallback(args, kwargs, blocked)
        try:
            out = entry.run(self.adapter, leaves, real)
        except HostRingFull:
            raise  # the caller's error, found before anything ran: the graphs are fine
        except Exception as exc:
            return self.replay_raised(exc, padded, args, kwargs, sig)
        if out is _ALIASED:
            return self._fallback(args, kwargs, _ALIASED_CALL)
        if out is _HOST_VALUE:
            name = self.signatures.leaf_names(sig.spec)[entry.host_changed]
            return self._fallback(args, kwargs, Fallback(
                Reason.HOST_ARGUMENT, f"argument {name} {_HOST_ARGUMENT}", (Reason.HOST_ARGUMENT, name)))
        if out is _MOVED:
            return self._fallback(args, kwargs, Fallback(Reason.MOVED, self._moved(sig, leaves)))
        if out is _MISMATCH:
            # The slow path: a rank or dtype the graph cannot take is the caller's error; another
            # non-batch shape (or, without copied inputs, another address or strides) runs without graphs.
            misfit = self.signatures.misfit(sig, leaves, "argument")
            if misfit is not None and misfit[0] != "shape":
                raise self.signatures.bad_call(sig, leaves, misfit)
            return self._fallback(args, kwargs, _MISMATCH_CALL)
        self.counters.replays += 1
        if positional and real not in sig.plans:
            self._keep_plan(sig, entry, real)
        return out

    def _above_max(self, real: int) -> Fallback:
        """A call of more rows than the largest capture size: one warning per model (until clear_graphs),
        naming the size of the call it is said at; the text is made only then."""
        if _ABOVE_MAX_KEY in self._warned:
            return _ABOVE_MAX_SAID
        return Fallback(
            Reason.ABOVE_MAX, f"a call of {real} rows is above the largest capture size, {self.max_size}: capture "
            "larger sizes if such calls are common (max_capture_size or cudagraph_capture_sizes in "
            "graph_opt_config); calls above it run without graphs", _ABOVE_MAX_KEY)

    def _moved(self, sig: Signature, leaves) -> str:
        names = self.signatures.leaf_names(sig.spec)
        marked = sig.buffers
        moved = [names[i] for i in sorted(sig.in_place)
                 if leaves[i] is not marked[i] and not static_address.same_memory(self.adapter, leaves[i], marked[i])]
        return (f"argument {', '.join(moved)} is marked with mark_static_address, and this call passes another tensor "
                "there (another address, shape, strides or dtype) than the one the graphs read in place (pass that "
                "one at every call); this call runs without graphs")

    def _keep_plan(self, sig: Signature, entry, real: int) -> None:
        """After a replay of the common call: its plan, so that the next such call skips the lookups (fast_replay.py)."""
        plan = plan_for(self, sig, entry, real)
        if plan is not None:
            sig.plans[real] = plan
            if self.shortcut is None or self.shortcut.sig is not sig:
                self.shortcut = FastReplay(self, sig)
                self.fast = self.shortcut.call

    def replay_raised(self, exc: Exception, padded: int, args, kwargs, sig: Signature):
        """A replay raised: a guard that failed inside it or a splitting op that diverged run this call
        without graphs; anything else is _replay_failed's. Not where the forward writes a marked argument:
        the part of the replay that ran may have written it, and the plain forward would write it again."""
        written = sig.in_place & (set(sig.mutated) | sig.eager_writes)
        if written:
            reason = f"replay of size {padded} failed: {type(exc).__name__}: {exc}"
            self.counters.replay_failures += 1
            self.disable(reason)
            names = self.signatures.leaf_names(sig.spec)
            raise GraphOptError(
                f"{self.name}: {reason}. The forward writes argument {', '.join(names[i] for i in sorted(written))} "
                "in place, which is marked with mark_static_address: the replay may have written it before it "
                "failed, so the call cannot be answered by running the forward again without writing it twice. "
                "The graphs are dropped (clear_graphs() and capture_model() capture again)") from exc
        if isinstance(exc, GuardFailed):
            return self._fallback(args, kwargs, Fallback(Reason.GUARD, exc.guard))
        if isinstance(exc, ReplayDivergence):
            return self._fallback(args, kwargs, Fallback(Reason.DIVERGENCE, f"{exc}; this call runs without graphs"))
        return self._replay_failed(exc, padded, args, kwargs)

    def _disabled_call(self, args, kwargs):
        """A call after a failed capture or replay: the translated path is suspect too, so the plain forward."""
        self.counters.fallbacks += 1
        self.fallback_reasons[Reason.DISABLED] = self.fallback_reasons.get(Reason.DISABLED, 0) + 1
        return self.eager(*args, **kwargs)

    def _fallback(self, args, kwargs, why: Optional[Fallback]):
        """Run this call without graphs. why: counted in stats().fallback_reasons under its reason, with
        one warning per warn_key (default: reason and message); None for the silent, expected cases (a
        batch of 0 rows)."""
        self.counters.fallbacks += 1
        if why is not None:
            reason, message = why.reason, why.message
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
            self._warn_once(why.warn_key or (reason, message), message)
            if self._eager_for(why):
                return self.eager(*args, **kwargs)
        state = self.model_state
        if state.captured:  # any other fallback (autograd on, a size above the max) after such a change too
            changed = state.check()
            if changed is not None and self._eager_for(changed):
                return self.eager(*args, **kwargs)
        if self._eager_with_grad and self.adapter.grad_enabled():
            return self.eager(*args, **kwargs)
        return self.strategy.run(args, kwargs)

    def _eager_for(self, why: Fallback) -> bool:
        """Whether such a call runs the plain eager forward, not the translated one without graphs: the
        translated code would read what changed as at capture (fallbacks.EAGER); an ambient change too
        where the translator does not follow it (Paddle's SOT)."""
        return why.eager or why.reason is Reason.AMBIENT and not self.adapter.static_follows_ambient

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
        self.disable(f"replay of size {padded} failed: {type(exc).__name__}: {exc}")
        logger.warning("%s: %s; running without graphs (clear_graphs() and capture_model() capture again)",
                       self.name, self.disabled_reason)
        return out

    def disable(self, reason: str) -> None:
        """Drop every graph and run without them, this runner and its siblings (they share the model state)."""
        for runner in [self] + self.siblings:
            if runner is self or runner.disabled_reason is None:
                runner.release()
                runner.disabled_reason = reason

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
        logger.warning("%s: %s%s", self.name, message,
                       "" if message.endswith("without graphs") else "; this call runs without graphs")

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
                static_address.restore(self.adapter, entry.restore)  # a capture dropped before its check
                entry.release()
            sig.entries.clear()
            sig.plans.clear()
            sig.buffers = None
            sig.padding = None
        self.signatures.release()
        self.shortcut = self.fast = None
        self.handed.release()
        self.strategy.release()
        self.model_state.release()
        self._warned.clear()
        self.capturer.release()
        self.at_calls.release()
        self.capture_model_done = False
        self.adapter.release_memory()


_WARNINGS_PER_KIND = 3
_ABOVE_MAX_KEY = (Reason.ABOVE_MAX,)
_ABOVE_MAX_SAID = Fallback(Reason.ABOVE_MAX, "", _ABOVE_MAX_KEY)  # counted; its warning was said
# The plain forward answers these: model changes (the static path would not see them), and aliased
# arguments (rare; a translator would compile the forward once more for the aliasing, and Inductor
# has failed to do so: an IndexError building its shape guards, measured on an H100).
_NO_BATCH = Fallback(Reason.NO_BATCH, "a call whose tensors have no batch dimension (dim 0, or dynamic_arg_dims) "
                                       "runs without graphs")
_GRAD = Fallback(Reason.GRAD, "autograd is enabled: graphs replay only under no_grad, so this call runs without graphs")
_ALIASED_CALL = Fallback(
    Reason.ALIASED, "the forward writes a tensor argument in place that shares memory with another argument, with "
    "itself (an expanded tensor) or with the outputs of the last replay (fed back): the graph reads and writes "
    "separate buffers, so this call runs without graphs")
_MISMATCH_CALL = Fallback(
    Reason.MISMATCH, "an input does not match the captured buffers (shape, or address and strides "
    "with cudagraph_copy_inputs=false); this call runs without graphs")
_HOST_ARGUMENT = ("is a host (CPU) tensor holding other values than at capture, and a level-0 graph keeps what "
                  "its capture read of it on the host; this call runs without graphs. Pass it as a device tensor, or "
                  "use graph_opt_level=1, which runs host operations outside the graphs")


@functools.lru_cache(maxsize=None)
def _all_tensors_spec(n: int):
    """flatten()'s spec of (args, {}) where args are n tensors."""
    leaf = object()
    return flatten(((leaf,) * n, {}), lambda x: x is leaf)[1]
