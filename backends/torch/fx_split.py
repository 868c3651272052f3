"""Split a Dynamo FX graph into capturable pieces and eager pieces, keeping the original op order.

An op runs eagerly, outside every graph, when it is a selected splitting op or when it reads or
writes a host (CPU) tensor while the graph computes on a device: a graph would bake the host
value it read at capture, or skip the host write at replay. Host outputs stay on the host: an eager
piece hands its CPU tensors to the next op as they are, with no copy to the device in between.

split_graph is a pure function from a graph to pieces; what runs them is pieces.py's business.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from torch.fx.passes.split_module import split_module

from ...capture import split as split_mod

_GRAPH, _EAGER = "graph", "eager"


# name -> function of every @graph_opt.splitting_op that a Dynamo trace routed to call_splitting_op
_SPLIT_FNS: Dict[str, Callable] = {}


@torch._dynamo.allow_in_graph
def call_splitting_op(name: str, *args, **kwargs):
    """A selected @graph_opt.splitting_op, as one FX node: Dynamo puts this call in the graph without
    tracing into it. Routing through here, rather than allow_in_graph on the user's function, keeps
    the choice per model: another model may select other splitting ops and trace into this one."""
    return _SPLIT_FNS[name](*args, **kwargs)


def splitting_op_router(selection: Optional[split_mod.SplitSelection]) -> Optional[Callable]:
    """The split hook installed while Dynamo traces: selected splitting ops become call_splitting_op nodes."""
    if selection is None:
        return None
    ops = [w.__graph_opt_split__ for w in selection.selected_functions()]
    for op in ops:
        _SPLIT_FNS[op.name] = op.fn
    names = frozenset(op.name for op in ops)

    def route(op, args, kwargs):
        if op.name in names:
            return call_splitting_op(op.name, *args, **kwargs)
        return op.fn(*args, **kwargs)

    return route


@dataclass
class Piece:
    name: str  # the submodule of SplitGraph.module that runs it ("submod_3")
    capturable: bool
    ops: int
    split_ops: List[str] = field(default_factory=list)  # names of the splitting ops it runs
    host_ops: int = 0  # ops kept out of graphs because they touch host tensors


@dataclass
class SplitGraph:
    module: torch.fx.GraphModule  # calls the pieces in the original op order
    pieces: List[Piece]

    @property
    def capturable(self) -> List[Piece]:
        return [p for p in self.pieces if p.capturable]


def op_names(node: torch.fx.Node) -> List[str]:
    """The names a config may use for the op of `node`, most specific first."""
    target = node.target
    if node.op == "call_method":
        return [target, f"Tensor.{target}", f"torch.Tensor.{target}"]
    if node.op != "call_function":
        return []
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name  # "mylib::attention"
        return [name, f"{name}.{target._overloadname}", f"torch.ops.{name.replace('::', '.')}"]
    if isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
        return [name, f"torch.ops.{name.replace('::', '.')}"]
    op = _splitting_op_of(node)
    if op is not None:
        return [op.name, op.qualified_name]
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None)
    names = [f"{module}.{qualname}", qualname] if module else [qualname]
    # The public names of a builtin defined elsewhere: torch.nn.functional.scaled_dot_product_attention
    # is torch._C._nn.scaled_dot_product_attention
    for public in _PUBLIC_MODULES:
        if module != public.__name__ and getattr(public, qualname, None) is target:
            names.append(f"{public.__name__}.{qualname}")
    return names


_PUBLIC_MODULES = (torch.nn.functional, torch)


def splitting_op_matcher(selection: Optional[split_mod.SplitSelection]) -> Callable[[torch.fx.Node], Optional[str]]:
    """node -> the name under which `selection` splits it, or None. No selection: nothing splits."""

    def match(node: torch.fx.Node) -> Optional[str]:
        if selection is None or node.op not in ("call_function", "call_method"):
            return None
        op = _splitting_op_of(node)
        if op is not None:
            return op.name if selection.matches_function(op) else None
        for name in op_names(node):
            if selection.matches_name(name):
                return name
        return None

    return match


def _splitting_op_of(node: torch.fx.Node) -> Optional[split_mod.SplittingOp]:
    if node.op != "call_function":
        return None
    if node.target is call_splitting_op:
        fn = split_mod.registered().get(node.args[0])
        return None if fn is None else split_mod.op_of(fn)
    return split_mod.op_of(node.target)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _example(node) -> object:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def computes_on_device(gm: torch.fx.GraphModule) -> bool:
    """True when some graph input lives on a device other than the host: host tensors then stay out of graphs."""
    return any(t.device.type != "cpu" for n in gm.graph.nodes if n.op == "placeholder" for t in _tensors(_example(n)))


def touches_host(node: torch.fx.Node) -> bool:
    for value in [_example(node)] + [_example(n) for n in node.all_input_nodes]:
        for t in _tensors(value):
            if t.device.type == "cpu":
                return True
    return False


def _has_tensor_output(node) -> bool:
    """True when the node makes a tensor, or when nothing says it does not (no example value recorded)."""
    example = _example(node)
    return example is None or any(True for _ in _tensors(example))


def split_graph(gm: torch.fx.GraphModule, splits_at: Callable[[torch.fx.Node], Optional[str]],
                keep_host_ops_out: bool) -> SplitGraph:
    """Cut `gm` before and after every op that must run eagerly; consecutive eager ops share a piece.

    Ops with no tensor input or output (size arithmetic) join the piece in progress rather than
    starting one. split_module(keep_original_order=True): mutations must not be reordered.
    """
    part_of: Dict[torch.fx.Node, int] = {}
    kinds: Dict[int, str] = {}
    split_names: Dict[int, List[str]] = {}
    host_ops: Dict[int, int] = {}
    ops: Dict[int, int] = {}
    part, kind = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, torch.fx.Node) and source in part_of:
            part_of[node] = part_of[source]  # unpacking a result stays with the op that made it
            continue
        name = splits_at(node)
        host = name is None and keep_host_ops_out and node.op != "get_attr" and touches_host(node)
        if name is not None or host:
            wanted = _EAGER
        elif node.op == "get_attr" or not (_has_tensor_output(node) or any(map(_has_tensor_output, node.all_input_nodes))):
            wanted = kind or _GRAPH  # size arithmetic and constants: no reason to cut here
        else:
            wanted = _GRAPH
        if wanted != kind:
            part, kind = part + 1, wanted
            kinds[part] = kind
        part_of[node] = part
        ops[part] = ops.get(part, 0) + 1
        if name is not None:
            split_names.setdefault(part, []).append(name)
        if host:
            host_ops[part] = host_ops.get(part, 0) + 1
    if part < 0:  # a graph with no op: one empty piece keeps the runner uniform
        kinds[0], ops[0] = _GRAPH, 0
    module = split_module(gm, gm, lambda node: part_of[node], keep_original_order=True)
    pieces = []
    for index in sorted(kinds):
        name = f"submod_{index}"
        if not hasattr(module, name):
            continue
        pieces.append(Piece(name, kinds[index] == _GRAPH and _computes(getattr(module, name)), ops.get(index, 0),
                            split_names.get(index, []), host_ops.get(index, 0)))
    return SplitGraph(module, pieces)


def _computes(piece: torch.fx.GraphModule) -> bool:
    """A piece of size arithmetic alone launches nothing: running it eagerly costs less than a graph."""
    return any(n.op in ("call_function", "call_method", "call_module") and _has_tensor_output(n)
               for n in piece.graph.nodes)
