"""Paddle side of graph_opt.autocudagraph: autograd, parameters, autocast and random state.

The replayed forward enters autograd as a paddle.autograd.PyLayer whose backward replays the backward
graph. Runs on CPU with simulated graphs; the CUDA path is written against the Paddle 3.2+ API and has
not been run (no Paddle GPU build runs on the machines this was built on).
"""
from __future__ import annotations

import contextlib
import functools
import threading

import paddle

from ...contracts import DataParallel
from ...errors import GraphOptError, GraphOptInputError
from .. import patches
from .adapter import address


class _ReplayStep(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, block, graphs, *tensors):
        return block.forward_for_grad(ctx, graphs, tensors)

    @staticmethod
    def backward(ctx, *grads):
        out = ctx.block.backward_for_grad(ctx, grads)  # PyLayer wants grads of tensor inputs only
        if _partial.requested is not None:
            out = _only_requested(ctx.pending.inputs, out, _partial.requested)
        return tuple(out)


class _Partial(threading.local):
    requested = None  # inside paddle.grad: the tensors it asks gradients for


_partial = _Partial()


def _pack_view(t):
    return t.detach()


def _unpack_view(t):
    return t


def _accumulation_node(t):
    with paddle.enable_grad():
        return (t * 1).grad_fn.next_functions[0].node_ptr()


