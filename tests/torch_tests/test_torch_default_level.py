"""At the default graph_opt_level (0, not set by the user) a forward that makes a tensor from host data
(`torch.tensor(0.0, device=h.device)`, as Hugging Face's eager attention mask does) cannot be captured
eagerly on a device: the copy from pageable memory is refused. The model is then traced at level 1,
which makes that tensor once (backends/torch/host_constants.py), with one warning; a level the user set,
0 included, is kept (graph_opt/capture/level_switch.py).

Simulated here: the forward raises the device's error while the eager forward is being captured (the
host stand-in's capture_eager), not while Dynamo traces it. tests/gpu/test_gpu_capture_errors.py has the
device's own refusal."""
import logging

import pytest
import torch

import graph_opt
from graph_opt.decorator import state_of
from graph_opt.recorders.host_graphs import HostGraphs
from source_lines import line_of
from torch_zoo.small import padded

SIZES = [2, 4]
REFUSED = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"
_capturing = {"eager": False, "traced": False}


def eager_mask(h):
    if _capturing["eager"] and not torch.compiler.is_compiling():
        raise RuntimeError(REFUSED)  # MARK refused: what a device says of the copy below, while capturing it
    return torch.where(h > 0, h, torch.tensor(0.0, device=h.device, dtype=h.dtype))


class MakesAMask(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(eager_mask(self.lin(x)))


@pytest.fixture(autouse=True)
def _device_refuses_host_copies(monkeypatch):
    """The level-0 capture (and, where a test says so, level 1's) fails as on a device."""
    capture_eager, record_outputs = HostGraphs.capture_eager, HostGraphs.record_outputs

    def eager(self, *args, **kwargs):
        _capturing["eager"] = True
        try:
            return capture_eager(self, *args, **kwargs)
        finally:
            _capturing["eager"] = False

    def traced(self, *args, **kwargs):
        if _capturing["traced"]:
            raise RuntimeError(REFUSED)
        return record_outputs(self, *args, **kwargs)

    monkeypatch.setattr(HostGraphs, "capture_eager", eager)
    monkeypatch.setattr(HostGraphs, "record_outputs", traced)
    _capturing["traced"] = False
    with graph_opt.testing.simulate_cuda_graphs():
        yield


def _models(config=None):
    torch.manual_seed(0)
    twin = MakesAMask().eval()
    cls = graph_opt.support_graph_optimization(type("Graphed", (MakesAMask,), {}))
    m = cls(graph_opt_config=config if config is not None else {"cudagraph_capture_sizes": SIZES}).eval()
    m.load_state_dict(twin.state_dict())
    return m, twin


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]


def _replays_equal_eager(m, twin, calls=(3, 4, 1, 2)):
    with torch.no_grad():
        for n in calls:
            x = torch.randn(n, 8)
            assert torch.equal(m(x), twin(padded(x, SIZES))[:n]), n


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_the_default_level_traces_at_level_1_when_the_eager_capture_fails_on_host_data(full, caplog):
    m, twin = _models({"cudagraph_capture_sizes": SIZES, "full_cuda_graph": full})
    report = graph_opt.capture_model(m, lambda n: torch.randn(n, 8), progress=False)
    assert report.failed is None and [s.size for s in report.sizes] == [4, 2], report.failed
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    where = f"{__file__}:{line_of(__file__, 'MARK refused')} in eager_mask"
    assert "traced at level 1 (graph_opt_level=1)" in warned[0] and REFUSED in warned[0] and where in warned[0]
    assert "graph_opt_level: 1" in warned[0]  # how to make it explicit
    assert "fix: a tensor made from host data" in warned[0] and "graph_opt_level>=1" not in warned[0]
    assert warned[0].endswith(report.notes[0])
    _replays_equal_eager(m, twin)
    s = graph_opt.stats(m)
    assert s.mode.startswith("static (level 1) + simulated cuda graphs") and report.mode == s.mode
    assert (s.retraced, s.replays, s.fallbacks, s.captured_sizes, s.disabled_reason) == (1, 4, 0, SIZES, None)
    assert s.retraced_reason == report.notes[0]
    assert state_of(m).config.sources["graph_opt_level"].startswith("chosen automatically")


@pytest.mark.parametrize("how", ["GraphOptConfig", "positional", "dict", "env"])
def test_a_level_0_the_user_set_is_kept(how, caplog, monkeypatch):
    if how == "env":
        monkeypatch.setenv("GRAPH_OPT_LEVEL", "0")
        config = {"cudagraph_capture_sizes": SIZES}
    elif how == "positional":
        config = graph_opt.GraphOptConfig(0, cudagraph_capture_sizes=SIZES)
    else:
        config = {"graph_opt_level": 0, "cudagraph_capture_sizes": SIZES}
        config = graph_opt.GraphOptConfig(**config) if how == "GraphOptConfig" else config
    m, twin = _models(config)
    report = graph_opt.capture_model(m, lambda n: torch.randn(n, 8), progress=False)
    assert report.failed is not None and REFUSED in report.failed
    warned = _warnings(caplog)
    assert len(warned) == 1 and "running without graphs" in warned[0] and "traced at level 1" not in warned[0]
    assert "graph_opt_level>=1" in warned[0]  # the remedy still offers tracing
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.mode.startswith("eager") and (s.retraced, s.replays, s.captured_sizes) == (0, 0, [])


def test_a_size_captured_at_a_call_switches_too_and_that_call_runs_eagerly(caplog):
    m, twin = _models()
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(m(x), twin(x))  # its capture failed: the plain forward answered
    assert len(_warnings(caplog)) == 1 and graph_opt.stats(m).retraced == 1
    _replays_equal_eager(m, twin)  # level 1 captures at these calls
    s = graph_opt.stats(m)
    assert (s.captured_sizes, s.lazy_captures, s.replays, s.disabled_reason) == (SIZES, 2, 4, None)


def test_where_level_1_fails_too_the_model_runs_without_graphs(caplog):
    _capturing["traced"] = True
    m, twin = _models()
    report = graph_opt.capture_model(m, lambda n: torch.randn(n, 8), progress=False)
    assert report.failed is not None and REFUSED in report.failed
    warned = _warnings(caplog)
    assert len(warned) == 2 and "traced at level 1" in warned[0] and "running without graphs" in warned[1], warned
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.mode.startswith("static (level 1)") and s.retraced == 1 and s.captured_sizes == []


def test_another_cause_is_not_traced(caplog, monkeypatch):
    monkeypatch.setitem(globals(), "REFUSED", "CUDA error: operation not permitted when stream is capturing")
    m, _ = _models()
    report = graph_opt.capture_model(m, lambda n: torch.randn(n, 8), progress=False)
    assert report.failed is not None and "operation not permitted" in report.failed
    assert graph_opt.stats(m).mode.startswith("eager") and graph_opt.stats(m).retraced == 0
