"""Inference replays never silently wrong, on real CUDA graphs: the cases both frameworks share
(tests/both/test_replay_*.py) and torch's own (tests/torch_tests/test_torch_replay_*.py) with the torch shim
on the GPU. Skipped without a CUDA device."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_tests"))

import torch_zoo  # noqa: E402
from sections import shared_tests  # noqa: E402

globals().update(shared_tests(
    "test_replay_module_changes", "test_replay_arguments_and_outputs", "test_replay_input_writes",
    "test_replay_forward_state", "test_replay_padding_rows", "test_replay_marked_arguments",
    "test_torch_replay_ambient_modes", "test_torch_replay_module_changes", "test_torch_replay_arguments",
    "test_torch_replay_writes_and_state"))
FRAMEWORKS = ("torch",)  # tests/conftest.py: each test at every level of torch's


@pytest.fixture
def fw(request):
    return torch_zoo


@pytest.fixture
def F(fw):
    yield fw.replay_shim("cuda")
    torch.cuda.synchronize()


@pytest.fixture
def M(F):
    return F.models()


@pytest.fixture(params=[True, False], ids=["graphs", "no-graphs"])
def graphs(request):
    return request.param


# -- what only a device shows ------------------------------------------------------------------------------
class _SyncsOnTheHost(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if bool((y > 100).any()):  # a host sync: a capture fails on it
            y = y * 0
        return y


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_capture_that_fails_on_a_host_sync_leaves_random_ops_working(level):
    import graph_opt

    cls = graph_opt.support_graph_optimization(type("Syncs", (_SyncsOnTheHost,), {}))
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=[2, 4])).cuda()
    report = graph_opt.capture_model(m, lambda n: torch.randn(n, 16, device="cuda"), progress=False)
    assert report.failed is not None
    torch.randn(4, device="cuda")  # raised "Offset increment outside graph capture" before
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)
    x = torch.randn(3, 16, device="cuda")
    with torch.no_grad():
        assert torch.equal(m(x), type(m).forward(m, x))


class _DividesByHostTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, t):
        return self.lin(x) / t  # t: a 0-dim CPU tensor, a temperature; its kernel takes the value at launch


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_host_tensor_argument_with_another_value_is_never_replayed_with_the_captured_one(level):
    import graph_opt

    cls = graph_opt.support_graph_optimization(type("Divides", (_DividesByHostTensor,), {}))
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=[2, 4])).cuda()
    report = graph_opt.capture_model(m, lambda n: (torch.randn(n, 16, device="cuda"), torch.tensor(1.0)),
                                     progress=False)
    assert report.failed is None
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        for t in (4.0, 1.0, 0.5):
            assert torch.equal(m(x, torch.tensor(t)), type(m).forward(m, x, torch.tensor(t))), f"t={t}"
    s = graph_opt.stats(m)
    if level == 0:  # the graph holds t=1.0: only that call replays
        assert s.replays == 1 and s.fallback_reasons == {"host_argument": 2}
    else:  # Dynamo's graph takes t as an input, and host operations run outside the graphs
        assert s.replays == 3
