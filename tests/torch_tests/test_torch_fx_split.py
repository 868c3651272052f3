"""fx_split.split_graph: where a Dynamo FX graph is cut, as a pure function of the graph."""
import operator

import torch
from torch.fx.passes.shape_prop import ShapeProp

import graph_opt
from graph_opt.capture import split
from graph_opt.backends.torch import fx_split
from torch_zoo.small import mix  # noqa: F401  (registers the custom op and the splitting op)


def _traced(fn, *example):
    gm = torch.fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(*example)  # fills node.meta["tensor_meta"]; example_value comes next
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None:
            node.meta["example_value"] = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    return gm


def _piece_kinds(graph):
    return ["graph" if p.capturable else "eager" for p in graph.pieces]


def test_splits_at_a_custom_op_by_its_qualified_name_and_keeps_order():
    def fn(x, lens):
        y = torch.sin(x)
        z = torch.ops.graph_opt_test.row_scale(y, lens)
        return torch.cos(z) + 1

    gm = _traced(fn, torch.randn(4, 3), torch.ones(4, dtype=torch.long))
    selection = split.SplitSelection(["graph_opt_test::row_scale"])
    graph = fx_split.split_graph(gm, fx_split.splitting_op_matcher(selection), keep_host_ops_out=False)
    assert _piece_kinds(graph) == ["graph", "eager", "graph"]
    assert graph.pieces[1].split_ops == ["graph_opt_test::row_scale"]
    x, lens = torch.randn(4, 3), torch.arange(4)
    assert torch.equal(graph.module(x, lens), fn(x, lens))


def test_no_selection_means_no_split():
    def fn(x, lens):
        return torch.ops.graph_opt_test.row_scale(torch.sin(x), lens)

    gm = _traced(fn, torch.randn(4, 3), torch.ones(4, dtype=torch.long))
    graph = fx_split.split_graph(gm, fx_split.splitting_op_matcher(None), keep_host_ops_out=False)
    assert _piece_kinds(graph) == ["graph"]


