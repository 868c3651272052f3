"""graph_opt.autocudagraph: the forward and the backward of a training block, each a CUDA graph.

    block = graph_opt.autocudagraph(layer)   # the same Layer / Module, its calls now graphed
    y = block(x); y.sum().backward()          # forward graph replayed, then backward graph replayed

Per dispatch key (shapes, dtypes and requires-grad flags of the tensor leaves, the non-tensor values,
autocast state): `warmup_steps` eager calls, then one capture of the forward and one of the backward
(the backward is `autograd.grad` of the forward's outputs, into static gradient buffers), then replay.
Under no_grad a key gets a forward graph alone. The replayed forward enters autograd through a
`torch.autograd.Function` / `paddle.autograd.PyLayer` whose backward replays the backward graph, so
gradients reach `.grad` through the framework's own accumulation, as in eager.

What a replay may rely on, and what this module guarantees instead of assuming:
- Outputs are copies: a caller may keep them across steps.
- A forward replay overwrites the activations the previous replay's backward reads. While a backward
  is pending (its autograd graph alive and not yet run), a new call runs eagerly (counted in
  `fallbacks`, one warning). All keys of a block share one memory pool, so this holds across keys.
- Parameters and buffers are read by address. One replaced after capture (a new object, or `.data`
  swapped) is detected at the next call: the graphs are dropped and captured again.
- Gradients handed to leaves that have none yet are copies (autograd would otherwise keep the
  static buffer as `.grad`, and the next replay would overwrite it).
- A loss that leaves some outputs out gets a backward graph of the used ones alone (captured at the
  first such backward), never the full one with zeros: an unused output's backward may make NaN.
- Capture touches no `.grad` and leaves the random generators as eager would (snapshot and restore).

What it does not do: graph a block whose forward syncs with the host or changes shapes between calls
of one key (capture fails: the key runs eagerly, with one warning), or a second-order backward
(`create_graph=True`: an error says so).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import backends, env, guards
from .cudagraph import frozen_gc
from .errors import CaptureError, GraphOptError, GraphOptInputError
from .failures import describe
from .host_outputs import _pending as _pending_host_copies, land_pending_copies
from .pytree import flatten, unflatten
from .replay_guards import state_key
from .testing import simulation_enabled

logger = logging.getLogger("graph_opt")

_STATE_ATTR = "_graph_opt_training"


# -- counters --------------------------------------------------------------------------------------
@dataclass
class TrainingCounters:
    warmups: int = 0  # eager calls spent warming a key up
    captures: int = 0  # keys captured (a forward graph, plus a backward graph when grads are needed)
    replays: int = 0  # forward replays
    backward_replays: int = 0
    fallbacks: int = 0  # calls that ran eagerly with graphs enabled; why: fallback_reasons
    capture_failures: int = 0
    recaptures: int = 0  # graphs dropped because a parameter or buffer was replaced
    capture_seconds: float = 0.0
    fallback_reasons: Dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingStats:
    """graph_opt.stats(block) for a block made by autocudagraph."""

    mode: str
    keys: int  # dispatch keys with captured graphs
    graphs: int  # device graphs held: forward, backward, and one per set of outputs a loss left out
    warmups: int
    captures: int
    replays: int  # forward replays
    backward_replays: int
    fallbacks: int
    fallback_reasons: Dict[str, int]  # max_graphs, backward_pending, capture_failed, no_graphs
    capture_failures: int
    recaptures: int
    capture_seconds: float
    graph_memory_bytes: Optional[int]  # device memory the pool grew by; None where not measurable
    static_buffer_bytes: int  # inputs, outputs and gradient buffers the graphs read and write
    disabled_reason: Optional[str]  # the last capture failure

    def as_dict(self) -> dict:
        return asdict(self)


# -- one captured key ------------------------------------------------------------------------------
@dataclass
class StepGraphs:
    """The graphs of one dispatch key and the static tensors they read and write."""

    forward: Any
    backward: Any  # None for a key captured under no_grad
    static_inputs: List[Any]  # one per input tensor leaf, in flatten order
    out_buffers: List[Any]  # one per output tensor leaf
    out_spec: Any
    differentiable: List[bool]  # per output leaf: does it carry a gradient
    grad_out_buffers: List[Any]  # one per differentiable output
    grad_buffers: List[Any]  # one per apply() input: a buffer, or None where no grad flows
    buffer_bytes: int
    outside: List[Any] = field(default_factory=list)  # leaves the block reads without receiving them
    # Per apply() input: the differentiable outputs its gradient flows from (None: one output, or all).
    # A backward where none of them got a gradient gives it None, as eager leaves an unused head's .grad.
    reached_from: Optional[List[Tuple[int, ...]]] = None
    grad_inputs: List[Any] = field(default_factory=list)  # what the captured backward differentiates for
    flows: List[bool] = field(default_factory=list)  # per apply() input: is it one of grad_inputs
    # A block with several differentiable outputs keeps the capture's outputs and their autograd graph
    # (over the graphs' own memory): a loss that leaves some outputs out gets a backward graph of the used
    # ones alone, captured at the first such backward. The full backward with zeros for the unused outputs
    # would differ: 0 * inf is NaN (the gradient of a logged norm at zero).
    kept_outs: Optional[List[Any]] = None
    partial: Dict[Tuple[bool, ...], Optional["PartialBackward"]] = field(default_factory=dict)  # None: failed

    def release(self) -> None:
        for graph in (self.forward, self.backward, *(p.graph for p in self.partial.values() if p is not None)):
            if graph is not None:
                graph.reset()
        self.forward = self.backward = self.kept_outs = None
        self.partial = {}
        self.static_inputs = self.out_buffers = self.grad_out_buffers = self.grad_buffers = self.outside = []
        self.grad_inputs = []


@dataclass
class PartialBackward:
    """The backward graph of one set of used outputs and its gradient buffers (per apply() input)."""

    graph: Any
    grad_buffers: List[Any]


@dataclass
class KeyState:
    warmups: int = 0
    graphs: Optional[StepGraphs] = None
    failed: Optional[str] = None
    run: Optional[Callable] = None  # the forward its calls and capture run: eager, or traced (levels 1, 2)


class PendingBackward:
    """Handed to the autograd node of one forward replay; released when its backward runs or its
    autograd graph is freed (the node drops it) without one."""

    __slots__ = ("block", "generation", "epoch", "inputs", "open")

    def __init__(self, block: "GraphedBlock", inputs):
        self.block = block
        self.generation = block.generation
        self.epoch = block.epoch
        self.inputs = inputs  # the apply() inputs: which leaves still have no .grad is read at backward
        self.open = True
        block.pending += 1

    def release(self) -> None:
        if self.open:
            self.open = False
            if self.block.epoch == self.epoch:  # graphs released meanwhile: the count was reset
                self.block.pending -= 1

    def __del__(self):
        self.release()


# -- the wrapped block -----------------------------------------------------------------------------
class GraphedBlock:
    """State of one autocudagraph target: its keys' graphs, one memory pool, counters."""

    def __init__(self, target, call: Callable, module, framework: Optional[str], warmup_steps: int,
                 dispatch_key_fn: Optional[Callable], max_graphs: int, level: int = 0):
        self.target = target
        self.call = call  # the eager forward
        self.level = level
        self.traced: Optional[Callable] = None  # levels 1 and 2: the forward compiled, made at binding
        self.module = module  # the Layer / Module, or None for a function
        self.name = getattr(target, "__qualname__", None) or type(target).__name__
        self.warmup_steps = warmup_steps
        self.dispatch_key_fn = dispatch_key_fn
        self.max_graphs = max_graphs
        self.disabled = env.disabled()
        self.framework = framework
        self.bridge = None
        self.adapter = None
        self.keys: Dict[Any, KeyState] = {}
        self.counters = TrainingCounters()
        self.pool = None
        self.memory_bytes: Optional[int] = None
        self.pending = 0  # forward replays whose backward has not run yet
        self.generation = 0  # forward replays so far: a backward checks its activations are still there
        self.epoch = 0  # releases of the graphs so far
        self.lent: List[Tuple[Any, Any]] = []  # (leaf, gradient buffer) handed out by the last backward
        self.watched_owners: List[dict] = []  # owner dicts, names and tensors of parameters and buffers
        self.watched_names: List[str] = []
        self.watched_tensors: List[Any] = []
        self.watched_ptrs: List[int] = []  # their addresses at capture
        self.registered: List[int] = [0]  # the adapter's count of parameter, buffer and submodule registrations
        self.registrations = 0
        self.tensor_ids: tuple = ()  # the module's submodules, parameters and buffers at capture
        self.attr_names: tuple = ()  # the module's own plain attributes (numbers, strings ...) at capture
        self.attr_get: Callable = lambda d: ()
        self.attr_values: tuple = ()
        self.attr_keys: tuple = ()
        self.attr_count = 0
        self.attr_written: set = set()  # plain attributes the forward itself writes: not watched
        self.params: List[Any] = []  # trainable parameters, passed to apply() after the inputs
        self.all_params: List[Any] = []  # every parameter, and whether each was trainable at capture
        self.trainable: List[bool] = []
        self.lazy = False  # the module had lazy parameters when bound: graphs wait until they are made
        self.modes: List[int] = [0]  # the adapter's count of train()/eval() calls
        self.modes_seen = -1
        self.mode_dicts: List[dict] = []
        self.mode_root: dict = {}
        self.mode_flags: tuple = (None,)
        self.disabled_reason: Optional[str] = None
        self._warned: set = set()

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
                             self.max_graphs, self.level)
        memo[id(self)] = block
        return block

    def __reduce__(self):
        """Pickling a graphed Layer / Module (torch.save): the copy is graphed, with no graphs yet."""
        if self.module is None:
            raise TypeError(f"{self.name}: a graphed function cannot be pickled; pickle the function it wraps")
        return _rebuilt_block, (self.module, self.warmup_steps, self.dispatch_key_fn, self.max_graphs, self.level)

    # -- the call ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.disabled:
            return self.call(*args, **kwargs)
        if self.bridge is None:
            self._bind(args, kwargs)
        bridge = self.bridge
        if bridge.saved_tensor_hooks_active():
            return self._fallback("saved_tensor_hooks", args, kwargs,
                                  f"{self.name}: called with saved-tensor hooks on (torch.utils.checkpoint, "
                                  "activation offloading): they keep the activations themselves, so these calls "
                                  "run eagerly")
        if self.module is not None and self.lazy and bridge.uninitialized(self.module):
            return self._fallback("lazy_parameters", args, kwargs, None)  # LazyLinear: shapes known after a call
        leaves, spec = flatten((args, kwargs), bridge.is_tensor)
        key = self._key(spec, leaves, args, kwargs)
        state = self.keys.get(key)
        if state is None:
            if len(self.keys) >= self.max_graphs:
                return self._fallback("max_graphs", args, kwargs,
                                      f"{self.name}: more than max_graphs={self.max_graphs} dispatch keys; "
                                      "calls with new keys run eagerly (raise max_graphs to graph them)")
            state = self.keys[key] = KeyState()
        graphs = state.graphs
        if graphs is not None:
            if self.module is not None and self._params_moved():
                self._recapture()
                graphs = None
            elif self.pending:
                return self._fallback("backward_pending", args, kwargs, _PENDING_WARNING.format(name=self.name))
            else:
                return self._replay(graphs, leaves, key[1])
        if state.failed is not None:
            return self._fallback("capture_failed", args, kwargs, None)
        if not self._graphs_available():
            return self._fallback("no_graphs", args, kwargs,
                                  f"{self.name}: CUDA graphs are unavailable here ({self.adapter.name} without "
                                  "a CUDA device); autocudagraph runs eagerly")
        if state.run is None:
            if self.traced is None:
                state.run = self.call
            else:
                return self._first_call(state, key[1], args, kwargs)
        if state.warmups < self.warmup_steps:
            state.warmups += 1
            self.counters.warmups += 1
            return self._eager(state.run, args, kwargs)
        if self.pending:
            return self._fallback("backward_pending", args, kwargs, _PENDING_WARNING.format(name=self.name))
        graphs = self._capture(state, leaves, spec, args, kwargs, needs_grad=key[1])
        if graphs is None:
            return self._eager(self.call, args, kwargs)
        return self._replay(graphs, leaves, key[1])

    def _first_call(self, state: KeyState, needs_grad: bool, args, kwargs):
        """Levels 1 and 2: a key's first call runs eagerly and shows its outputs. A key with several
        differentiable outputs is captured from the eager forward: a traced backward (AOTAutograd's) gives
        an output the loss leaves out a zero gradient, not none, so a parameter only it reaches would get
        zeros where eager gives None, and its backward could make NaN (0 * inf)."""
        self.counters.warmups += 1
        outs = self._eager(self.call, args, kwargs)
        diff = sum(map(self.bridge.requires_grad, flatten(outs, self.bridge.is_tensor)[0])) if needs_grad else 0
        state.run = self.traced if diff <= 1 else self.call
        if diff > 1 and "several_outputs" not in self._warned:
            self._warned.add("several_outputs")
            logger.info("%s: %d outputs carry gradients; calls with them are captured from the eager forward "
                        "(level 0), since a traced backward cannot leave an unused output out", self.name, diff)
        return outs

    def _replay(self, graphs: StepGraphs, leaves, needs_grad: bool):
        if needs_grad:
            outs = self.bridge.apply(self, graphs, leaves + self.params + graphs.outside)
        else:
            outs = self.forward_replay(graphs, leaves)
        return unflatten(graphs.out_spec, list(outs))

    def forward_replay(self, graphs: StepGraphs, tensors):
        """Copy the inputs in, replay the forward graph, return copies of the outputs (a caller may keep
        them; the next replay rewrites the buffers)."""
        if self.lent:
            self._reclaim()
        if _pending_host_copies:
            land_pending_copies()
        copy_ = self.adapter.copy_
        for dst, src in zip(graphs.static_inputs, tensors):
            copy_(dst, src)
        graphs.forward.replay()
        self.generation += 1
        self.counters.replays += 1
        clone = self.bridge.clone
        return [clone(b) for b in graphs.out_buffers]

    def forward_for_grad(self, ctx, graphs: StepGraphs, tensors):
        """The body of the Function / PyLayer forward (each bridge's `_ReplayStep`): replay, and leave
        on ctx what its backward needs. Returns the outputs, those without a gradient marked so."""
        outs = self.forward_replay(graphs, tensors)
        ctx.set_materialize_grads(False)  # an output the loss does not use comes back None, not zeros
        ctx.block, ctx.graphs = self, graphs
        ctx.pending = PendingBackward(self, tensors) if graphs.backward is not None else None
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
        if pending.generation != self.generation or graphs.backward is None:
            raise GraphOptError(
                f"{self.name}: backward through a graphed forward whose activations a later forward replay "
                "overwrote (or whose graphs were cleared); run each step's backward before the next forward "
                "of this block")
        if self.lent:
            self._reclaim()
        copy_ = self.adapter.copy_
        part = None
        if graphs.reached_from is not None and None in grads:  # the loss left some outputs out
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
            if graphs.reached_from is not None and None in grads:  # that set's own capture failed
                unused = [g is None for g in grads]
                buffers = [None if b is None or all(unused[i] for i in outs) else b
                           for b, outs in zip(buffers, graphs.reached_from)]
        self.counters.backward_replays += 1
        if not self.bridge.keeps_graph():  # retain_graph=True: a second backward may read the activations
            pending.release()
        return self.bridge.hand_out(buffers, pending.inputs, self.lent)

    def _capture_partial(self, graphs: StepGraphs, used) -> Optional["PartialBackward"]:
        """Capture, inside the first backward that leaves some outputs out, a backward graph of the used
        outputs alone (the full one with zeros for the others would give NaN where their backward makes
        0 * inf); the forward replay just ran, so nothing else is in flight."""
        adapter = self.adapter
        simulated = simulation_enabled() or not adapter.graphs_supported()
        start = time.perf_counter()
        part = None
        try:
            with guards.state_lock, frozen_gc(collect=False), adapter.capture_stream():
                part = _record_partial(self, graphs, used, simulated)
        except GraphOptError:
            raise
        except Exception as exc:  # noqa: BLE001 - the full graph serves that set, with a warning
            adapter.after_failed_capture()
            logger.warning("%s: capturing the backward of a loss that leaves some outputs out failed; such "
                           "backwards replay the full graph with zero gradients for those outputs (NaN where "
                           "their backward makes 0 * inf): %s", self.name, describe(exc))
        graphs.partial[used] = part
        self.counters.capture_seconds += time.perf_counter() - start
        return part

    def _reclaim(self) -> None:
        """Give leaves still holding a lent gradient buffer as .grad a copy of their own, before a replay
        (of any key: they share the pool) rewrites it."""
        data_ptr = self.adapter.data_ptr
        for t, buf in self.lent:
            grad = t.grad
            if grad is not None and data_ptr(grad) == data_ptr(buf):
                self.bridge.set_grad(t, self.bridge.clone(grad))
        self.lent.clear()

    # -- keys --------------------------------------------------------------------------------------
    def _key(self, spec, leaves, args, kwargs):
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
        if len(leaves) > 1:  # the same tensor passed twice (attention's x, x, x): its own graph
            ids = list(map(id, leaves))
            if len(set(ids)) < len(ids):
                base = base + (tuple(ids.index(i) for i in ids),)
        # Grad mode alone, not whether the inputs or the block's own parameters require grad: a block may
        # read trainable tensors it does not hold (a closure's, another module's), found at capture
        return base, bridge.grad_enabled(), bridge.amp_state(), self._module_mode()

    def _module_mode(self):
        """The training flags of the module and its submodules (a graph captured in training mode replays
        dropout), read again only after a train()/eval() call anywhere or a change of the module's own."""
        if self.module is None:
            return None
        modes = self.modes
        if modes[0] != self.modes_seen or self.mode_root["training"] is not self.mode_flags[0]:
            self.mode_flags = tuple(d["training"] for d in self.mode_dicts)
            self.modes_seen = modes[0]
        return self.mode_flags

    # -- fallbacks and warnings --------------------------------------------------------------------
    def _fallback(self, reason: str, args, kwargs, warning: Optional[str]):
        c = self.counters
        c.fallbacks += 1
        c.fallback_reasons[reason] = c.fallback_reasons.get(reason, 0) + 1
        if warning is not None and reason not in self._warned:
            self._warned.add(reason)
            logger.warning(warning)
        return self._eager(self.call, args, kwargs)

    def _graphs_available(self) -> bool:
        return simulation_enabled() or self.adapter.graphs_supported()

    # -- binding to a framework --------------------------------------------------------------------
    def _bind(self, args, kwargs) -> None:
        framework = self.framework or _framework_of_call(args, kwargs, self.name)
        backend = backends.load(framework)
        self.framework = framework
        self.adapter = backend.ADAPTER
        self.bridge = backend.autograd_bridge()
        if self.level:
            self.traced = self.bridge.traced(self.call, self.level, self.name)
        if self.module is not None:
            self.mode_dicts = [d for _, d in self.adapter.module_dicts(self.module)]
            self.mode_root = self.mode_dicts[0]
            self.modes = self.adapter.mode_counter()
            self.modes_seen = -1
            self.mode_flags = (None,)
            self.lazy = self.bridge.uninitialized(self.module)
            self.params = self.bridge.trainable_parameters(self.module)
            if not self.lazy:
                self._watch()

    def _watch(self) -> None:
        owned = self.bridge.owned_tensors(self.module)
        self.watched_owners = [owner for owner, _, _ in owned]
        self.watched_names = [name for _, name, _ in owned]
        self.watched_tensors = [t for _, _, t in owned]
        self.watched_ptrs = self.bridge.addresses(self.watched_tensors)
        self.all_params = self.bridge.all_parameters(self.module)
        self.trainable = self.bridge.trainable_flags(self.all_params)
        self.registered = self.adapter.registration_counter()
        self.registrations = self.registered[0]
        self.tensor_ids = self.adapter.module_tensor_ids(self.module)
        self._arm_attributes()

    def _plain_attributes(self) -> Dict[str, Any]:
        keys = ((k, state_key(v)) for k, v in self.module.__dict__.items() if k != "training")
        return {k: key for k, key in keys if key[0] != "id"}

    def _note_writes(self, before: Dict[str, Any]) -> None:
        """Attributes changed since `before` by a run of the forward are its own: no longer watched."""
        written = {k for k, v in self._plain_attributes().items() if before.get(k, _UNSET) != v}
        if written - self.attr_written:
            self.attr_written |= written
            self._arm_attributes()

    def _arm_attributes(self) -> None:
        """Watch the module's own plain attributes (numbers, strings, bools, None) as they are now, but
        those its forward writes itself (`self.calls += 1`): a replay runs no Python, so they are not
        inputs a user sets."""
        d = self.module.__dict__
        names = tuple(k for k in self._plain_attributes() if k not in self.attr_written)
        self.attr_names = names
        self.attr_get = operator.itemgetter(*names) if len(names) > 1 else \
            (lambda _d, n=names: tuple(_d[k] for k in n))
        self.attr_values = self.attr_get(d)
        self.attr_keys = tuple(map(state_key, self.attr_values))
        self.attr_count = len(d)

    def _eager(self, run: Callable, args, kwargs):
        """An eager (or traced, not replayed) call of the block: attributes it writes are the forward's
        own, and stop being watched."""
        if self.module is None or self.bridge is None:
            return run(*args, **kwargs)
        before = self._plain_attributes()
        try:
            return run(*args, **kwargs)
        finally:
            self._note_writes(before)

    def _attributes_changed(self) -> bool:
        """A plain value (number, string, bool, None) of the module's own attributes set to another since
        capture (`self.temperature = 2.0`), or one set on the instance over a class default: the graphs
        bake what the forward read. Same objects: nothing to compare (the common case, a few hundred ns)."""
        d = self.module.__dict__
        if len(d) != self.attr_count:  # added (over a class default) or deleted
            if set(self._plain_attributes()) - self.attr_written != set(self.attr_names):
                return True
            self.attr_count = len(d)
        try:
            values = self.attr_get(d)
        except KeyError:
            return True  # deleted
        if all(map(operator.is_, values, self.attr_values)):
            return False
        if tuple(map(state_key, values)) != self.attr_keys:
            return True
        self.attr_values = values  # equal values in new objects
        return False

    def _params_moved(self) -> bool:
        """A parameter or buffer replaced (a new object, or its data swapped), one added or a submodule
        replaced (a new head, a LoRA adapter), or the trainable set changed (a parameter frozen or
        unfrozen): the graphs read and compute gradients for the tensors captured."""
        tensors = self.watched_tensors
        if (any(map(operator.is_not, map(dict.get, self.watched_owners, self.watched_names), tensors))
                or self.bridge.addresses(tensors) != self.watched_ptrs
                or self.bridge.trainable_flags(self.all_params) != self.trainable
                or self._attributes_changed()):
            return True
        if self.registered[0] != self.registrations:  # a registration somewhere: is it in this module?
            if self.adapter.module_tensor_ids(self.module) != self.tensor_ids:
                return True
            self.registrations = self.registered[0]
        return False

    def _recapture(self) -> None:
        if "recapture" not in self._warned:
            self._warned.add("recapture")
            logger.warning("%s: a parameter, buffer or submodule was replaced or added after capture (a new "
                           "tensor, its data swapped, a new submodule), a parameter frozen or unfrozen, or a plain "
                           "attribute of the module set to another value; its graphs are dropped and captured again",
                           self.name)
        self.counters.recaptures += 1
        self.release(keep_warmups=True)
        self.params = self.bridge.trainable_parameters(self.module)
        self._watch()

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, state: KeyState, leaves, spec, args, kwargs, needs_grad: bool) -> Optional[StepGraphs]:
        bridge, adapter = self.bridge, self.adapter
        simulated = simulation_enabled() or not adapter.graphs_supported()
        if self.lent:  # a leaf still holding a lent buffer keeps a copy: the capture may reuse the memory
            self._reclaim()
        buffers = None
        if self.module is not None and self.watched_tensors and self._params_moved():
            # Changed since the graphs of other keys were captured: theirs are as stale as a replay would be
            run = state.run
            self._recapture()
            state.run = run  # this key's outputs were counted at its first call, after the change
        if self.module is not None:  # what the graphs will read: parameters as they are now
            self.lazy = False
            self.params = bridge.trainable_parameters(self.module)
            self._watch()
            buffers = bridge.snapshot_buffers(self.module)
        attrs_before = self._plain_attributes() if self.module is not None else None
        targets = [t for t in leaves if bridge.requires_grad(t)] + self.params
        grads_before = bridge.snapshot_grads(targets)
        rng = bridge.rng_state()
        start = time.perf_counter()
        mem_before = None if simulated else adapter.memory_in_use()
        try:
            if self.pool is None and not simulated:
                self.pool = adapter.new_pool()
            with guards.state_lock, frozen_gc(collect=False), guards.capture_custom_allreduce(), adapter.capture_stream():
                graphs = _capture_key(self, state.run, leaves, spec, needs_grad, simulated, rng)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the key eager, with one warning
            bridge.set_rng_state(rng)
            self._capture_failed(state, exc)
            return None
        finally:
            bridge.restore_grads(grads_before)
            if buffers is not None:
                # The capture ran the forward (a private warmup, or the simulated capture): its in-place
                # updates of buffers (batch norm's running stats) are undone; the replay that follows
                # makes this call's.
                bridge.restore_buffers(buffers)
        if simulated:
            bridge.set_rng_state(rng)  # a simulated capture ran the block; the replay must draw as eager would
        else:
            adapter.synchronize()
            after = adapter.memory_in_use()
            if mem_before is not None and after is not None:
                self.memory_bytes = (self.memory_bytes or 0) + max(0, after - mem_before)
        if attrs_before is not None:  # what the capture's forward wrote is the forward's own
            self._note_writes(attrs_before)
        state.graphs = graphs
        self.counters.captures += 1
        self.counters.capture_seconds += time.perf_counter() - start
        return graphs

    def _capture_failed(self, state: KeyState, exc: BaseException) -> None:
        self.adapter.after_failed_capture()  # the CUDA generators must leave capture mode
        # The failed graph gave its hold on the pool back: with no graph of another key holding it, torch
        # has retired the pool, and a capture into it would fail an internal assert. The next one takes a
        # pool of its own.
        self.pool = None
        why = describe(exc)
        state.failed = why
        self.disabled_reason = why
        self.counters.capture_failures += 1
        self.counters.fallbacks += 1
        reasons = self.counters.fallback_reasons
        reasons["capture_failed"] = reasons.get("capture_failed", 0) + 1
        logger.warning("%s: capture failed, this key runs eagerly: %s", self.name, why)

    # -- lifecycle ---------------------------------------------------------------------------------
    def release(self, keep_warmups: bool = False) -> None:
        if self.lent:
            self._reclaim()
        for state in self.keys.values():
            if state.graphs is not None:
                state.graphs.release()
            state.graphs = None
            state.failed = None
            state.run = None  # a traced level counts the outputs again (an unfrozen head may add one)
        if not keep_warmups:
            self.keys.clear()
        self.generation += 1  # a pending backward of a released graph must not replay
        self.epoch += 1
        self.pending = 0
        self.disabled_reason = None
        self.pool = None  # a pool whose graphs are all gone is not captured into again
        self.memory_bytes = None
        if self.adapter is not None and not simulation_enabled():
            self.adapter.release_memory()

    def stats(self) -> TrainingStats:
        c = self.counters
        held = [s.graphs for s in self.keys.values() if s.graphs is not None]
        mode = ("disabled (GRAPH_OPT_DISABLE)" if self.disabled else
                "training graphs" + _LEVEL_NAMES[self.level] +
                (" (simulated)" if self.adapter is not None and
                 (simulation_enabled() or not self.adapter.graphs_supported()) else ""))
        graphs = sum(1 + (g.backward is not None) + sum(p is not None for p in g.partial.values()) for g in held)
        return TrainingStats(
            mode=mode, keys=len(held), graphs=graphs,
            warmups=c.warmups, captures=c.captures, replays=c.replays, backward_replays=c.backward_replays,
            fallbacks=c.fallbacks, fallback_reasons=dict(c.fallback_reasons), capture_failures=c.capture_failures,
            recaptures=c.recaptures, capture_seconds=c.capture_seconds, graph_memory_bytes=self.memory_bytes,
            static_buffer_bytes=sum(g.buffer_bytes for g in held), disabled_reason=self.disabled_reason)


