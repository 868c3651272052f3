"""A submodule, parameter or buffer replaced after capture is counted as "replaced" (as docs/concepts.md
rule 5 and docs/fallbacks.md say) at level 0, where the decorated model's own attributes are watched, and
at level 1, where explain() says so before the call and the call agrees; outputs equal eager."""
import pytest
import torch

import graph_opt
from graph_opt.explain import REPLAY, WITHOUT
from graph_opt.watch.fallbacks import Reason


@graph_opt.support_graph_optimization
class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("b", torch.zeros(4))
        self.t = 1.0

    def forward(self, x):
        return self.lin(x) * self.w * self.t + self.b


def _replace(m, what):
    if what == "submodule":
        m.lin = torch.nn.Linear(4, 4)
    elif what == "parameter":
        m.w = torch.nn.Parameter(torch.full((4,), 2.0))
    elif what == "buffer":
        m.b = torch.ones(4)
    else:
        m.lin.weight = torch.nn.Parameter(torch.zeros(4, 4))


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("what", ["submodule", "parameter", "buffer", "submodule's parameter"])
def test_a_replacement_is_named_replaced_by_explain_and_by_the_call(simulated, level, what):
    torch.manual_seed(0)
    m = Scaled(graph_opt_config={"graph_opt_level": level, "cudagraph_capture_sizes": [1, 2, 4]}).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        graph_opt.capture_model(m, make_inputs=lambda n: torch.randn(n, 4), progress=False)
        assert graph_opt.explain(m, x).action == REPLAY
        _replace(m, what)
        said = graph_opt.explain(m, x)
        y = m(x)
        want = Scaled.forward(m, x)
    assert said.action == WITHOUT and said.reason is Reason.REPLACED, str(said)
    assert "replaced by a new object" in said.why
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"replaced": 1} and s.replays == 0, s.fallback_reasons
    torch.testing.assert_close(y, want)


def test_a_plain_value_read_by_the_forward_is_still_named_attribute(simulated):
    m = Scaled(graph_opt_config={"cudagraph_capture_sizes": [1, 2, 4]}).eval()
    with torch.no_grad():
        graph_opt.capture_model(m, make_inputs=lambda n: torch.randn(n, 4), progress=False)
        m.lin = m.lin  # the same submodule assigned again: nothing changed
        m(torch.randn(3, 4))
        assert graph_opt.stats(m).replays == 1
        m.t = 2.0
        said = graph_opt.explain(m, torch.randn(3, 4))
    assert said.reason is Reason.ATTRIBUTE, str(said)
