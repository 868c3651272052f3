"""PyTorch side of graph_opt.autocudagraph: autograd, parameters, autocast and random state.

The replayed forward enters autograd as a torch.autograd.Function whose backward replays the backward
graph; this follows torch.cuda.make_graphed_callables, with the differences graph_opt.training lists
(outputs copied, leaves' first gradients copied, no second forward before a pending backward).
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable


_data_ptr = torch.Tensor.data_ptr
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


class _ReplayStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, graphs, *tensors):
        return block.forward_for_grad(ctx, graphs, tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, None) + tuple(ctx.block.backward_for_grad(ctx, grads))  # none for block and graphs


class TorchAutogradBridge:
    def __init__(self):
        self._tensor = torch.Tensor

    # -- tensors ---------------------------------------------------------------------------------
    def is_tensor(self, x) -> bool:
        return isinstance(x, self._tensor)

    def shape(self, t):
        return t.shape

    def leaf_key(self, t):
        return t.shape, t.dtype, t.requires_grad, t.device

    def requires_grad(self, t) -> bool:
        return t.requires_grad

    def static_input(self, t):
        s = t.detach().clone(memory_format=torch.contiguous_format)
        return s.requires_grad_(True) if t.requires_grad else s

    def detach(self, t):
        return t.detach()

    def clone(self, t):
        return t.clone()

    def zero_(self, t) -> None:
        t.zero_()

    def zeros_like(self, t):
        return torch.zeros_like(t, memory_format=torch.contiguous_format)

    def ones_like(self, t):
        return torch.ones_like(t)

    def copy_detached(self, dst, src) -> None:
        with torch.no_grad():
            dst.copy_(src)

    def set_grad(self, t, grad) -> None:
        with torch.no_grad():
            t.grad = grad

    def hand_out(self, buffers, inputs, lent):
        """The gradients backward returns, one per input: the static buffers. A leaf without a .grad
        keeps what it is handed as its .grad, so it gets a tensor of its own over the buffer (no copy),
        recorded in `lent`: the block gives it a copy before the next replay if it still holds it."""
        out = []
        for buf, t in zip(buffers, inputs):
            if buf is not None and t.is_leaf and t.grad is None:
                lent.append((t, buf))
                buf = buf.detach()
            out.append(buf)
        return out

    @staticmethod
    def addresses(tensors):
        return list(map(_data_ptr, tensors))

    # -- autograd --------------------------------------------------------------------------------
    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def enable_grad(self):
        return torch.enable_grad()

    def grad(self, outputs, inputs, grad_outputs, retain_graph: bool = False):
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)

    def apply(self, block, graphs, tensors):
        return _ReplayStep.apply(block, graphs, *tensors)

    # -- parameters ------------------------------------------------------------------------------
    def trainable_parameters(self, module):
        return [p for p in module.parameters() if p.requires_grad]

    def owned_tensors(self, module):
        """(owner dict, name, tensor) for every parameter and buffer: replacing one shows in its owner."""
        out = []
        for sub in module.modules():
            for owner in (sub._parameters, sub._buffers):
                out.extend((owner, name, t) for name, t in owner.items() if t is not None)
        return out

    @contextlib.contextmanager
    def parameters_for_capture(self, module, params):
        """Within the block, `module` holds fresh Parameters over the same storage as `params` (a tied
        parameter stays tied); yields them in the order of `params`."""
        aliases = {id(p): torch.nn.Parameter(p.detach(), requires_grad=True) for p in params}
        swapped = []
        for sub in module.modules():
            owner = sub._parameters
            for name, p in owner.items():
                if p is not None and id(p) in aliases:
                    swapped.append((owner, name, p))
        try:
            for owner, name, p in swapped:
                owner[name] = aliases[id(p)]
            yield [aliases[id(p)] for p in params]
        finally:
            for owner, name, p in swapped:
                owner[name] = p

    def snapshot_grads(self, tensors):
        return [(t, t.grad, None if t.grad is None else t.grad.clone()) for t in tensors if t.is_leaf]

    def restore_grads(self, snapshot) -> None:
        with torch.no_grad():
            for t, grad, values in snapshot:
                if grad is None:
                    t.grad = None
                else:
                    if t.grad is not grad:
                        t.grad = grad
                    grad.copy_(values)

    # -- autocast and random state ---------------------------------------------------------------
    def amp_state(self):
        if not _any_autocast():  # one call on the common path instead of four
            return None
        return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))

    @contextlib.contextmanager
    def amp_cache_disabled(self):
        """Autocast caches the low-precision copies of weights for the length of a region. A graph that
        read a copy cached before its capture would keep reading it after the weights changed, so the
        cache is off while capturing: the casts become part of the graph."""
        enabled = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            yield
        finally:
            torch.set_autocast_cache_enabled(enabled)

    def rng_state(self):
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def set_rng_state(self, state) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


BRIDGE = TorchAutogradBridge()