_LEVEL_NAMES = {0: "", 1: ", level 1 (traced: Dynamo and AOTAutograd)", 2: ", level 2 (traced, Inductor)"}

_UNSET = object()

_PENDING_WARNING = ("{name}: called again while the previous graphed forward's backward has not run; the "
                    "replay would overwrite the activations it reads, so this call runs eagerly. Run backward "
                    "(or drop the outputs) before the next forward, or call under no_grad")


def _capture_key(block: GraphedBlock, run: Callable, leaves, spec, needs_grad: bool, simulated: bool,
                 rng) -> StepGraphs:
    """Record one key's graphs. On a device: one private warmup of forward and backward on the capture
    stream (libraries allocate workspaces on first use, which a capture must not do), then the forward
    graph, then the backward graph. Simulated: the same calls, kept as host closures."""
    bridge = block.bridge
    params = block.params
    # On a device the capture reads the parameters through fresh aliases: autograd keeps one gradient
    # accumulator per leaf, created on the stream of its first use, and one left from an eager step
    # (alive while that step's loss is) would make the captured backward wait on the caller's stream.
    real = not simulated and params
    with bridge.parameters_for_capture(block.module, params) if real else contextlib.nullcontext(params) as p:
        return _record(block, run, leaves, spec, needs_grad, simulated, rng, p)


