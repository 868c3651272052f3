"""Device tensors a forward makes from Python numbers, made once when Dynamo traces.

Model code often writes `torch.tensor(0.0, device=mask.device, dtype=dtype)` (transformers' eager
attention mask): torch builds that tensor on the host and copies it to the device, a copy from pageable
memory that a CUDA graph capture refuses. In a Dynamo graph such a call has only constants for
arguments, so the pass below makes the tensor once, at trace time, and replaces the call with a copy of
it on the device (`clone`): a device-to-device copy that a graph captures. Each call still gets a fresh
tensor, as in eager, so a forward that writes into it in place changes nothing for the next call.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

_FACTORIES = (torch.tensor, torch.as_tensor)
_ATTR = "_graph_opt_host_constant_"


def fold_host_constants(gm: torch.fx.GraphModule, keep_host_ops_out: bool) -> int:
    """Replace each `torch.tensor(data, ...)` / `torch.as_tensor(data, ...)` / `x.new_tensor(data)` whose
    data is Python numbers by a copy of a tensor made now; returns how many. A host tensor made this way
    in a graph that computes on a device (keep_host_ops_out) is left alone: it is no device copy, and
    host ops stay out of graphs anyway (fx_split)."""
    folded = 0
    for node in list(gm.graph.nodes):
        made = _constant_of(node)
        if made is None or (keep_host_ops_out and made.device.type == "cpu"):
            continue
        name = f"{_ATTR}{folded}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, made, persistent=False)
        with gm.graph.inserting_before(node):
            stored = gm.graph.get_attr(name)
            stored.meta["example_value"] = made
            copy = gm.graph.call_method("clone", (stored,))
        copy.meta = dict(node.meta)
        node.replace_all_uses_with(copy)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.recompile()
    return folded


def _constant_of(node: torch.fx.Node):
    """The tensor the node makes when every input is a Python constant; else None."""
    kwargs = dict(node.kwargs)
    if node.op == "call_function" and node.target in _FACTORIES:
        args = node.args or ((kwargs.pop("data"),) if "data" in kwargs else ())
        if len(args) != 1 or not _numbers(args[0]) or not _plain(kwargs) or kwargs.get("requires_grad"):
            return None
        return node.target(args[0], **kwargs)
    if node.op == "call_method" and node.target == "new_tensor":
        example = node.meta.get("example_value")
        args = node.args[1:] or ((kwargs.pop("data"),) if "data" in kwargs else ())
        if (len(args) != 1 or not isinstance(example, torch.Tensor) or not _numbers(args[0]) or not _plain(kwargs)
                or kwargs.get("requires_grad")):
            return None
        return torch.tensor(args[0], dtype=example.dtype, device=example.device)
    return None


def _numbers(data: Any) -> bool:
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_numbers(d) for d in data)
    return isinstance(data, (bool, numbers.Number)) and not isinstance(data, torch.Tensor)


def _plain(kwargs: dict) -> bool:
    """Keyword arguments of constants only (dtype, device, requires_grad ...): no graph value."""
    return not any(isinstance(v, torch.fx.Node) for v in kwargs.values())
