"""GraphedBlock: the state of one autocudagraph target (its keys' graphs, one memory pool, counters),
its call (warm up, capture, replay, or run eagerly) and the replays autograd runs through the bridges.

It holds the watch of its module (watch.py, `block.watch`) and the capture of its keys (key_capture.py,
`block.capturer`); how a key's graphs are recorded is graphs.py's. The guarantees are stated in api.py.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import backends, env, guards
from ..backends import patches
from ..watch.arguments import TooLarge, argument_names, host_positions, tensors_by_value, too_large_message
from ..capture.capture_phase import paused_gc
from ..contracts import DataParallel
from ..errors import GraphOptError, GraphOptInputError
from ..watch.fallbacks import Reason, reason_counts
from ..capture.failures import describe
from ..recorders.host_graphs import graphs_for, simulation_enabled
from ..replay.host_outputs import pending_copies as _pending_host_copies, land_pending_copies
from ..pytree import flatten, unflatten
from ..stats import TrainingCounters, TrainingStats
from .graphs import KeyState, PartialBackward, PendingBackward, StepGraphs, _record_partial
from .key_capture import KeyCapturer
from .levels import KeyLevels
from .slots import Slot, call_in_slot
from .watch import TrainingWatch, framework_of_call

logger = logging.getLogger("graph_opt")


class GraphedBlock:
    """State of one autocudagraph target: its keys' graphs, one memory pool, counters."""

    def __init__(self, target, call: Callable, module, framework: Optional[str], warmup_steps: int,
                 dispatch_key_fn: Optional[Callable], max_graphs: int, level: Optional[int] = 0):
        self.target = target
        self.call = call  # the eager forward
        self.level = level or 0  # None: the default, 0 with keys traced where a host copy stops a capture
        self.module = module  # the Layer / Module, or None for a function
        self.name = getattr(target, "__qualname__", None) or type(target).__name__
        self.warmup_steps = warmup_steps
        self.dispatch_key_fn = dispatch_key_fn
        self.max_graphs = max_graphs
        self.disabled = env.disabled()
        self.framework = framework
        # (is a compiler tracing now, dispatch hidden from it): see __call__. A graphed function's
        # framework is known at its first call; torch's Dynamo may trace around it before that.
        self.tracing, self.opaque = None, self.dispatch
        traced_by = framework or ("torch" if "torch" in sys.modules else None)
        if traced_by is not None and not self.disabled:
            self.tracing, self.opaque = backends.load(traced_by).tracing_hooks(self.dispatch)
        self.bridge = None
        self.adapter = None
        self.keys: Dict[Any, KeyState] = {}
        self.counters = TrainingCounters()
        # Per depth of pending backwards: a memory pool, the pending backward, the forward replays (slots.py)
        self.slots: List[Slot] = [Slot()]
        self.slot_now = 0  # the slot a capture records into: `pool` is its pool
        self.memory_bytes: Optional[int] = None
        self.epoch = 0  # releases of the graphs so far
        self.lent: List[Tuple[Any, Any]] = []  # (leaf, gradient buffer) handed out by the last backward
        self.watch: Optional[TrainingWatch] = None  # a module's: made at binding
        self.params: List[Any] = []  # trainable parameters, passed to apply() after the inputs
        self.grad_nodes: dict = {}  # the bridge's per-parameter lookups (hand_out)
        self.data_parallel = DataParallel()  # what a data-parallel wrapper around it asks (api._graph_wrapped)
        self.lazy = False  # the module had lazy parameters when bound: graphs wait until they are made
        self.disabled_reason: Optional[str] = None
        self.warned: set = set()
        self.levels = KeyLevels(self, level)
        self.capturer = KeyCapturer(self)

    @property
    def pool(self):
        return self.slots[self.slot_now].pool

    @pool.setter
    def pool(self, value) -> None:
        self.slots[self.slot_now].pool = value

    @property
    def pending(self) -> int:
        """Forward replays whose backward has not run yet (one per slot at most)."""
        return sum(s.pending for s in self.slots)

    def __deepcopy__(self, memo):
        """A deep copy of a graphed Layer / Module (an EMA twin, say) gets a block of its own, with no
        graphs: graphs and pools cannot be copied, and the copy's parameters live elsewhere."""
        if self.module is None:
            return self  # a graphed function: functions are not copied
        twin = memo.get(id(self.module))
        if twin is None:
            raise GraphOptError(f"{self.name}: copy the graphed {type(self.module).__name__} itself, not its forward")
        eager = type(twin).forward.__get__(twin)
        block = GraphedBlock(twin, eager, twin, self.framework, self.warmup_steps, self.dispatch_key_fn,
                             self.max_graphs, self.levels.requested)
        memo[id(self)] = block
        return block

    def __reduce__(self):
        """Pickling a graphed Layer / Module (torch.save): the copy is graphed, with no graphs yet."""
        if self.module is None:
            raise TypeError(f"{self.name}: a graphed function cannot be pickled; pickle the function it wraps")
        return _rebuilt_block, (self.module, self.warmup_steps, self.dispatch_key_fn, self.max_graphs,
                                self.levels.requested)

    def _bind(self, args, kwargs) -> None:
        """At the first call: the framework of the tensors, its bridges, and the watch of the module."""
        framework = self.framework or framework_of_call(args, kwargs, self.name)
        backend = backends.load(framework)
        self.framework = framework
        self.adapter = backend.ADAPTER
        self.bridge = backend.autograd_bridge()
        self.levels.bind()
        if self.module is not None:
            self.watch = TrainingWatch(self.adapter, self.bridge, self.module)
            self.lazy = self.bridge.uninitialized(self.module)
            self.params = self.bridge.trainable_parameters(self.module)
            self.grad_nodes = {id(p): (p, None) for p in self.params}
            if not self.lazy:
                self.watch.arm()

    # -- the call ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        # Inside the capture phase of a model decorated for inference (this block a submodule of it), or its
        # host stand-in's replay: that graph records the eager forward, as a graph cannot capture another.
        if self.disabled or guards.is_capturing():
            return self.call(*args, **kwargs)
        if self.tracing is not None and self.tracing():
            # A compiler traces a model around this block (torch.compile, a decorated model's level >= 1):
            # it breaks its graph here and calls the block, which replays graphs of its own.
            return self.opaque(*args, **kwargs)
        return self.dispatch(*args, **kwargs)

    def dispatch(self, *args, **kwargs):
        if self.bridge is None:
            self._bind(args, kwargs)
        bridge = self.bridge
        if bridge.saved_tensor_hooks_active():
            return self._fallback(Reason.SAVED_TENSOR_HOOKS, args, kwargs,
                                  f"{self.name}: called with saved-tensor hooks on (torch.utils.checkpoint, "
                                  "activation offloading): they keep the activations themselves, so these calls "
                                  "run eagerly")
        if self.module is not None and self.lazy and bridge.uninitialized(self.module):
            return self._fallback(Reason.LAZY_PARAMETERS, args, kwargs, None)  # LazyLinear: shapes known after a call
        leaves, spec = flatten((args, kwargs), bridge.is_tensor)
        hosts = host_positions(self.adapter, leaves)
        by_value = tensors_by_value(self.adapter, leaves, hosts) if hosts else ()
        if by_value.__class__ is TooLarge:
            return self._fallback(Reason.HOST_ARGUMENT, args, kwargs, too_large_message(self.name, spec, by_value, self.call))
        key = self._key(spec, leaves, args, kwargs, by_value)
        state = self.keys.get(key)
        if state is None:
            if len(self.keys) >= self.max_graphs:
                return self._fallback(Reason.MAX_GRAPHS, args, kwargs, self._max_graphs_message(spec, hosts))
            state = self.keys[key] = KeyState()
        if state.graphs is not None or state.twins and state.all_graphs():
            if self.watch is not None and self.watch.moved():
                self.recapture()
            else:  # replayed in a slot no pending backward holds (slots.py)
                return call_in_slot(self, state, leaves, spec, args, kwargs, key[1])
        if state.failed is not None:
            return self._fallback(Reason.CAPTURE_FAILED, args, kwargs, None)
        if not self._graphs_available():
            return self._fallback(Reason.NO_GRAPHS, args, kwargs,
                                  f"{self.name}: CUDA graphs are unavailable here ({self.adapter.name} without "
                                  "a CUDA device); autocudagraph runs eagerly")
        if state.run is None:
            if self.levels.eager_only(state):
                state.run = self.call
            else:
                return self.levels.first_call(state, key[1], args, kwargs)
        if state.warmups < self.warmup_steps or key[1] and not self.data_parallel.ready():  # key[1]: needs grad
            state.warmups += 1
            self.counters.warmups += 1
            if state.level:
                return self.levels.warm_up(state, args, kwargs, key[1])
            return self._eager(self.call, args, kwargs)
        return call_in_slot(self, state, leaves, spec, args, kwargs, key[1])

    def _own_changed_call(self, state: KeyState, args, kwargs):
        """An attribute the forward writes itself holds another value than at this key's capture: this
        call runs eagerly. Where its run leaves them as they were (another key's or an eval call's
        bookkeeping, a cache grown elsewhere), the key's graphs are captured again from them at its next
        call; where it sets them (`self.rows = x.shape[0]` after another key's call), such calls stay eager."""
        before = self.watch.own_values()
        out = self._fallback(Reason.FORWARD_STATE, args, kwargs, _OWN_WARNING.format(
            name=self.name, what=", ".join(self.watch.own_changed(state)[:3])))
        if state.graphs is not None and self.watch.own_values() == before:
            state.graphs.release()
            state.graphs = None
            self.counters.recaptures += 1
        return out

    def _replay(self, graphs: StepGraphs, leaves, needs_grad: bool):
        if needs_grad:
            outs = self.bridge.apply(self, graphs, graphs.handed(leaves + self.params + graphs.outside))
        else:
            outs = self.forward_replay(graphs, leaves)
        return unflatten(graphs.out_spec, list(outs), template=graphs.out_template)

    def forward_replay(self, graphs: StepGraphs, tensors):
        """Copy the inputs in, replay the forward graph, return copies of the outputs (a caller may keep
        them; the next replay rewrites the buffers)."""
        if self.lent:
            self.reclaim()
        if _pending_host_copies:
            land_pending_copies()
        copy_ = self.adapter.copy_
        for dst, src in zip(graphs.static_inputs, tensors):
            copy_(dst, src)
        graphs.forward.replay()
        self.slots[graphs.slot].generation += 1
        self.counters.replays += 1
        clone = self.bridge.clone
        return [clone(b) for b in graphs.out_buffers]

    def forward_for_grad(self, ctx, graphs: StepGraphs, tensors):
        """The body of the Function / PyLayer forward (each bridge's `_ReplayStep`): replay, and leave
        on ctx what its backward needs. Returns the outputs, those without a gradient marked so."""
        outs = self.forward_replay(graphs, tensors)
        ctx.set_materialize_grads(False)  # an output the loss does not use comes back None, not zeros
        ctx.block, ctx.graphs = self, graphs
        ctx.pending = PendingBackward(self, tensors, graphs.slot) if graphs.backward is not None else None
        fixed = [o for o, d in zip(outs, graphs.differentiable) if not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    def backward_for_grad(self, ctx, grads):
        """The body of the Function / PyLayer backward: one gradient per input tensor."""
        graphs = ctx.graphs
        wanted = [g for g, d in zip(grads, graphs.differentiable) if d]
        return self.backward_replay(graphs, ctx.pending, wanted)

    def backward_replay(self, graphs: StepGraphs, pending: PendingBackward, grads):
        try:
            return self._backward_replay(graphs, pending, grads)
        except BaseException:
            pending.release()  # a backward that raised is not waited for: later calls replay again
            raise

    def _backward_replay(self, graphs: StepGraphs, pending: PendingBackward, grads):
        if pending.generation != pending.slot.generation or graphs.backward is None:
            raise GraphOptError(
                f"{self.name}: backward through a graphed forward whose activations a later forward replay "
                "overwrote (or whose graphs were cleared); run each step's backward before the next forward "
                "of this block")
        if graphs.root is not None and grads[graphs.root] is None:
            self._root_left_out(graphs)
        if sum(map(self.adapter.version, self.params)) != pending.versions:
            raise RuntimeError(
                f"{self.name}: one of the variables needed for gradient computation has been modified by an inplace "
                "operation: a parameter of the graphed block changed in place (an optimizer step) between this "
                "forward and its backward, which eager autograd refuses too. Run the backward before the "
                "parameters change")
        if self.lent:
            self.reclaim()
        copy_ = self.adapter.copy_
        part = None
        left_out = graphs.reached_from is not None and any(g is None for g in grads)  # not `None in`: == per tensor
        if left_out:  # the loss left some outputs out
            used = tuple(g is not None for g in grads)
            part = graphs.partial[used] if used in graphs.partial else self._capture_partial(graphs, used)
        if part is not None:
            for buf, g in zip(graphs.grad_out_buffers, grads):
                if g is not None:
                    copy_(buf, g)
            part.graph.replay()
            buffers = part.grad_buffers
        else:
            zero_ = self.bridge.zero_
            for buf, g in zip(graphs.grad_out_buffers, grads):
                if g is None:
                    zero_(buf)
                else:
                    copy_(buf, g)
            graphs.backward.replay()
            buffers = graphs.grad_buffers
            if left_out:  # that set's own capture failed
                unused = [g is None for g in grads]
                buffers = [None if b is None or all(unused[i] for i in outs) else b
                           for b, outs in zip(buffers, graphs.reached_from)]
        buffers = graphs.handed(buffers)  # one per apply() input
        self.counters.backward_replays += 1
        if not self.bridge.keeps_graph():  # retain_graph=True: a second backward may read the activations
            pending.release()
        return self.bridge.hand_out(buffers, pending.inputs, self.lent, self.grad_nodes)

    def _root_left_out(self, graphs: StepGraphs) -> None:
        """A loss that leaves out the output computed from all the others, at a traced level: the traced
        backward would run the root's backward on zeros too, which is eager's only where it makes no
        0 * inf. Refused; that key's next call is captured from the eager forward."""
        for key_state in self.keys.values():
            states = (key_state, *key_state.twins)
            if any(st.graphs is graphs for st in states):
                for st in states:  # every slot's graphs of the key: each would take the same zeros
                    if st.graphs is not None and st.graphs is not graphs:
                        st.graphs.release()
                    st.graphs = None
                key_state.run, key_state.level, key_state.root = self.call, 0, None
        graphs.release()
        raise GraphOptError(
            f"{self.name}: this backward leaves out the output the others feed (output {graphs.root} of those "
            "carrying gradients: a loss computed inside the block), which the traced backward would run on zero "
            "gradients, where eager runs nothing (NaN where that makes 0 * inf). Return only what the loss uses "
            "(a Hugging Face model: call it without labels= when the loss is yours), or use level=0; this key's "
            "next call is captured from the eager forward")

    def _capture_partial(self, graphs: StepGraphs, used) -> Optional["PartialBackward"]:
        """Capture, inside the first backward that leaves some outputs out, a backward graph of the used
        outputs alone (the full one with zeros for the others would give NaN where their backward makes
        0 * inf); the forward replay just ran, so nothing else is in flight."""
        adapter = self.adapter
        start = time.perf_counter()
        part = None
        self.slot_now = graphs.slot  # into the pool of the slot whose forward it differentiates
        try:
            with guards.state_lock, paused_gc(collect=False), adapter.capture_stream():
                part = _record_partial(self, graphs, used)
        except GraphOptError:
            raise
        except Exception as exc:  # noqa: BLE001 - the full graph serves that set, with a warning
            adapter.after_failed_capture()
            logger.warning("%s: capturing the backward of a loss that leaves some outputs out failed; such "
                           "backwards replay the full graph with zero gradients for those outputs (NaN where "
                           "their backward makes 0 * inf): %s", self.name, describe(exc))
        finally:
            self.slot_now = 0
        graphs.partial[used] = part
        self.counters.capture_seconds += time.perf_counter() - start
        return part

    def reclaim(self) -> None:
        """Give leaves still holding a lent gradient buffer as .grad a copy of their own, before a replay
        (of any key: they share the pool) rewrites it."""
        data_ptr = self.adapter.data_ptr
        for t, buf in self.lent:
            grad = t.grad
            if grad is not None and data_ptr(grad) == data_ptr(buf):
                self.bridge.set_grad(t, self.bridge.clone(grad))
        self.lent.clear()

    def _eager(self, run: Callable, args, kwargs):
        if self.watch is None:
            return run(*args, **kwargs)
        return self.watch.eager(run, args, kwargs)

    def recapture(self, quiet: bool = False) -> None:
        """quiet: nothing was captured yet, so only what is watched changes (no warning, no count)."""
        if not quiet:
            self.counters.recaptures += 1
            if "recapture" not in self.warned:
                self.warned.add("recapture")
                logger.warning("%s: a parameter, buffer or submodule was replaced or added after capture (a new "
                               "tensor, its data swapped, a new submodule), a parameter frozen or unfrozen, a plain "
                               "attribute of the module or a submodule set to another value (a dropout's p), or a "
                               "hook of a submodule registered or removed; its graphs are dropped and captured again",
                               self.name)
        self.release(keep_warmups=True)
        self.params = self.bridge.trainable_parameters(self.module)
        self.grad_nodes = {id(p): (p, None) for p in self.params}
        self.watch.arm()

    # -- keys --------------------------------------------------------------------------------------
    def _key(self, spec, leaves, args, kwargs, by_value=()):
        """`by_value`: the values of the host tensor arguments (arguments.py), which a graph bakes in."""
        bridge = self.bridge
        if self.dispatch_key_fn is not None:
            user = self.dispatch_key_fn(*args, **kwargs)
            try:
                hash(user)
            except TypeError:
                raise GraphOptInputError(
                    f"autocudagraph(dispatch_key_fn=...): {self.name}'s key function returned an unhashable "
                    f"{type(user).__name__}; return a hashable value (a tuple, int or str)") from None
            # Added to the arguments' key, never in place of it: a graph replays one shape, layout and
            # set of inputs requiring grad, whatever the user's key says
            base = (user, spec, tuple(bridge.leaf_key(t) for t in leaves))
        else:
            base = (spec, tuple(bridge.leaf_key(t) for t in leaves))
        if by_value:
            base = base + (by_value,)
        if len(leaves) > 1:  # the same tensor passed twice (attention's x, x, x): its own graph
            ids = list(map(id, leaves))
            if len(set(ids)) < len(ids):
                base = base + (tuple(ids.index(i) for i in ids),)
        # Grad mode alone, not whether the inputs or the block's own parameters require grad: a block may
        # read trainable tensors it does not hold (a closure's, another module's), found at capture
        return base, bridge.grad_enabled(), bridge.amp_state(), self.watch.mode() if self.watch is not None else None

    # -- fallbacks and warnings --------------------------------------------------------------------
    def _max_graphs_message(self, spec, hosts) -> str:
        why = (f"{self.name}: more than max_graphs={self.max_graphs} dispatch keys (a key counts from its first "
               "call); calls with new keys run eagerly (raise max_graphs to graph them)")
        if hosts:  # a value that changes every step (an annealed temperature) makes a key per step
            names = argument_names(spec, self.call)
            why += (f". The keys differ by the value of {', '.join(names[i] for i in hosts)}, a host (CPU) tensor "
                    "whose value a graph bakes in: move it to the device to share one graph")
        return why

    def _fallback(self, reason: Reason, args, kwargs, warning: Optional[str]):
        c = self.counters
        c.fallbacks += 1
        c.fallback_reasons[reason] = c.fallback_reasons.get(reason, 0) + 1
        if warning is not None and reason not in self.warned:
            self.warned.add(reason)
            logger.warning(warning)
        if self.watch is not None and not self.holds_graphs():
            # No graphs to keep true to what the forward writes (a capture notes its own run's writes):
            # the call costs what eager costs, as a refused key's calls should
            return self.call(*args, **kwargs)
        return self._eager(self.call, args, kwargs)

    def holds_graphs(self) -> bool:
        """Whether any key holds graphs, in any slot (slots.py)."""
        return any(s.graphs is not None or s.twins and s.all_graphs() for s in self.keys.values())

    def _graphs_available(self) -> bool:
        return graphs_for(self.adapter).available()

    # -- lifecycle ---------------------------------------------------------------------------------
    def release(self, keep_warmups: bool = False) -> None:
        if self.lent:
            self.reclaim()
        for key_state in self.keys.values():
            for state in (key_state, *key_state.twins):
                if state.graphs is not None:
                    state.graphs.release()
                state.graphs = None
                state.failed = None
                state.run = None  # a traced level counts the outputs again (an unfrozen head may add one)
        if not keep_warmups:
            self.keys.clear()
        self.epoch += 1
        for slot in self.slots:
            slot.generation += 1  # a pending backward of a released graph must not replay
            slot.pending = 0
            slot.pool = None  # a pool whose graphs are all gone is not captured into again
        self.disabled_reason = None
        self.memory_bytes = None
        patches.release(self)
        if self.adapter is not None:
            graphs_for(self.adapter).release_memory()

    def stats(self) -> TrainingStats:
        c = self.counters
        per_key = [s.all_graphs() for s in self.keys.values()]
        held = [g for graphs in per_key for g in graphs]
        mode = ("disabled (GRAPH_OPT_DISABLE)" if self.disabled else
                "training graphs" + _LEVEL_NAMES[self.level] +
                (" (simulated)" if self.adapter is not None and
                 (simulation_enabled() or not self.adapter.graphs_supported()) else ""))
        graphs = sum(1 + (g.backward is not None) + sum(p is not None for p in g.partial.values()) for g in held)
        return TrainingStats(
            mode=mode, keys=sum(map(bool, per_key)), graphs=graphs,
            warmups=c.warmups, captures=c.captures, replays=c.replays, backward_replays=c.backward_replays,
            fallbacks=c.fallbacks, fallback_reasons=reason_counts(c.fallback_reasons), capture_failures=c.capture_failures,
            recaptures=c.recaptures, capture_seconds=c.capture_seconds, graph_memory_bytes=self.memory_bytes,
            static_buffer_bytes=sum(g.buffer_bytes for g in held), disabled_reason=self.disabled_reason,
            key_levels=_count(s.level for s in self.keys.values() if s.graphs is not None),
            untraced=c.untraced, retraced=c.retraced)


_LEVEL_NAMES = {0: "", 1: ", level 1 (traced: Dynamo and AOTAutograd)", 2: ", level 2 (traced, Inductor)"}

_OWN_WARNING = ("{name}: an attribute the forward writes itself holds another value than when this call's graphs "
                "were captured ({what}): a replay would not be what the forward does now, so the call runs eagerly "
                "(where that run leaves the value as it is, the graphs are captured again from it). Keep a value "
                "that changes with the call in a tensor the forward updates in place, or out of the block")



def _count(values) -> Dict[Any, int]:
    out: Dict[Any, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _rebuilt_block(module, warmup_steps, dispatch_key_fn, max_graphs, level=None) -> "GraphedBlock":
    """The block of an unpickled graphed module: its forward graphed again, nothing captured."""
    eager = type(module).forward.__get__(module)
    return GraphedBlock(module, eager, module, _module_framework(module), warmup_steps, dispatch_key_fn, max_graphs,
                        level)


def _module_framework(obj) -> Optional[str]:
    try:
        return backends.framework_of(type(obj))
    except TypeError:
        return None