def _record(block: GraphedBlock, run: Callable, leaves, spec, needs_grad: bool, simulated: bool, rng,
            params) -> StepGraphs:
    bridge, adapter = block.bridge, block.adapter
    # One static copy per distinct tensor: code may test `query is key` (attention takes another path)
    copies, static_inputs, first = {}, [], []  # first: False for a repeat, which gets no gradient of its own
    for t in leaves:
        s = copies.get(id(t))
        first.append(s is None)
        if s is None:
            s = copies[id(t)] = bridge.static_input(t)
        static_inputs.append(s)
    args, kwargs = unflatten(spec, static_inputs)
    grad_inputs = [t for t, f in zip(static_inputs, first) if f and bridge.requires_grad(t)] + list(params)

    def forward():
        # Saved tensors kept as views without version checks: a later backward through the capture's
        # autograd graph (of a loss that leaves some outputs out) reads them as the replays rewrite them,
        # and the parameters as the optimizer left them
        with (bridge.enable_grad() if needs_grad else adapter.no_grad()), bridge.amp_cache_disabled(), \
                (bridge.saved_as_views() if needs_grad else contextlib.nullcontext()):
            return run(*args, **kwargs)

    if not simulated:
        mark = bridge.graph_mark() if needs_grad else None
        outs = forward()
        if needs_grad:
            diff = [o for o in flatten(outs, bridge.is_tensor)[0] if bridge.requires_grad(o)]
            if diff:
                # The backward the capture will record, tensors read from outside the block included
                targets = grad_inputs + bridge.outside_tensors(diff, {id(t): t for t in grad_inputs}, mark)[0]
                with bridge.leaf_hooks_off(targets):
                    bridge.grad(diff, targets, [bridge.ones_like(o) for o in diff])
        del outs
        bridge.set_rng_state(rng)
        adapter.synchronize()

    mark = bridge.graph_mark() if needs_grad else None
    fwd = _SimulatedForward(bridge, forward) if simulated else adapter.new_graph(block.pool)
    fwd.capture_begin()
    try:
        outs = forward()
    finally:
        fwd.capture_end()
    out_leaves, out_spec = flatten(outs, bridge.is_tensor)
    differentiable = [needs_grad and bridge.requires_grad(o) for o in out_leaves]
    diff_outs = [o for o, d in zip(out_leaves, differentiable) if d]
    if run is not block.call and len(diff_outs) > 1:
        raise CaptureError(f"{block.name}: the traced forward now has {len(diff_outs)} outputs that carry gradients; "
                           "a traced backward would give one the loss leaves out a zero gradient (graph_opt.clear_graphs "
                           "counts them again and captures such a key from the eager forward)")
    outside = []
    if needs_grad and diff_outs:
        # Tensors the block reads without receiving them (a closure's, a global's, another module's
        # parameter) get their gradients too: they become inputs of the graphed step.
        outside, unheld = bridge.outside_tensors(diff_outs, {id(t): t for t in grad_inputs}, mark)
        if unheld:
            raise CaptureError(
                f"{block.name} reads a tensor that requires grad without receiving it as an argument or holding it "
                "as a parameter, and its gradient cannot be handed to it from a graph here (one computed before "
                "the call, whose gradient flows on through an autograd graph outside the block; or, on Paddle, "
                "any such tensor). Pass it as an argument; this key runs eagerly")
        grad_inputs = grad_inputs + outside
    out_buffers = [bridge.detach(o) for o in out_leaves]
    if simulated:
        fwd.keep(out_buffers, differentiable)

    bwd, grad_out_buffers, grad_buffers, reached_from, kept_outs, flows = None, [], [], None, None, []
    if needs_grad:
        grad_out_buffers = [bridge.zeros_like(o) for o in diff_outs]
        flows = [f and bridge.requires_grad(t) for t, f in zip(static_inputs, first)] + \
            [True] * (len(params) + len(outside))
        if diff_outs:
            bwd = _SimulatedBackward(bridge, fwd, grad_inputs, grad_out_buffers) if simulated \
                else adapter.new_graph(block.pool)
            bwd.capture_begin()
            try:
                # Captured retaining the forward's saved tensors: a backward that frees them as it goes lets
                # the pool hand their memory to its own temporaries, and a second backward through the same
                # forward (retain_graph=True, or autograd.grad twice) would read them overwritten.
                with bridge.leaf_hooks_off(grad_inputs):
                    grads = bridge.grad(diff_outs, grad_inputs, grad_out_buffers, retain_graph=True)
                # One buffer per gradient: autograd may give two leaves one tensor (of `x + a + b`), or the
                # incoming gradient itself, and each leaf's .grad must be its own
                grads = bridge.unshared(grads, grad_out_buffers + static_inputs)
            finally:
                bwd.capture_end()
            if simulated:
                bwd.keep(grads)
        else:
            grads = [None] * len(grad_inputs)
        it = iter(grads)
        grad_buffers = [next(it) if f else None for f in flows]
        grad_buffers = [None if g is None else bridge.detach(g) for g in grad_buffers]
        if len(diff_outs) > 1:
            it = iter(bridge.reached_from(diff_outs, grad_inputs))
            reached_from = [next(it) if f else () for f in flows]
            if not simulated:  # simulated: the latest replay's outputs (fwd.live) serve
                kept_outs = diff_outs
    del outs, diff_outs
    nbytes = adapter.nbytes
    buffer_bytes = sum(nbytes(t) for t in static_inputs + out_buffers + grad_out_buffers) + \
        sum(nbytes(g) for g in grad_buffers if g is not None)
    if not simulated:
        # Outputs and gradients were allocated in the pool during capture. Holding them weakly lets the
        # next key's capture reuse those blocks (calls never overlap: see backward_pending), so all keys
        # together stay close to one key's memory. Inputs and grad_out buffers were allocated outside the
        # pool and stay owned.
        weak = adapter.weak_alias
        out_buffers = [weak(t) for t in out_buffers]
        grad_buffers = [None if g is None else weak(g) for g in grad_buffers]
    return StepGraphs(forward=fwd, backward=bwd, static_inputs=static_inputs, out_buffers=out_buffers,
                      out_spec=out_spec, differentiable=differentiable, grad_out_buffers=grad_out_buffers,
                      grad_buffers=grad_buffers, buffer_bytes=buffer_bytes, outside=outside,
                      reached_from=reached_from, grad_inputs=grad_inputs if needs_grad else [], flows=flows,
                      kept_outs=kept_outs)


