"""One dispatch key of an autocudagraph block: its graphs and static tensors (StepGraphs), and how they
are recorded: the forward, then its backward, through the graphs a capture picked (contracts.Recorder:
the device's, device_graphs.py, or the host stand-in's, host_graphs.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ..watch.arguments import argument_names
from ..capture.writes import changed, snapshot
from ..errors import CaptureError
from ..pytree import flatten, holding_tensors_message, objects_holding_tensors, unflatten

if TYPE_CHECKING:
    from .block import GraphedBlock


# -- one captured key ------------------------------------------------------------------------------
@dataclass
class StepGraphs:
    """The graphs of one dispatch key and the static tensors they read and write."""

    forward: Any
    backward: Any  # None for a key captured under no_grad
    static_inputs: List[Any]  # one per input tensor leaf, in flatten order
    out_buffers: List[Any]  # one per output tensor leaf
    out_spec: Any
    out_template: Any  # the outputs with a placeholder for each tensor: what unflatten copies dataclass nodes from
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
    recorder: Any = None  # the graphs that recorded them (contracts.Recorder): its partial backwards' too
    # A traced key with several differentiable outputs: the one computed from all the others. Its backward
    # (AOTAutograd's) takes zeros for the outputs a loss leaves out, which is eager's where they all feed
    # the root and the loss uses it; a loss that leaves the root out is refused (block.backward_replay).
    root: Optional[int] = None
    slot: int = 0  # the block's slot (slots.py) whose pool holds them
    # Inside DistributedDataParallel(static_graph=True): the apply() inputs handed to the replay, where the
    # forward leaves some parameters without a gradient (None: all of them). An unused parameter must get
    # no autograd edge from the replay, as in eager: an empty gradient on that edge still runs DDP's hook,
    # which static_graph takes for a graph that changed.
    kept: Optional[Tuple[int, ...]] = None

    def handed(self, per_input: list) -> list:
        """Of a list with one item per apply() input (the call's leaves, the parameters, the outside tensors),
        the items of the inputs the replay is handed (kept)."""
        kept = self.kept
        return per_input if kept is None else [per_input[i] for i in kept]

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
    level: int = 0  # what `run` is: 0 the eager forward, 1 or 2 traced
    # A traced key with several outputs carrying gradients: the one computed from all the others (a loss
    # from the logits), so a backward that uses it and leaves the others out is eager's (see graphs.root)
    root: Optional[int] = None
    retrace: bool = False  # the eager forward's capture failed for a cause tracing removes: trace at level 1
    tried_trace: bool = False  # a default-level key went through first_call: not retraced a second time
    # the module's plain attributes at capture ((id of a __dict__, name) -> key): those the forward writes
    # itself must hold these values for a replay to be what the forward would do (training_watch)
    attrs: Optional[dict] = None
    retried: bool = False  # a capture with no eager call before it set Python state: tried once more
    # The key's graphs in the block's further slots (slots.py), each a KeyState of its own: made when a
    # call of the key finds the slots before it holding pending backwards.
    twins: List["KeyState"] = field(default_factory=list)

    def in_slot(self, slot: int) -> "KeyState":
        if not slot:
            return self
        while len(self.twins) < slot:  # the forward ran already: Python state it sets fails their capture
            self.twins.append(KeyState(warmups=self.warmups, retried=True))
        twin = self.twins[slot - 1]
        twin.run, twin.level, twin.root = self.run, self.level, self.root
        return twin

    def all_graphs(self) -> List[StepGraphs]:
        return [s.graphs for s in (self, *self.twins) if s.graphs is not None]


_PLACEHOLDER = object()  # stands for an output tensor in the outputs' template


class PendingBackward:
    """Handed to the autograd node of one forward replay; released when its backward runs or its
    autograd graph is freed (the node drops it) without one."""

    __slots__ = ("block", "slot", "generation", "epoch", "inputs", "open", "versions")

    def __init__(self, block: "GraphedBlock", inputs, slot: int = 0):
        self.block = block
        self.slot = block.slots[slot]  # the Slot (slots.py) whose activations its backward reads
        self.generation = self.slot.generation
        self.epoch = block.epoch
        self.inputs = inputs  # the apply() inputs: which leaves still have no .grad is read at backward
        self.open = True
        # The parameters' version counters, summed (they only grow): the backward replay reads the
        # parameters as they are then, where eager's saved-tensor checks refuse a changed one.
        self.versions = sum(map(block.adapter.version, block.params))
        self.slot.pending += 1

    def release(self) -> None:
        if self.open:
            self.open = False
            if self.block.epoch == self.epoch:  # graphs released meanwhile: the count was reset
                self.slot.pending -= 1

    def __del__(self):
        self.release()


def _capture_key(block: GraphedBlock, recorder, state: KeyState, leaves, spec, needs_grad: bool, rng,
                 template=None) -> StepGraphs:
    """Record one key's graphs with `recorder` (contracts.Recorder): its warmup of forward and backward
    (a device's private one), then the forward graph, then the backward graph."""
    with recorder.capturing_parameters(block.bridge, block.module, block.params) as p:
        return _record(block, recorder, state, leaves, spec, needs_grad, rng, p, template)


def _record(block: GraphedBlock, recorder, state: KeyState, leaves, spec, needs_grad: bool, rng,
            params, template) -> StepGraphs:
    bridge, adapter = block.bridge, block.adapter
    run, traced = state.run, state.level > 0
    # One static copy per distinct tensor: code may test `query is key` (attention takes another path)
    copies, static_inputs, first = {}, [], []  # first: False for a repeat, which gets no gradient of its own
    for t in leaves:
        s = copies.get(id(t))
        first.append(s is None)
        if s is None:
            s = copies[id(t)] = bridge.static_input(t)
        static_inputs.append(s)
    args, kwargs = unflatten(spec, static_inputs, template=template)  # template: the call's (args, kwargs)
    grad_inputs = [t for t, f in zip(static_inputs, first) if f and bridge.requires_grad(t)] + list(params)

    def forward():
        # Saved tensors kept as views without version checks: a later backward through the capture's
        # autograd graph (of a loss that leaves some outputs out) reads them as the replays rewrite them,
        # and the parameters as the optimizer left them
        with (bridge.enable_grad() if needs_grad else adapter.no_grad()), bridge.amp_cache_disabled(), \
                (bridge.saved_as_views() if needs_grad else contextlib.nullcontext()):
            return run(*args, **kwargs)

    # The inputs' values before the first run of the forward: a write its version counter does not show
    # (through .data, a kernel of an extension) shows in them after it
    with adapter.no_grad():
        values_before = snapshot(adapter, static_inputs)

    def writes() -> set:  # of the forward's first run: the warmup's, or the capture's where it runs
        with adapter.no_grad():
            return changed(adapter, static_inputs, values_before)

    written_values = recorder.warm_up_step(bridge, forward, needs_grad, grad_inputs, writes, rng)
    mark = bridge.graph_mark() if needs_grad else None
    fwd = recorder.step_forward(bridge, forward, block.pool)
    versions = [adapter.version(t) for t in static_inputs]
    fwd.capture_begin()
    try:
        outs = forward()
    finally:
        fwd.capture_end()
    written_values |= recorder.captured_writes(writes)
    written = sorted({i for i, (t, v) in enumerate(zip(static_inputs, versions)) if adapter.version(t) != v}
                     | written_values)
    if written:
        # A replay would write the static copy, never the caller's tensor (inference copies it back;
        # here eager's autograd of the write on a tensor that needs grad is not the graph's)
        names = argument_names(spec, block.call)
        raise CaptureError(f"{block.name}: the forward writes its {', '.join(names[i] for i in written)} in place; a "
                           "replay would write the graph's copy, not the tensor passed, so this key runs eagerly. "
                           "Return the new value instead of writing the argument")
    out_leaves, out_spec = flatten(outs, bridge.is_tensor)
    held = objects_holding_tensors(outs, bridge.is_tensor)
    if held:
        raise CaptureError(f"{block.name}: {holding_tensors_message(held, 'step')}")
    # What the replays rebuild their outputs from (dataclasses, ModelOutput), without the capture's tensors.
    # A placeholder, not None: a ModelOutput drops None fields from its keys, and would list them again
    # after the others (outputs[0] would no longer be the loss).
    out_template = unflatten(out_spec, [_PLACEHOLDER] * len(out_leaves), template=outs)
    differentiable = [needs_grad and bridge.requires_grad(o) for o in out_leaves]
    diff_outs = [o for o, d in zip(out_leaves, differentiable) if d]
    if traced and len(diff_outs) > 1 and state.root is None:
        raise CaptureError(f"{block.name}: the traced forward now has {len(diff_outs)} outputs that carry gradients, "
                           "none computed from all the others; a traced backward would give one the loss leaves out a "
                           "zero gradient (graph_opt.clear_graphs counts them again and captures such a key from the "
                           "eager forward)")
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
    recorder.keep(fwd, out_buffers, differentiable)

    bwd, grad_out_buffers, grad_buffers, reached_from, kept_outs, flows = None, [], [], None, None, []
    kept = None
    if needs_grad:
        grad_out_buffers = [bridge.zeros_like(o) for o in diff_outs]
        flows = [f and bridge.requires_grad(t) for t, f in zip(static_inputs, first)] + \
            [True] * (len(params) + len(outside))
        if diff_outs:
            bwd = recorder.step_backward(bridge, fwd, grad_inputs, grad_out_buffers, block.pool)
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
            recorder.keep(bwd, grads)
        else:
            grads = [None] * len(grad_inputs)
        it = iter(grads)
        grad_buffers = [next(it) if f else None for f in flows]
        grad_buffers = [None if g is None else bridge.detach(g) for g in grad_buffers]
        if block.data_parallel.static_graph():
            kept = _without_unused(len(static_inputs), len(params), grad_buffers)
        if len(diff_outs) > 1 and not traced:
            it = iter(bridge.reached_from(diff_outs, grad_inputs))
            reached_from = [next(it) if f else () for f in flows]
            kept_outs = recorder.kept_outputs(diff_outs)
    del outs, diff_outs
    nbytes = adapter.nbytes
    buffer_bytes = sum(nbytes(t) for t in static_inputs + out_buffers + grad_out_buffers) + \
        sum(nbytes(g) for g in grad_buffers if g is not None)
    # Outputs and gradients as the key holds them (weakly on a device: they are the pool's); inputs and
    # grad_out buffers were allocated outside the pool and stay owned.
    weak = recorder.weak_alias
    out_buffers = [weak(t) for t in out_buffers]
    grad_buffers = [None if g is None else weak(g) for g in grad_buffers]
    return StepGraphs(forward=fwd, backward=bwd, static_inputs=static_inputs, out_buffers=out_buffers,
                      out_spec=out_spec, out_template=out_template, differentiable=differentiable,
                      grad_out_buffers=grad_out_buffers,
                      grad_buffers=grad_buffers, buffer_bytes=buffer_bytes, outside=outside,
                      reached_from=reached_from, grad_inputs=grad_inputs if needs_grad else [], flows=flows,
                      kept_outs=kept_outs, recorder=recorder, root=state.root if traced else None, kept=kept)


def _without_unused(first: int, count: int, grad_buffers) -> Optional[Tuple[int, ...]]:
    """The apply() inputs a replay takes inside DistributedDataParallel(static_graph=True): all but the
    parameters (count of them, from index first) the forward leaves without a gradient; None where it
    uses them all. DDP marks such parameters ready itself, as after an eager backward."""
    unused = {i for i in range(first, first + count) if grad_buffers[i] is None}
    if not unused:
        return None
    return tuple(i for i in range(len(grad_buffers)) if i not in unused)


def _record_partial(block: GraphedBlock, graphs: StepGraphs, used) -> "PartialBackward":
    """The backward graph of the used outputs alone, recorded by the key's own recorder through the kept
    autograd graph of the capture (the host stand-in: of the latest replay; its dry run computes this
    backward's gradients) into gradient buffers of its own."""
    bridge, recorder = block.bridge, graphs.recorder
    bridge.check_nested_grad()
    outs = recorder.partial_outputs(graphs)
    grad_outs = [b for b, u in zip(graphs.grad_out_buffers, used) if u]
    bwd = recorder.step_backward(bridge, graphs.forward, graphs.grad_inputs, graphs.grad_out_buffers, block.pool,
                                 used)
    bwd.capture_begin()
    try:
        with bridge.leaf_hooks_off(graphs.grad_inputs):
            grads = bridge.grad([o for o, u in zip(outs, used) if u], graphs.grad_inputs, grad_outs,
                                retain_graph=True)
        grads = bridge.unshared(grads, graphs.grad_out_buffers + graphs.static_inputs)
    finally:
        bwd.capture_end()
    recorder.keep(bwd, grads)
    it = iter(grads)
    buffers = [next(it) if f else None for f in graphs.flows]
    buffers = [None if g is None else bridge.detach(g) for g in buffers]
    buffers = [None if g is None else recorder.weak_alias(g) for g in buffers]
    return PartialBackward(bwd, buffers)