def test_python_splitting_op_is_one_node_and_splits_by_its_registered_name():
    wrapper = split.registered()["test_mix"]
    graph = torch.fx.Graph()  # what a Dynamo trace makes of a selected splitting op: one node
    x = graph.placeholder("x")
    y = graph.call_function(torch.sin, (x,))
    assert fx_split.splitting_op_router(split.SplitSelection(["test_mix"])) is not None
    z = graph.call_function(fx_split.call_splitting_op, ("test_mix", y))
    graph.output(graph.call_function(torch.cos, (z,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    for selection, kinds in ((split.SplitSelection(None), ["graph", "eager", "graph"]),
                             (split.SplitSelection(["test_mix"]), ["graph", "eager", "graph"]),
                             (split.SplitSelection(["other"]), ["graph"])):
        result = fx_split.split_graph(gm, fx_split.splitting_op_matcher(selection), keep_host_ops_out=False)
        assert _piece_kinds(result) == kinds
    t = torch.randn(3)
    assert torch.equal(result.module(t), torch.cos(wrapper(torch.sin(t))))


def test_host_ops_stay_out_of_graphs_and_their_outputs_stay_on_the_host():
    # "meta" plays the device here: the graph computes on a non-host device, lens lives on the host.
    class Fn(torch.nn.Module):
        def forward(self, x, lens):
            y = torch.sin(x)
            n = lens + 1  # host op: reads a CPU tensor
            m = n * 2  # host op
            return torch.cos(y), m

    gm = torch.fx.symbolic_trace(Fn())
    values = {"x": torch.empty(4, 3, device="meta"), "lens": torch.ones(4, dtype=torch.long)}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = values[node.target]
        elif node.op == "call_function":
            device = "cpu" if node.target in (operator.add, operator.mul) else "meta"
            dtype = torch.long if device == "cpu" else torch.float32
            node.meta["example_value"] = torch.empty(4, 3 if device == "meta" else 1, dtype=dtype, device=device)
    assert fx_split.computes_on_device(gm)
    graph = fx_split.split_graph(gm, fx_split.splitting_op_matcher(None), keep_host_ops_out=True)
    kinds = _piece_kinds(graph)
    assert kinds.count("eager") == 1 and graph.pieces[kinds.index("eager")].host_ops == 2
    sub = getattr(graph.module, graph.pieces[kinds.index("eager")].name)
    assert not any(n.target in ("to", "cuda") or "copy" in str(n.target) for n in sub.graph.nodes)  # no device copy
    x, lens = torch.randn(4, 3), torch.arange(4)
    y, m = graph.module(x, lens)
    assert torch.equal(m, (lens + 1) * 2) and m.device.type == "cpu"


def test_in_place_mutations_keep_their_order_across_pieces():
    def fn(x, lens, buf):
        buf.add_(1)
        z = torch.ops.graph_opt_test.row_scale(buf, lens)
        buf.mul_(3)
        return z + buf

    gm = _traced(fn, torch.randn(4, 3), torch.ones(4, dtype=torch.long), torch.zeros(4, 3))
    selection = split.SplitSelection(["graph_opt_test::row_scale"])
    graph = fx_split.split_graph(gm, fx_split.splitting_op_matcher(selection), keep_host_ops_out=False)
    assert _piece_kinds(graph) == ["graph", "eager", "graph"]
    b1, b2 = torch.zeros(4, 3), torch.zeros(4, 3)
    lens = torch.arange(4)
    assert torch.equal(graph.module(torch.ones(4, 3), lens, b1), fn(torch.ones(4, 3), lens, b2))
    assert torch.equal(b1, b2)


def test_size_arithmetic_does_not_start_a_piece():
    # As Dynamo traces dynamic shapes: the batch size is a SymInt input, its arithmetic has no tensor.
    graph = torch.fx.Graph()
    s, x, lens = graph.placeholder("s"), graph.placeholder("x"), graph.placeholder("lens")
    row_scale = torch.ops.graph_opt_test.row_scale.default
    z = graph.call_function(row_scale, (x, lens))
    n = graph.call_function(operator.mul, (s, 2))
    z2 = graph.call_function(row_scale, (z, lens))
    graph.output(graph.call_function(torch.reshape, (graph.call_function(torch.sin, (z2,)), (n, -1))))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    examples = {"s": 4, "x": torch.empty(4, 3, device="meta"), "lens": torch.ones(4, dtype=torch.long)}
    for node in gm.graph.nodes:
        node.meta["example_value"] = examples.get(node.name, 8 if node.target is operator.mul
                                                  else torch.empty(4, 3, device="meta"))
    selection = split.SplitSelection(["graph_opt_test::row_scale"])
    result = fx_split.split_graph(gm, fx_split.splitting_op_matcher(selection), keep_host_ops_out=False)
    assert _piece_kinds(result) == ["eager", "graph"]
    assert result.pieces[0].split_ops == ["graph_opt_test::row_scale"] * 2


def test_op_names_of_a_custom_op_node():
    gm = _traced(lambda x, lens: torch.ops.graph_opt_test.row_scale(x, lens), torch.randn(2, 2),
                 torch.ones(2, dtype=torch.long))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    names = fx_split.op_names(node)
    assert "graph_opt_test::row_scale" in names
    assert graph_opt.GraphOptConfig(cudagraph_splitting_ops=names).cudagraph_splitting_ops == names


def test_a_builtin_is_named_by_its_public_name_too():
    """torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention:
    a config naming it as users write it splits there."""
    q = torch.randn(2, 2, 3, 4)
    gm = _traced(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q), q)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    names = fx_split.op_names(node)
    assert "torch.nn.functional.scaled_dot_product_attention" in names
    match = fx_split.splitting_op_matcher(split.SplitSelection(["torch.nn.functional.scaled_dot_product_attention"]))
    assert match(node) == "torch.nn.functional.scaled_dot_product_attention"