def _record_partial(block: GraphedBlock, graphs: StepGraphs, used, simulated: bool) -> "PartialBackward":
    """The backward graph of the used outputs alone, recorded through the kept autograd graph of the
    capture (simulated: of the latest replay; its dry run computes this backward's gradients) into
    gradient buffers of its own."""
    bridge = block.bridge
    bridge.check_nested_grad()
    outs = graphs.kept_outs if graphs.kept_outs is not None else graphs.forward.live
    grad_outs = [b for b, u in zip(graphs.grad_out_buffers, used) if u]
    bwd = _SimulatedBackward(bridge, graphs.forward, graphs.grad_inputs, graphs.grad_out_buffers, used) \
        if simulated else block.adapter.new_graph(block.pool)
    bwd.capture_begin()
    try:
        with bridge.leaf_hooks_off(graphs.grad_inputs):
            grads = bridge.grad([o for o, u in zip(outs, used) if u], graphs.grad_inputs, grad_outs,
                                retain_graph=True)
        grads = bridge.unshared(grads, graphs.grad_out_buffers + graphs.static_inputs)
    finally:
        bwd.capture_end()
    if simulated:
        bwd.keep(grads)
    it = iter(grads)
    buffers = [next(it) if f else None for f in graphs.flows]
    buffers = [None if g is None else bridge.detach(g) for g in buffers]
    if not simulated:
        buffers = [None if g is None else block.adapter.weak_alias(g) for g in buffers]
    return PartialBackward(bwd, buffers)


