"""Mistakes that used to pass silently or fail far from their cause, each named with its fix: a model captured
in training mode, and an argument on another device than its static buffer (the meta device stands in for
another device on this CPU host)."""
import logging

import pytest
import torch

import graph_opt
from graph_opt import GraphOptInputError

_CI_SECONDS = 3


@graph_opt.support_graph_optimization
class Net(torch.nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.lin(x)) * 2


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]


def _net(level=0, p=0.0, sizes=(2, 4)):
    torch.manual_seed(0)
    return Net(p, graph_opt_config=dict(graph_opt_level=level, cudagraph_capture_sizes=list(sizes)))


# -- training mode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [0, 1])
def test_capturing_a_model_in_training_mode_warns_and_the_dropout_check_names_it(level, simulated, caplog):
    m = _net(level, p=0.5)  # nn.Module starts in training mode
    with torch.no_grad():
        report = graph_opt.capture_model(m, lambda bs: torch.randn(bs, 8), progress=False)
    said = _warnings(caplog)
    assert any("Net is in training mode, and drop (Dropout) compute otherwise" in w and "model.eval()" in w
               for w in said), said
    # The padded-call check blames training mode, not the forward's rows or branches.
    padded = [w for w in said if "gave other values than eager" in w]
    assert padded and all("drop (Dropout) in training mode" in w and "model.eval()" in w for w in padded), said
    assert not any("reads other rows" in w for w in said), said
    assert any("training mode" in n for n in report.notes)
    with torch.no_grad():
        said = graph_opt.explain(m, torch.randn(3, 8))  # a padded call: what explain() advises is the same
    assert said.reason is not None and said.reason.value == "outputs" and "model.eval()" in said.fix, str(said)


@pytest.mark.parametrize("mode", ["eval", "train-without-dropout", "train-with-dropout-at-p-0"])
def test_a_model_whose_training_mode_changes_nothing_gets_no_training_warning(mode, simulated, caplog):
    m = _net(p=0.5).eval() if mode == "eval" else Net(graph_opt_config=dict(cudagraph_capture_sizes=[2, 4]))
    if mode == "train-without-dropout":
        del m.drop  # training mode, nothing in it that trains otherwise
        m.drop = torch.nn.Identity()
    with torch.no_grad():
        report = graph_opt.capture_model(m, lambda bs: torch.randn(bs, 8), progress=False)
        x = torch.randn(3, 8)
        torch.testing.assert_close(m(x), type(m).forward(m, x))
    assert not any("training mode" in w for w in _warnings(caplog)) and report.failed is None
    assert graph_opt.stats(m).replays == 1


# -- an argument on another device -----------------------------------------------------------------------
def _meta(rows):
    return torch.empty(rows, 8, device="meta")


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "after-replays"])
def test_an_argument_on_another_device_is_named_before_anything_is_written(level, warm, simulated):
    m = _net(level).eval()
    with torch.no_grad():
        graph_opt.capture_model(m, lambda bs: torch.randn(bs, 8), progress=False)
        if warm:  # the common call's shortcut is in place: the device is checked there too
            for _ in range(2):
                m(torch.randn(3, 8))
        before = graph_opt.stats(m)
        with pytest.raises(GraphOptInputError) as err:
            m(_meta(3))
        msg = str(err.value)
        assert "argument 'x' is on device meta" in msg and "takes it on device cpu" in msg, msg
        after = graph_opt.stats(m)
        assert (after.replays, after.fallbacks, after.captures) == (before.replays, before.fallbacks, before.captures)
        x = torch.randn(3, 8)  # the graphs are intact: the next call replays and equals eager
        torch.testing.assert_close(m(x), type(m).forward(m, x))
        assert graph_opt.stats(m).replays == before.replays + 1 and graph_opt.stats(m).disabled_reason is None


def test_an_argument_on_another_device_at_a_size_captured_at_the_call_is_named(simulated):
    m = _net().eval()
    with torch.no_grad():
        graph_opt.capture_model(m, lambda bs: torch.randn(bs, 8), sizes=[4], progress=False)
        with pytest.raises(GraphOptInputError, match="argument 'x' is on device meta"):
            m(_meta(2))  # size 2 is not captured: nothing is captured for it either
        assert graph_opt.stats(m).captured_sizes == [4]


def test_make_inputs_changing_device_between_sizes_is_named(simulated):
    m = _net().eval()
    with torch.no_grad(), pytest.raises(GraphOptInputError) as err:
        graph_opt.capture_model(m, lambda bs: torch.randn(bs, 8) if bs == 4 else _meta(bs), progress=False)
    assert "make_inputs(2): argument 'x' is on device meta" in str(err.value)
    assert graph_opt.stats(m).captured_sizes == [4]
