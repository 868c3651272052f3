"""Device tensors a forward makes from Python numbers (`torch.tensor(0.0, device=x.device)`, as
transformers' eager attention mask does) at graph_opt_level 1: made once when Dynamo traces, copied on
the device at each call. On a device the copy from the host is what a capture refuses
(tests/gpu/test_gpu_capture_errors.py captures it there); here, that each call still gets a fresh
tensor, equal to eager's, even when the forward writes into it."""
import pytest
import torch

import graph_opt
from graph_opt.backends.torch.host_constants import fold_host_constants
from graph_opt.decorator import state_of
from torch_zoo.small import padded

_FACTORIES = (torch.tensor, torch.as_tensor)


class MakesConstants(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        zero = torch.tensor(0.0, device=x.device, dtype=x.dtype)
        zero.add_(x.sum())  # written in place: every call must start from 0.0 again
        scale = torch.as_tensor([1.0, 2.0], device=x.device)
        shift = x.new_tensor([3.0, -1.0] * 4)
        return torch.where(x > 0, zero, self.lin(x)) * scale.sum() + shift


def _makes_tensors(gm) -> list:
    return [n for n in gm.graph.nodes
            if (n.op == "call_function" and n.target in _FACTORIES) or (n.op == "call_method" and n.target == "new_tensor")]


def _dynamo_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


def test_the_pass_makes_each_constant_once_and_each_call_gets_a_fresh_copy():
    torch.manual_seed(0)
    model = MakesConstants()
    x = torch.randn(4, 8)
    gm = _dynamo_graph(model, x)
    assert len(_makes_tensors(gm)) == 3
    inputs = [x, model.lin.weight, model.lin.bias]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs), [n.name for n in placeholders]
    assert fold_host_constants(gm, keep_host_ops_out=False) == 3
    assert _makes_tensors(gm) == []
    with torch.no_grad():
        for step in range(3):  # the in-place write of one call must not reach the next
            x = torch.randn(4, 8)
            assert torch.equal(gm(x, model.lin.weight, model.lin.bias)[0], model(x)), step


def test_a_host_tensor_in_a_graph_on_a_device_is_left_to_the_host_op_rule():
    def fn(x):
        return x + torch.tensor([1.0, 2.0])  # on the host: no copy to a device, nothing to fold

    gm = _dynamo_graph(fn, torch.randn(3, 2))
    assert fold_host_constants(gm, keep_host_ops_out=True) == 0
    assert len(_makes_tensors(gm)) == 1


@pytest.mark.parametrize("data", [[[1, 2], [3, 4]], (True, False), 7])
def test_nested_lists_bools_and_ints_keep_their_dtype(data):
    def fn(x):
        return x + torch.tensor(data, device=x.device)

    gm = _dynamo_graph(fn, torch.zeros(2, 2, dtype=torch.long))
    assert fold_host_constants(gm, keep_host_ops_out=False) == 1
    x = torch.arange(4).reshape(2, 2)
    out = gm(x)[0]
    assert out.dtype == fn(x).dtype and torch.equal(out, fn(x))


def test_data_given_by_keyword_is_folded_too():
    def fn(x):
        return x + torch.tensor(data=[1.0, 2.0], device=x.device) + x.new_tensor(data=[0.5, 0.25])

    gm = _dynamo_graph(fn, torch.zeros(3, 2))
    assert fold_host_constants(gm, keep_host_ops_out=False) == 2
    x = torch.randn(3, 2)
    assert torch.equal(gm(x)[0], fn(x))


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_decorated_model_replays_them_bitwise_at_level_1(full):
    torch.manual_seed(0)
    twin = MakesConstants().eval()
    cls = graph_opt.support_graph_optimization(type("Graphed", (MakesConstants,), {}))
    config = graph_opt.GraphOptConfig(graph_opt_level=1, full_cuda_graph=full, cudagraph_capture_sizes=[2, 4])
    m = cls(graph_opt_config=config).eval()
    m.load_state_dict(twin.state_dict())
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        assert graph_opt.capture_model(m, lambda n: torch.randn(n, 8), progress=False).failed is None
        for step in range(3):
            x = torch.randn(4 if step else 3, 8)
            assert torch.equal(m(x), twin(padded(x, [2, 4]))[:len(x)]), step
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallbacks == 0, s.fallback_reasons
    pieces = [f.split.module for f in state_of(m).runner.strategy.forwards]
    assert pieces and not any(_makes_tensors(p) for g in pieces for p in [g, *g.children()])