# -- simulated graphs: the host stand-in for a forward and its backward ----------------------------
class _SimulatedForward:
    """replay() runs the forward again on the static inputs, with autograd on when the key needs it,
    writes the output buffers in place and keeps the fresh outputs for the backward's replay."""

    def __init__(self, bridge, run: Callable[[], Any]):
        self.bridge = bridge
        self.run = run
        self.out_buffers: List[Any] = []
        self.live: List[Any] = []  # the latest replay's differentiable outputs, with their autograd graph

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def keep(self, out_buffers, differentiable) -> None:
        self.out_buffers = out_buffers
        self.differentiable = differentiable

    def replay(self) -> None:
        fresh = flatten(self.run(), self.bridge.is_tensor)[0]
        if len(fresh) != len(self.out_buffers):
            raise RuntimeError(f"simulated replay produced {len(fresh)} tensors where the capture produced "
                               f"{len(self.out_buffers)}")
        copy_, same = self.bridge.copy_detached, self.bridge.same_memory
        for dst, src in zip(self.out_buffers, fresh):
            if not same(dst, src):  # an output that is (a view of) an input: a copy would bump its version
                copy_(dst, src)
        self.live = [o for o, d in zip(fresh, self.differentiable) if d]

    def reset(self) -> None:
        self.run, self.out_buffers, self.live = None, [], []