def _nodes(grad_fn):
    """The node_ptr of every node of Paddle's graph from grad_fn on, each once, as the walk finds it."""
    stack, seen = [grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node.node_ptr() in seen:
            continue
        seen.add(node.node_ptr())
        yield node.node_ptr()
        stack.extend(node.next_functions)


def _reaches(t, wanted) -> bool:
    """Whether t's gradient flows to one of the accumulation nodes `wanted` (a walk of Paddle's graph)."""
    if t.grad_fn is None:
        return not t.stop_gradient and _accumulation_node(t) in wanted
    return any(ptr in wanted for ptr in _nodes(t.grad_fn))


def _only_requested(inputs, grads, requested):
    """Inside paddle.grad(outputs, inputs=...), a PyLayer must give None for every input whose gradient
    reaches none of the requested tensors (Paddle segfaulted, or said so, otherwise); its backward is
    not told which those are, so the graph is walked: the requested tensors' accumulation nodes, and
    whether each input reaches one."""
    wanted = {_accumulation_node(t) for t in requested if t.grad_fn is None} | \
        {t.grad_fn.node_ptr() for t in requested if t.grad_fn is not None}
    return [g if g is not None and _reaches(t, wanted) else None for t, g in zip(inputs, grads)]


def _install_partial_grad_watch() -> None:
    patches.once("paddle.grad", _partial_grad_watch)


def _partial_grad_watch() -> None:
    """paddle.grad sets _partial.requested for the length of the call (see _only_requested)."""
    import paddle.base.dygraph.base as dygraph

    grad = dygraph.grad

    @functools.wraps(grad)
    def watched(outputs, inputs, *args, **kwargs):
        before = _partial.requested
        _partial.requested = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        try:
            return grad(outputs, inputs, *args, **kwargs)
        finally:
            _partial.requested = before

    for module in (dygraph, paddle, paddle.autograd):
        if getattr(module, "grad", None) is grad:
            patches.replace(module, "grad", watched, "inside paddle.grad(outputs, inputs=...), a graphed block's "
                            "backward must give None for inputs that reach none of the requested tensors, and Paddle "
                            "does not tell a PyLayer which those are", where=f"{module.__name__}.grad")


class PaddleAutogradBridge:
    def __init__(self):
        self._tensor = paddle.Tensor

    # -- tensors ---------------------------------------------------------------------------------
    def is_tensor(self, x) -> bool:
        return isinstance(x, self._tensor)

    def shape(self, t):
        return t.shape

    def leaf_key(self, t):
        return tuple(t.shape), t.dtype, t.stop_gradient, t.place._type()

    def requires_grad(self, t) -> bool:
        return not t.stop_gradient

    def static_input(self, t):
        s = t.detach().clone()  # contiguous, whatever t's strides
        s.stop_gradient = t.stop_gradient
        return s

    def detach(self, t):
        return t.detach()

    def clone(self, t):
        return t.clone()

    def zero_(self, t) -> None:
        t.zero_()

    def zeros_like(self, t):
        return paddle.zeros_like(t)

    def ones_like(self, t):
        return paddle.ones_like(t)

    @staticmethod
    def same_memory(a, b) -> bool:
        return a.data_ptr() == b.data_ptr()

    @staticmethod
    def leaf_hooks_off(tensors):
        return contextlib.nullcontext()  # paddle.grad does not run the inputs' own hooks

    @staticmethod
    def unshared(grads, taken):
        return list(grads)  # hand_out copies every gradient it gives out

    @staticmethod
    def reached_from(outputs, leaves):
        """Per leaf: the indices of the outputs whose autograd graph reaches it."""
        nodes = [_accumulation_node(t) for t in leaves]
        reached = [set(_nodes(o.grad_fn)) if o.grad_fn is not None else
                   {_accumulation_node(o)} if not o.stop_gradient else set() for o in outputs]
        return [tuple(i for i, r in enumerate(reached) if n in r) for n in nodes]

    def copy_detached(self, dst, src) -> None:
        with paddle.no_grad():
            dst.copy_(src.detach(), False)

    def set_grad(self, t, grad) -> None:
        t.grad = grad

    def hand_out(self, buffers, inputs, lent, nodes):
        """The gradients backward returns, one per input, each a copy: Paddle's accumulation shares the
        first gradient a leaf gets (also after clear_gradients(set_to_zero=False)), and a non-leaf
        input's gradient goes to its tensor hooks and on upstream, where it may be kept. The next backward
        replay rewrites the buffers."""
        return [None if buf is None else buf.clone() for buf in buffers]

    @staticmethod
    def addresses(tensors):
        return [address(t) for t in tensors]

    @staticmethod
    def traced(fn, level: int, name: str):
        from ...training.api import _PADDLE_LEVEL

        raise GraphOptInputError(f"{name}: " + _PADDLE_LEVEL.format(level=level))

    @staticmethod
    def root_output(outputs):
        return None  # never asked: Paddle's blocks are not traced

    @staticmethod
    def check_nested_grad() -> None:
        """A simulated backward replay, and a backward that leaves some outputs out before its graph is
        captured, run paddle.grad, and Paddle's autograd is not reentrant: inside an outer paddle.grad that
        segfaults. A graph replays without autograd."""
        if _partial.requested is not None:
            raise GraphOptError(
                "paddle.grad through a graphed block whose backward runs paddle.grad itself (a simulated replay, "
                "or a first backward that leaves some of the block's outputs out) is not supported: Paddle's "
                "autograd is not reentrant. Real CUDA graphs replay the others, and loss.backward() works")

    @staticmethod
    def saved_as_views():
        """Autograd saves detached views and checks no versions when it reads them back."""
        return paddle.autograd.saved_tensors_hooks(_pack_view, _unpack_view)

    @staticmethod
    def keeps_graph() -> bool:
        return False  # Paddle does not say, inside a PyLayer's backward, whether the graph is retained

    @staticmethod
    def saved_tensor_hooks_active() -> bool:
        return False  # Paddle's recompute reruns the block inside its own PyLayer (no saved-tensor hooks)

    @staticmethod
    def data_parallel(wrapper):
        return DataParallel()  # paddle.DataParallel lays out its buckets at construction

    @staticmethod
    def uninitialized(layer) -> bool:
        return False  # Paddle has no lazy parameters

    # -- what the block reads without receiving it -------------------------------------------------
    @staticmethod
    def graph_mark():
        return None

    @staticmethod
    def outside_tensors(outputs, known, mark):
        """([], found): Paddle's accumulation nodes do not name their tensor, so a leaf the block reads
        without receiving it is found (its node is none of the known leaves') but cannot be handed a
        gradient: found is True then, and the capture fails naming the cause."""
        with paddle.enable_grad():
            mine = {(t * 1).grad_fn.next_functions[0].node_ptr() for t in known.values() if not t.stop_gradient}
        stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node.node_ptr() in seen:
                continue
            seen.add(node.node_ptr())
            if node.name() == "GradNodeAccumulation":
                if node.node_ptr() not in mine:
                    return [], True
                continue
            stack.extend(node.next_functions)
        return [], False

    # -- autograd --------------------------------------------------------------------------------
    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def enable_grad(self):
        return paddle.enable_grad()

    def grad(self, outputs, inputs, grad_outputs, retain_graph: bool = False):
        grads = paddle.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        if any(g is not None and g.is_selected_rows() for g in grads):
            raise RuntimeError("a sparse gradient (Embedding(sparse=True), say): a graph replays dense buffers; "
                               "use sparse=False for the graphed block")
        return grads

    def apply(self, block, graphs, tensors):
        return _ReplayStep.apply(block, graphs, *tensors)

    # -- parameters ------------------------------------------------------------------------------
    def trainable_parameters(self, layer):
        return [p for p in layer.parameters() if not p.stop_gradient]

    @staticmethod
    def trainable_flags(params) -> list:
        return [not p.stop_gradient for p in params]

    def all_parameters(self, layer):
        return list(layer.parameters())

    @staticmethod
    def snapshot_buffers(layer):
        """Copies of the buffers and frozen parameters (batch norm's running stats are parameters with
        stop_gradient in Paddle): a capture runs the forward, and its updates of them must not count as a
        step."""
        with paddle.no_grad():
            state = [b for b in layer.buffers() if b._is_initialized()] + [p for p in layer.parameters() if p.stop_gradient]
            return [(b, b.clone()) for b in state]

    @staticmethod
    def restore_buffers(snapshot) -> None:
        with paddle.no_grad():
            for b, values in snapshot:
                b.copy_(values, False)

    def owned_tensors(self, layer):
        """(owner dict, name, tensor) for every parameter and buffer: replacing one shows in its owner."""
        out = []
        for sub in layer.sublayers(include_self=True):
            for owner in (sub._parameters, sub._buffers):
                out.extend((owner, name, t) for name, t in owner.items() if t is not None)
        return out

    @staticmethod
    def tensor_attributes(layer):
        """Paddle's Layer keeps a tensor set as an attribute among its buffers (owned_tensors has it)."""
        return []

    def parameters_for_capture(self, layer, params):
        # torch needs fresh leaves here because of per-stream gradient accumulators; Paddle's
        # accumulation has no stream of its own, so the parameters are captured as they are.
        return contextlib.nullcontext(params)

    def snapshot_grads(self, tensors):
        snap = []
        for t in tensors:
            if t.is_leaf:
                grad = t.grad
                snap.append((t, grad, None if grad is None else grad.clone()))
        return snap

    def restore_grads(self, snapshot) -> None:
        with paddle.no_grad():
            for t, grad, values in snapshot:
                if grad is None:
                    if t.grad is not None:
                        t.clear_gradient(False)
                else:
                    t.grad = values

    # -- autocast and random state ---------------------------------------------------------------
    def amp_state(self):
        """auto_cast and the default dtype (a tensor the forward makes without a dtype takes it)."""
        tracer = paddle.base.framework._dygraph_tracer()
        return tracer._amp_level, tracer._amp_dtype, paddle.get_default_dtype()

    def amp_cache_disabled(self):
        return contextlib.nullcontext()  # Paddle's auto_cast keeps no cache of cast weights

    def rng_state(self, module=None):
        return paddle.get_rng_state()

    def set_rng_state(self, state) -> None:
        paddle.set_rng_state(state)


BRIDGE = PaddleAutogradBridge()
