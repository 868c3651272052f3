"""cudagraph_mode full_and_piecewise on real CUDA graphs: tests/both/test_dispatch_modes.py with the torch
demo on the GPU (one pool for both kinds, checked on real pool handles). Skipped without a CUDA device."""
import contextlib
import types

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from graph_opt.benchmarks import torch_demo  # noqa: E402
from sections import shared_tests  # noqa: E402
from test_dispatch_modes import HIDDEN, LAYERS, SIZES  # noqa: E402

globals().update(shared_tests("test_dispatch_modes"))


@pytest.fixture
def D():
    yield types.SimpleNamespace(demo=torch_demo, simulated=contextlib.nullcontext)
    torch.cuda.synchronize()


@pytest.mark.parametrize("level", [1, 2])
def test_a_level_1_full_graph_replays_without_the_transformed_code(level):
    """Level >= 1 full graph on the device: the replay is the graph's replay() alone (see
    backends/torch/direct_replay.py, pure_replay_code), and it equals the eager forward on the same inputs."""
    import graph_opt
    from graph_opt.decorator import state_of

    cfg = graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=SIZES)
    model, reference = torch_demo.build(cfg, hidden=HIDDEN, layers=LAYERS)
    graph_opt.capture_model(model, lambda n: torch_demo.make_inputs(n, HIDDEN, seed=n), progress=False)
    assert state_of(model).runner.strategy.direct_replays == len(SIZES)
    with torch.no_grad():
        for bs in SIZES:
            x = torch_demo.make_inputs(bs, HIDDEN, seed=50 + bs)["x"]
            assert torch_demo.compare(model(x), reference(x))[1] <= 1e-4
    assert graph_opt.stats(model).replays == len(SIZES)
