"""graph_opt.explain(model, *args): what the call would do, said without making it (no forward runs, no
counter moves), and what the call then does agrees; graph_opt.config_of(model)."""
import logging

import pytest
import torch

import graph_opt
from graph_opt import GraphOptInputError
from graph_opt.explain import CAPTURE, RAISE, REPLAY, WITHOUT
from graph_opt.watch.fallbacks import Reason

_CI_SECONDS = 4


@graph_opt.support_graph_optimization
class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 2


class _Ops(torch.overrides.TorchFunctionMode):
    """The torch operations run meanwhile (not attribute reads such as .shape)."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("linear", "mul", "__mul__", "copy_", "zero_", "fill_"):
            self.ran.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _model(level=0, **cfg):
    torch.manual_seed(0)
    return Counted(graph_opt_config=dict(graph_opt_level=level, cudagraph_capture_sizes=[2, 4], **cfg)).eval()


def _said(m, *args):
    """explain's answer, checked to have run nothing and moved nothing."""
    before = graph_opt.stats(m)
    answer = graph_opt.explain(m, *args)
    with _Ops() as ops:  # apart: Dynamo's guards see the mode itself (a level-1 answer would be 'guard')
        graph_opt.explain(m, *args)
    assert graph_opt.stats(m) == before and ops.ran == []
    return answer


def _capture(m):
    graph_opt.capture_model(m, lambda bs: torch.randn(bs, 4), progress=False)


@pytest.mark.parametrize("level", [0, 1])
def test_before_any_capture_it_says_the_call_captures_its_padded_size(level, simulated):
    m = _model(level)
    with torch.no_grad():
        said = _said(m, torch.randn(3, 4))
        assert (said.action, said.padded_size, said.rows, said.captured_sizes) == (CAPTURE, 4, 3, [])
        assert "nothing is captured yet" in said.why and "capture_model()" in said.fix
        assert m.__dict__["_graph_opt_state"].runner is None  # not even a runner was made
        x = torch.randn(3, 4)
        torch.testing.assert_close(m(x), type(m).forward(m, x))
        assert graph_opt.stats(m).lazy_captures == 1  # the call did what it said


@pytest.mark.parametrize("level", [0, 1])
def test_after_capture_it_says_replay_and_the_call_replays(level, simulated, caplog):
    m = _model(level)
    with torch.no_grad():
        _capture(m)
        said = _said(m, torch.randn(3, 4))
        assert (said.action, said.padded_size, said.rows, said.reason) == (REPLAY, 4, 3, None)
        assert said.captured_sizes == [2, 4]
        x = torch.randn(3, 4)
        torch.testing.assert_close(m(x), type(m).forward(m, x))
        assert graph_opt.stats(m).replays == 1
    assert "replay: padded size 4 for a call of 3 rows" in str(said)


def test_each_fallback_it_names_is_the_one_the_call_counts(simulated):
    m = _model()
    with torch.no_grad():
        _capture(m)
        above = _said(m, torch.randn(9, 4))
        assert (above.action, above.reason, above.rows) == (WITHOUT, Reason.ABOVE_MAX, 9)
        assert "max_capture_size" in above.fix and "above the largest capture size, 4" in above.why
        other_shape = _said(m, torch.randn(3, 5))
        assert (other_shape.action, other_shape.reason) == (WITHOUT, Reason.MISMATCH)
        assert "argument 'x' has shape [3, 5]" in other_shape.why
        m(torch.randn(9, 4))
        assert graph_opt.stats(m).fallback_reasons == {"above_max": 1}
    grad = _said(m, torch.randn(3, 4))  # autograd on
    assert (grad.action, grad.reason) == (WITHOUT, Reason.GRAD) and "no_grad" in grad.fix
    with torch.no_grad():
        m.train()
        training = _said(m, torch.randn(3, 4))
        assert (training.reason, training.action) == (Reason.TRAINING, WITHOUT)
        assert "Counted is in training mode; the graphs were captured in eval mode" in training.why
        assert "model.eval()" in training.fix
        assert "(reason 'training')" in str(training) and "fix: call model.eval()" in str(training)


def test_arguments_the_call_would_refuse_are_named_as_the_call_names_them(simulated):
    m = _model()
    with torch.no_grad():
        _capture(m)
        for bad, fragment in [(torch.randn(3, 4, dtype=torch.float64), "has dtype torch.float64"),
                              (torch.empty(3, 4, device="meta"), "is on device meta"),
                              (torch.randn(3, 4, 1), "has 3 dimensions")]:
            said = _said(m, bad)
            assert said.action == RAISE and fragment in said.why, said
            with pytest.raises(GraphOptInputError) as err:
                m(bad)
            assert said.why in str(err.value)


def test_graphs_turned_off_or_disabled_are_said_with_where_the_setting_came_from(simulated, monkeypatch):
    off = _model(use_cudagraph=False)
    said = _said(off, torch.randn(3, 4))
    assert said.action == WITHOUT and "use_cudagraph is false (from dict)" in said.why, said.why
    monkeypatch.setenv("GRAPH_OPT_DISABLE", "1")
    said = graph_opt.explain(_model(), torch.randn(3, 4))
    assert said.action == WITHOUT and "GRAPH_OPT_DISABLE" in said.why


def test_it_logs_nothing(simulated, caplog):
    m = _model()
    with torch.no_grad():
        _capture(m)
        caplog.clear()
        for x in (torch.randn(9, 4), torch.randn(3, 5), torch.randn(3, 4)):
            graph_opt.explain(m, x)
    assert not [r for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.INFO]


def test_what_it_does_not_take_is_named_with_what_it_takes():
    accepted = "an instance of a class decorated with @graph_opt.support_graph_optimization"
    block = graph_opt.autocudagraph(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="got a block made by graph_opt.autocudagraph") as err:
        graph_opt.explain(block, torch.randn(2, 4))
    assert accepted in str(err.value)
    with pytest.raises(TypeError, match=f"{accepted}; got a Linear, whose class is not decorated"):
        graph_opt.explain(torch.nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(TypeError, match="got the class Counted: pass an instance"):
        graph_opt.config_of(Counted)


def test_config_of_is_a_copy_that_says_where_each_value_came_from(monkeypatch):
    monkeypatch.setenv("GRAPH_OPT_NUM_WARMUPS", "3")
    m = _model()
    cfg = graph_opt.config_of(m)
    assert isinstance(cfg, graph_opt.GraphOptConfig)
    assert (cfg.cudagraph_capture_sizes, cfg.sources["cudagraph_capture_sizes"]) == ([2, 4], "dict")
    assert (cfg.cudagraph_num_of_warmups, cfg.sources["cudagraph_num_of_warmups"]) == (3, "env:GRAPH_OPT_NUM_WARMUPS")
    assert cfg.sources["full_cuda_graph"] == "default" and "env:GRAPH_OPT_NUM_WARMUPS" in cfg.describe()
    cfg.cudagraph_capture_sizes = [8]
    assert graph_opt.config_of(m).cudagraph_capture_sizes == [2, 4]


def test_without_cuda_graphs_here_it_says_so_and_how_to_simulate_them():
    said = graph_opt.explain(_model(), torch.randn(3, 4))  # CPU, no simulation
    assert said.action == WITHOUT and "CUDA graphs are unavailable here (torch" in said.why
    assert "simulate_cuda_graphs()" in said.fix and said.reason is None
