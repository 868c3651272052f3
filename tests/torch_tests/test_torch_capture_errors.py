"""A capture failure names the line of model code that issued the failing operation, and a remedy
where the cause is a known one: at levels 0 and 1 and for training graphs. The failures here are real
framework errors raised only while capturing (simulated graphs); tests/gpu/test_gpu_capture_errors.py
has the device's own (a pageable host copy, a host sync, a data-dependent shape)."""
import logging

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from source_lines import line_of  # noqa: E402
from graph_opt.capture.failures import describe, remedy_for  # noqa: E402


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def scale_for(x):
    if graph_opt.is_capturing():
        return x @ torch.ones(3, 3)  # MARK: the failing model line
    return x


class Model(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return scale_for(self.lin(x))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def _simulated():
    with graph_opt.testing.simulate_cuda_graphs():
        yield


@pytest.mark.parametrize("level", [0, 1])
def test_an_inference_capture_failure_names_the_model_line(level, caplog):
    cls = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=[4]))
    graph_opt.capture_model(m, lambda n: (torch.randn(n, 8),), progress=False)
    where = f"{__file__}:{_line_of('MARK: the failing model line')} in scale_for: return x @ torch.ones(3, 3)"
    reason = graph_opt.stats(m).disabled_reason
    assert where in reason, reason
    warned = [w for w in _warnings(caplog) if "capture of size 4 failed" in w]
    assert len(warned) == 1 and where in warned[0]
    x = torch.randn(3, 8)
    assert torch.equal(m(x), Model.forward(m, x))  # and the model still works, without graphs


def test_a_training_capture_failure_names_the_model_line(caplog):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    f = graph_opt.autocudagraph(lambda x: scale_for(lin(x)), warmup_steps=0)
    x = torch.randn(4, 8, requires_grad=True)
    y = f(x)
    assert torch.equal(y, lin(x))
    where = f"{__file__}:{_line_of('MARK: the failing model line')} in scale_for"
    assert where in graph_opt.stats(f).disabled_reason
    assert any(where in w for w in _warnings(caplog))


def test_the_line_is_the_innermost_model_frame_not_the_caller_s():
    """The lambda calling scale_for, and the test calling graph_opt, are model code too; the deepest
    frame is the one named."""
    f = graph_opt.autocudagraph(lambda x: scale_for(x), warmup_steps=0)  # the caller's line
    f(torch.randn(4, 8, requires_grad=True))
    assert graph_opt.stats(f).disabled_reason.endswith(
        f"raised at {__file__}:{_line_of('MARK: the failing model line')} in scale_for: "
        "return x @ torch.ones(3, 3)  # MARK: the failing model line")


# The device's messages (torch 2.11, CUDA 13) and what the warning tells the user to do
@pytest.mark.parametrize("message,advice", [
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned",
     "make it once outside the forward"),
    ("CUDA error: operation not permitted when stream is capturing", ".item()"),
    ("CUDA error: operation failed due to a previous error during capture", None),
    ("mat1 and mat2 shapes cannot be multiplied (4x8 and 3x3)", None),
])
def test_known_causes_come_with_a_remedy(message, advice):
    remedy = remedy_for(message)
    assert (remedy is None) if advice is None else (advice in remedy)
