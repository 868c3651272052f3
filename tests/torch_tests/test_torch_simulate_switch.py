"""graph_opt.testing.simulate_cuda_graphs() called alone, as the note of a machine without CUDA graphs
tells a user to, turns the host stand-in on from then on; as a `with` block, for the block only."""
import pytest
import torch

import graph_opt
from graph_opt.recorders import host_graphs


@graph_opt.support_graph_optimization
class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 2


@pytest.fixture
def stand_in_off(monkeypatch):
    """The stand-in off before the test, and put back as it was after, whatever the test turned on."""
    monkeypatch.delenv("GRAPH_OPT_SIMULATE_CUDAGRAPH", raising=False)
    monkeypatch.setattr(host_graphs, "_simulating", False)
    if host_graphs.simulation_enabled():
        pytest.skip("CUDA graphs or the stand-in are on here already")


def test_a_bare_call_turns_the_stand_in_on_and_the_model_replays(stand_in_off):
    graph_opt.testing.simulate_cuda_graphs()  # no `with`
    assert graph_opt.testing.simulation_enabled()
    m = Twice(graph_opt_config={"cudagraph_capture_sizes": [1, 2, 4]}).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        graph_opt.capture_model(m, make_inputs=lambda n: torch.randn(n, 4), progress=False)
        y = m(x)
        want = Twice.forward(m, x)
    st = graph_opt.stats(m)
    assert st.captures == 3 and st.replays == 1 and st.fallbacks == 0
    assert torch.equal(y, want)


def test_a_with_block_turns_it_off_again_nested_or_not(stand_in_off):
    with graph_opt.testing.simulate_cuda_graphs():
        assert graph_opt.testing.simulation_enabled()
        with graph_opt.testing.simulate_cuda_graphs():
            assert graph_opt.testing.simulation_enabled()
        assert graph_opt.testing.simulation_enabled()
    assert not graph_opt.testing.simulation_enabled()
