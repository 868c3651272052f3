"""Capture failures on a device name the model line that issued the refused operation and say what to
do: a device tensor made from a Python number (a pageable host-to-device copy, the line in Hugging
Face's masking code), a host sync (.item()), and a data-dependent shape (nonzero). Inference at level
0 set by the user and training graphs; each then runs eagerly and equals eager. At the default level the
first is traced at level 1 instead. Skipped without a CUDA device."""
import logging

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import graph_opt  # noqa: E402
from source_lines import line_of  # noqa: E402


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def host_number(x):
    return torch.where(x > 0, torch.tensor(0.0, device=x.device), x)  # MARK host_number


def host_sync(x):
    return x * 2 if x.sum().item() > 0 else x  # MARK host_sync


def data_shape(x):
    return x + torch.nonzero(x > 0).shape[0]  # MARK data_shape


FAILURES = [  # (model function, what the remedy says)
    pytest.param(host_number, "make it once outside the forward", id="host-number"),
    pytest.param(host_sync, ".item()", id="host-sync"),
    pytest.param(data_shape, ".item()", id="data-dependent-shape"),
]


class Model(torch.nn.Module):
    def __init__(self, fn, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


def _where(fn):
    return f"{__file__}:{_line_of('MARK ' + fn.__name__)} in {fn.__name__}"


@pytest.mark.parametrize("fn,advice", FAILURES)
def test_an_inference_capture_failure_names_the_line_and_the_fix(fn, advice):
    cls = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))
    m = cls(fn, graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=[4])).cuda()
    graph_opt.capture_model(m, lambda n: (torch.randn(n, 16, device="cuda"),), progress=False)
    reason = graph_opt.stats(m).disabled_reason
    assert reason is not None and _where(fn) in reason and "fix:" in reason and advice in reason, reason
    x = torch.randn(3, 16, device="cuda")
    assert torch.equal(m(x), Model.forward(m, x))


def host_number_written(x):
    zero = torch.tensor(0.0, device=x.device)
    zero += x.mean()  # written in place: every call starts from 0.0 again
    return torch.where(x > 0, zero, x) + torch.as_tensor([0.5] * 16, device=x.device)


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("fn", [host_number, host_number_written])
def test_level_1_makes_a_device_tensor_from_a_python_number_once_and_captures(fn, full):
    """What level 0 refuses above, level 1 captures: the tensor is made once when Dynamo traces and
    copied on the device at each call (backends/torch/host_constants.py). Replays equal eager bitwise."""
    cls = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))
    config = graph_opt.GraphOptConfig(graph_opt_level=1, full_cuda_graph=full, cudagraph_capture_sizes=[2, 4])
    m = cls(fn, graph_opt_config=config).cuda()
    report = graph_opt.capture_model(m, lambda n: (torch.randn(n, 16, device="cuda"),), progress=False)
    assert report.failed is None and graph_opt.stats(m).disabled_reason is None, report.failed
    with torch.no_grad():
        for n in (4, 2, 4):
            x = torch.randn(n, 16, device="cuda")
            assert torch.equal(m(x), Model.forward(m, x)), n
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallbacks == 0, s.fallback_reasons


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("fn", [host_number, host_number_written])
def test_the_default_level_traces_what_level_0_cannot_capture(fn, full, caplog):
    """graph_opt_level left at its default: the eager capture fails on the host copy, and the model is
    traced at level 1 instead, with one warning (graph_opt/capture/level_switch.py). Replays equal eager
    bitwise."""
    cls = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))
    m = cls(fn, graph_opt_config={"cudagraph_capture_sizes": [2, 4], "full_cuda_graph": full}).cuda()
    report = graph_opt.capture_model(m, lambda n: (torch.randn(n, 16, device="cuda"),), progress=False)
    assert report.failed is None, report.failed
    # (host_number_written reads every row: the check of a padded replay warns too, as at level 1 itself)
    warned = [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING
              and "size 4 failed" in r.getMessage()]
    assert len(warned) == 1 and "traced at level 1 (graph_opt_level=1)" in warned[0], warned
    assert "unless the CPU tensor is pinned" in warned[0] and (fn is not host_number or _where(fn) in warned[0])
    with torch.no_grad():
        for n in (4, 2, 4):
            x = torch.randn(n, 16, device="cuda")
            assert torch.equal(m(x), Model.forward(m, x)), n
    s = graph_opt.stats(m)
    assert s.mode.startswith("static (level 1) + cuda graphs") and s.retraced == 1, s.mode
    assert s.replays == 3 and s.fallbacks == 0 and s.disabled_reason is None, s.fallback_reasons


@pytest.mark.parametrize("fn,advice", FAILURES)
def test_a_training_capture_failure_names_the_line_and_the_fix(fn, advice):
    # level=0 given: the default would trace the host-number case at level 1 (test_gpu_training.py)
    m = graph_opt.autocudagraph(Model(fn).cuda(), warmup_steps=1, level=0)
    for _ in range(3):
        x = torch.randn(4, 16, device="cuda", requires_grad=True)
        y = m(x)
        y.sum().backward()
        assert torch.equal(y, Model.forward(m, x))
    reason = graph_opt.stats(m).disabled_reason
    assert reason is not None and _where(fn) in reason and "fix:" in reason and advice in reason, reason
