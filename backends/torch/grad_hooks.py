"""Hooks of tensors that get no gradient in a backward through a graphed block (torch).

Eager autograd never runs them. Every tensor of a graphed block is an input of its one autograd node, and
autograd runs the hooks of each input of a node it reaches, and of what lies upstream, with None where
the node returned no gradient; this module holds such hooks for the rest of that backward. Also the walk
from autograd nodes to the leaves they reach, and whether a leaf's gradient goes into its .grad, which
the bridge uses too.
"""
from __future__ import annotations

from typing import Dict

import torch

_will_run = getattr(torch._C, "_will_engine_execute_node", None)


def leaves_reached(roots, mark=None):
    """({id: leaf} of the leaves requiring grad that the autograd graph from `roots` reaches, whether it
    reaches a node older than `mark`, where the walk stops)."""
    # Holds each node seen: a node's Python object is made anew on each access, and an id freed with it
    # could come back for another node
    stack, seen, found, older = list(roots), {}, {}, False
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            found[id(variable)] = variable
            continue
        if mark is not None and node._sequence_nr() < mark:
            older = True
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found, older


def graph_nodes(root, wanted) -> set:
    """The (name, sequence number) keys among `wanted` of the nodes the autograd graph from `root` reaches;
    the walk stops once all are found."""
    stack, seen, found = [root], {}, set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node  # held: an id freed with a node could come back for another
        key = (node.name(), node._sequence_nr())
        if key in wanted:
            found.add(key)
            if len(found) == len(wanted):
                break
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


class _HooksWithoutGrad:
    """One tensor's hooks, held for the rest of a backward that gives it no gradient: tensor hooks run only
    on a defined gradient (one that came from another use of the tensor), post-accumulate-grad hooks only
    after one was accumulated. torch's register_multi_grad_hook(mode="all") counts the calls autograd will
    make: its hooks keep being called."""

    def __init__(self, t, task: int):
        self.tensor, self.task = t, task
        self.arrived = False
        self.had_hooks = t._backward_hooks is not None
        self.held = []  # (hooks dict, key, the user's hook)
        self.handle = t.register_hook(self._note)  # after the user's: sees the gradient they made
        for hooks, wrap in ((t._backward_hooks, _SkipNone), (t._post_accumulate_grad_hooks, _AfterArrival)):
            for key, hook in list((hooks or {}).items()):
                if key != self.handle.id and not getattr(hook, "__qualname__", "").startswith(_MULTI_GRAD):
                    self.held.append((hooks, key, hook))
                    hooks[key] = wrap(hook, self)

    @classmethod
    def hold(cls, tensors) -> None:
        task = torch._C._current_graph_task_id()
        for held in [h for h in _HELD.values() if h.task != task]:
            held.release()  # a backward that raised never ended its hold
        for t in tensors:
            if id(t) not in _HELD:  # held already: the block ran twice in this forward
                held = _HELD[id(t)] = cls(t, task)
                torch.autograd.Variable._execution_engine.queue_callback(held.release)

    def _note(self, g):
        self.arrived = g is not None

    def release(self) -> None:
        if _HELD.get(id(self.tensor)) is not self:
            return
        del _HELD[id(self.tensor)]
        for hooks, key, hook in self.held:
            if key in hooks:  # not removed by its handle meanwhile
                hooks[key] = hook
        self.handle.remove()
        t = self.tensor
        if not self.had_hooks and not t._backward_hooks:
            t._backward_hooks = None
        self.tensor = None


_HELD: Dict[int, _HooksWithoutGrad] = {}  # id(tensor) -> its hooks held until the backward that held them ends
_MULTI_GRAD = "register_multi_grad_hook."


class _SkipNone:
    """A tensor hook run only on a defined gradient; saved (torch.save) as the hook itself."""

    __slots__ = ("hook",)

    def __init__(self, hook, held):
        self.hook = hook

    def __call__(self, g):
        return None if g is None else self.hook(g)

    def __reduce__(self):
        return _itself, (self.hook,)


class _AfterArrival:
    """A post-accumulate-grad hook run only where a gradient was accumulated; saved as the hook itself."""

    __slots__ = ("hook", "held")

    def __init__(self, hook, held):
        self.hook, self.held = hook, held

    def __call__(self, t):
        return self.hook(t) if self.held.arrived else None

    def __reduce__(self):
        return _itself, (self.hook,)


def _itself(x):
    return x


def _hooked(t) -> bool:
    return bool(t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None))


def hold_without_grad(buffers, inputs) -> None:
    """Inside a backward: hold the hooks of the tensors among `inputs` (and of the leaves upstream of a
    non-leaf one) that get no gradient from it (buffer None)."""
    found = []
    for buf, t in zip(buffers, inputs):
        if buf is None and t.requires_grad:
            if t.grad_fn is None:
                if _hooked(t):
                    found.append(t)
            else:
                found.extend(leaf for leaf in leaves_reached([t.grad_fn])[0].values() if _hooked(leaf))
    if found:
        _HooksWithoutGrad.hold(found)


def accumulates(t, nodes) -> bool:
    """Inside a backward: whether autograd will add this leaf's gradient into its .grad (loss.backward()),
    rather than hand it to the caller (torch.autograd.grad). `nodes`: the block's parameters' AccumulateGrad
    nodes, found once (get_gradient_edge makes a view at each call: ~2.7 µs a parameter on a CPU host)."""
    if _will_run is None:
        return False
    try:
        held = nodes.get(id(t))
        if held is not None and held[0] is t and held[1] is not None:
            return _will_run(held[1])
        node = torch.autograd.graph.get_gradient_edge(t).node
        if held is not None and held[0] is t:  # held, the node is the one autograd uses for t from now on
            nodes[id(t)] = (t, node)
        return _will_run(node)
    except RuntimeError:  # "... currently running autograd.grad()": nothing accumulates into .grad
        return False