class _SimulatedBackward:
    """replay() takes autograd.grad of the forward's latest outputs into the static gradient buffers."""

    def __init__(self, bridge, forward: _SimulatedForward, inputs, grad_out_buffers, used=None):
        self.bridge = bridge
        self.forward = forward
        self.inputs = inputs
        self.grad_out_buffers = grad_out_buffers
        self.used = used  # the outputs it differentiates (None: all)
        self.grad_buffers: List[Any] = []

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def keep(self, grads) -> None:
        self.grad_buffers = grads

    def replay(self) -> None:
        self.bridge.check_nested_grad()
        outs, grad_outs = self.forward.live, self.grad_out_buffers
        if self.used is not None:
            outs = [o for o, u in zip(outs, self.used) if u]
            grad_outs = [b for b, u in zip(grad_outs, self.used) if u]
        with self.bridge.leaf_hooks_off(self.inputs):
            fresh = self.bridge.grad(outs, self.inputs, grad_outs, retain_graph=True)
        copy_ = self.bridge.copy_detached
        for dst, src in zip(self.grad_buffers, fresh):
            if dst is not None:
                copy_(dst, src)

    def reset(self) -> None:
        self.forward = None
        self.inputs = self.grad_out_buffers = self.grad_buffers = []


def _rebuilt_block(module, warmup_steps, dispatch_key_fn, max_graphs, level=0) -> "GraphedBlock":
    """The block of an unpickled graphed module: its forward graphed again, nothing captured."""
    eager = type(module).forward.__get__(module)
    return GraphedBlock(module, eager, module, _module_framework(module), warmup_steps, dispatch_key_fn, max_graphs,
                        level)


