"""Level >= 1 on torch: Dynamo's guards skip a module subtree whose dicts kept their version tags
(backends/torch/guard_reads.py, tag_skipping_guards). Every change to what the forward read under the model
still stops replays (a `guard` fallback) and the call equals eager; undone, replays resume. (A
submodule replaced: tests/both/test_replay_module_changes.py.) Simulated
graphs on CPU replay the recorded graph, so a value baked into it would show here."""
import pytest
import torch

import graph_opt
from torch_zoo.small import HIDDEN, SIZES, make_x

_CI_SECONDS = 4


def _closure(scale):
    def scaled(x):
        return x * scale

    def set_scale(value):
        nonlocal scale
        scale = value

    return scaled, set_scale


class Base(torch.nn.Module):
    eps = 0.5  # read through the instance: Dynamo guards its value in this class

    def __init__(self):
        super().__init__()
        self.k = 1.5
        self.flag = True
        self.opts = {"s": 2.0}
        self.table = torch.randn(HIDDEN)
        self.scaled, self.set_scale = _closure(3.0)

    def forward(self, x):
        y = self.scaled(x * self.k * self.eps * self.opts["s"] + self.table)
        return y + 1 if self.flag else y - 1


class Head(Base):
    """The instance's own class: a value set here after capture shadows Base's."""


class Model(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = Head()

    def forward(self, x):
        return self.head(self.lin(x))


def _restore_classes():
    if "eps" in vars(Head):
        del Head.eps
    Base.eps = 0.5


CHANGES = {
    "a submodule's attribute": (lambda m: setattr(m.head, "k", 2.5), lambda m: setattr(m.head, "k", 1.5)),
    "a submodule's flag": (lambda m: setattr(m.head, "flag", False), lambda m: setattr(m.head, "flag", True)),
    "a value in a dict it holds": (lambda m: m.head.opts.__setitem__("s", 7.0),
                                   lambda m: m.head.opts.__setitem__("s", 2.0)),
    "a closure's variable": (lambda m: m.head.set_scale(5.0), lambda m: m.head.set_scale(3.0)),
    "a function set on the instance": (lambda m: setattr(m.head, "scaled", lambda x: x * 9.0), None),
    "a class value on its defining class": (lambda m: setattr(Base, "eps", 4.0), lambda m: _restore_classes()),
    "a class value set on the instance's own class": (lambda m: setattr(Head, "eps", 4.0),
                                                     lambda m: _restore_classes()),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_under_the_model_stops_replays_and_equals_eager(change, graph_opt_warnings):
    torch.manual_seed(0)
    m = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))(
        graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=SIZES))
    head = m.head
    scaled = head.scaled
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    x = make_x(4)
    apply, undo = CHANGES[change]
    try:
        with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
            assert torch.equal(m(x), Model.forward(m, x))
            apply(m)
            for _ in range(2):
                assert torch.equal(m(x), Model.forward(m, x))
        s = graph_opt.stats(m)
        assert s.replays == 1 and s.fallback_reasons == {"guard": 2}, s.fallback_reasons
        if undo is None:
            m.head = head
            head.scaled = scaled
        else:
            undo(m)
        with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
            assert torch.equal(m(x), Model.forward(m, x))
        assert graph_opt.stats(m).replays == 2, graph_opt.stats(m).fallback_reasons
    finally:
        _restore_classes()


class Doubled(Head):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("level", [0, 1])
def test_a_submodules_class_assigned_after_capture_stops_replays_and_equals_eager(level, graph_opt_warnings):
    """`layer.__class__ = Other` (how quantization and adapter libraries swap a layer) writes no dict."""
    torch.manual_seed(0)
    m = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))(
        graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=SIZES))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    x = make_x(4)
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        assert torch.equal(m(x), Model.forward(m, x))
        m.head.__class__ = Doubled
        assert torch.equal(m(x), Model.forward(m, x))
        s = graph_opt.stats(m)
        assert s.replays == 1 and s.fallback_reasons == {"replaced": 1}, s.fallback_reasons
        assert any("head is a Doubled (was a Head)" in w for w in graph_opt_warnings()), graph_opt_warnings()
        m.head.__class__ = Head
        assert torch.equal(m(x), Model.forward(m, x))
    assert graph_opt.stats(m).replays == 2
