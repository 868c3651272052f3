"""Paddle side of graph_opt.autocudagraph: autograd, parameters, autocast and random state.

The replayed forward enters autograd as a paddle.autograd.PyLayer whose backward replays the backward
graph. Runs on CPU with simulated graphs; the CUDA path is written against the Paddle 3.2+ API and has
not been run (no Paddle GPU build runs on the machines this was built on).
"""
from __future__ import annotations

import contextlib

import paddle


class _ReplayStep(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, block, graphs, *tensors):
        return block.forward_for_grad(ctx, graphs, tensors)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(ctx.block.backward_for_grad(ctx, grads))  # PyLayer wants grads of tensor inputs only


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

    def copy_detached(self, dst, src) -> None:
        with paddle.no_grad():
            dst.copy_(src.detach(), False)

    def set_grad(self, t, grad) -> None:
        t.grad = grad

    def hand_out(self, buffers, inputs, lent):
        """The gradients backward returns, one per input. Paddle's accumulation shares the first
        gradient a leaf gets (also after clear_gradients(set_to_zero=False)), so a leaf gets a copy."""
        return [buf.clone() if buf is not None and t.is_leaf else buf for buf, t in zip(buffers, inputs)]

    @staticmethod
    def addresses(tensors):
        return [t.data_ptr() for t in tensors]

    # -- autograd --------------------------------------------------------------------------------
    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def enable_grad(self):
        return paddle.enable_grad()

    def grad(self, outputs, inputs, grad_outputs, retain_graph: bool = False):
        return paddle.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)

    def apply(self, block, graphs, tensors):
        return _ReplayStep.apply(block, graphs, *tensors)

    # -- parameters ------------------------------------------------------------------------------
    def trainable_parameters(self, layer):
        return [p for p in layer.parameters() if not p.stop_gradient]

    def owned_tensors(self, layer):
        """(owner dict, name, tensor) for every parameter and buffer: replacing one shows in its owner."""
        out = []
        for sub in layer.sublayers(include_self=True):
            for owner in (sub._parameters, sub._buffers):
                out.extend((owner, name, t) for name, t in owner.items() if t is not None)
        return out

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
        tracer = paddle.base.framework._dygraph_tracer()
        return tracer._amp_level, tracer._amp_dtype

    def amp_cache_disabled(self):
        return contextlib.nullcontext()  # Paddle's auto_cast keeps no cache of cast weights

    def rng_state(self):
        return paddle.get_rng_state()

    def set_rng_state(self, state) -> None:
        paddle.set_rng_state(state)


BRIDGE = PaddleAutogradBridge()