# -- the public entry point ------------------------------------------------------------------------
def _framework_of_call(args, kwargs, name: str) -> str:
    """The framework of a function's tensors, judged from the first tensor found."""
    candidates = [fw for fw in ("torch", "paddle") if fw in sys.modules]
    for fw in candidates:
        tensor_type = sys.modules[fw].Tensor
        leaves, _ = flatten((args, kwargs), lambda x, t=tensor_type: isinstance(x, t))
        if leaves:
            return fw
    raise GraphOptInputError(
        f"autocudagraph: {name} was called without a tensor argument; a graphed function takes paddle or "
        "torch tensors (nested in dicts, lists or tuples is fine)")


def _check_arguments(target, warmup_steps, dispatch_key_fn, max_graphs, level) -> None:
    if not callable(target):
        raise GraphOptInputError(
            f"autocudagraph(target): expected a function or a paddle.nn.Layer / torch.nn.Module instance, "
            f"got {type(target).__name__}")
    if isinstance(target, type):
        raise GraphOptInputError(
            f"autocudagraph(target): got the class {target.__name__}; pass an instance (autocudagraph(Model())) "
            "or a function")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise GraphOptInputError(f"autocudagraph(warmup_steps={warmup_steps!r}): expected an int >= 0")
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise GraphOptInputError(f"autocudagraph(max_graphs={max_graphs!r}): expected an int >= 1")
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise GraphOptInputError(
            f"autocudagraph(level={level!r}): expected 0 (capture the eager forward, bitwise eager), 1 (trace it "
            "with Dynamo and AOTAutograd, eager kernels) or 2 (trace it and compile with Inductor)")
    if dispatch_key_fn is not None and not callable(dispatch_key_fn):
        raise GraphOptInputError(
            f"autocudagraph(dispatch_key_fn=...): expected a callable (*args, **kwargs) -> hashable or None, "
            f"got {type(dispatch_key_fn).__name__}")


_PADDLE_LEVEL = ("autocudagraph(level={level}): traced training graphs are torch's (Dynamo and AOTAutograd); "
                 "a Paddle block is captured from its eager forward: use level=0")


def _module_framework(obj) -> Optional[str]:
    try:
        return backends.framework_of(type(obj))
    except TypeError:
        return None


def autocudagraph(target=None, *, warmup_steps: int = 1, dispatch_key_fn: Optional[Callable] = None,
                  max_graphs: int = 8, level: int = 0):
    """Capture the forward and the backward of `target` as CUDA graphs and replay them every step.

    target: a function of tensors, or a paddle.nn.Layer / torch.nn.Module instance (that instance is
    returned, its forward graphed; `type(layer).forward(layer, ...)` stays the eager forward). Also
    usable as `@autocudagraph` or `@autocudagraph(warmup_steps=2)`.
    warmup_steps: eager calls per dispatch key before its capture (0: capture on the first call).
    dispatch_key_fn(*args, **kwargs) -> hashable: picks the graph; the default key is the tensor
    leaves' shapes, dtypes and requires-grad flags plus the non-tensor values. No padding: shapes are
    replayed exactly.
    max_graphs: dispatch keys captured at most; calls with further keys run eagerly (one warning).
    level: what is captured (torch; Paddle captures level 0). 0: the eager forward and its autograd
    backward, bitwise eager. 1: the forward traced by Dynamo and AOTAutograd into forward and backward
    graphs of eager kernels (constants a forward makes from Python numbers are folded in, so a forward
    that copies them to the device captures). 2: those graphs compiled by Inductor (fused kernels;
    gradients within rounding of eager's). At levels 1 and 2 a key's first call runs eagerly, then
    `warmup_steps` traced calls (the first compiles), then the capture.

    GRAPH_OPT_DISABLE=1 makes every call plain eager. See graph_opt.training for the guarantees.
    """
    if target is None:
        return lambda t: autocudagraph(t, warmup_steps=warmup_steps, dispatch_key_fn=dispatch_key_fn,
                                       max_graphs=max_graphs, level=level)
    _check_arguments(target, warmup_steps, dispatch_key_fn, max_graphs, level)
    framework = _module_framework(target)
    if framework == "paddle" and level:
        raise GraphOptInputError(_PADDLE_LEVEL.format(level=level))
    if framework is not None:
        if _STATE_ATTR in target.__dict__:
            raise GraphOptInputError(
                f"autocudagraph(target): this {type(target).__name__} instance is already graphed; "
                "wrap it once (graph_opt.clear_graphs drops its graphs)")
        eager = type(target).forward.__get__(target)
        block = GraphedBlock(target, eager, target, framework, warmup_steps, dispatch_key_fn, max_graphs, level)
        object.__setattr__(target, _STATE_ATTR, block)
        if not block.disabled:
            object.__setattr__(target, "forward", block)  # Layer/Module __call__ reaches it through self.forward
        return target
    if state_of_training(target) is not None:
        raise GraphOptInputError("autocudagraph(target): this function is already graphed; wrap the original once")
    block = GraphedBlock(target, target, None, None, warmup_steps, dispatch_key_fn, max_graphs, level)

    @functools.wraps(target)
    def graphed(*args, **kwargs):
        return block(*args, **kwargs)

    setattr(graphed, _STATE_ATTR, block)
    return graphed


def state_of_training(obj) -> Optional[GraphedBlock]:
    """The GraphedBlock behind an autocudagraph result, or None."""
    holder = getattr(obj, "__dict__", None)
    if not isinstance(holder, dict):
        return None
    state = holder.get(_STATE_ATTR)
    return state if isinstance(state, GraphedBlock) else None
