"""graph_opt.explain and graph_opt.config_of on a Paddle model (level 0 and SOT's level 1), and an argument on
another place than its static buffer, named before anything is written."""
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt import GraphOptInputError  # noqa: E402
from graph_opt.explain import CAPTURE, RAISE, REPLAY, WITHOUT  # noqa: E402
from graph_opt.watch.fallbacks import Reason  # noqa: E402
from paddle_zoo.small import capture, config, decoder, inputs, max_diff  # noqa: E402

_CI_SECONDS = 6


@pytest.mark.parametrize("level", [0, 1])
def test_explain_says_what_the_call_then_does(level):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        m, eager = decoder(config(graph_opt_level=level))
        m.eval()
        first = graph_opt.explain(m, inputs(3))
        assert (first.action, first.padded_size) == (CAPTURE, 4)
        assert graph_opt.stats(m).captures == 0
        capture(m)
        before = graph_opt.stats(m)
        said = graph_opt.explain(m, inputs(3))
        assert (said.action, said.padded_size, said.rows) == (REPLAY, 4, 3)
        above = graph_opt.explain(m, inputs(9))
        assert (above.action, above.reason) == (WITHOUT, Reason.ABOVE_MAX)
        assert graph_opt.stats(m) == before  # explain moved nothing
        x = inputs(3, seed=1)
        assert max_diff(m(x), eager(x)) < 1e-5
        assert graph_opt.stats(m).replays == before.replays + 1
    assert graph_opt.config_of(m).graph_opt_level == level
    assert graph_opt.config_of(m).sources["graph_opt_level"] == "GraphOptConfig()"


def test_an_argument_on_another_place_is_named_before_anything_is_written(monkeypatch):
    from graph_opt.backends.paddle.adapter import PaddleAdapter

    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        m, eager = decoder(config())
        m.eval()
        capture(m)
        x = inputs(3, seed=2)
        elsewhere = inputs(3)
        real = PaddleAdapter.device
        # This CPU build has one place: one argument is reported on another, as a GPU tensor would be
        monkeypatch.setattr(PaddleAdapter, "device", lambda self, t: "Place(gpu:1)" if t is elsewhere else real(self, t))
        said = graph_opt.explain(m, elsewhere)
        assert said.action == RAISE and "is on device Place(gpu:1)" in said.why
        before = graph_opt.stats(m)
        with pytest.raises(GraphOptInputError, match=r"argument 'x' is on device Place\(gpu:1\); \w+ takes it on "
                                                     r"device Place\(cpu\)"):
            m(elsewhere)
        assert graph_opt.stats(m).replays == before.replays
        assert max_diff(m(x), eager(x)) < 1e-5


def test_capturing_with_dropout_in_training_mode_warns_and_names_it_in_the_check(caplog):
    @graph_opt.support_graph_optimization
    class Dropped(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(8, 8)
            self.drop = paddle.nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.lin(x))

    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        m = Dropped(graph_opt_config=config(cudagraph_capture_sizes=[2, 4]))
        graph_opt.capture_model(m, lambda bs: paddle.randn([bs, 8]), progress=False)
    said = [r.getMessage() for r in caplog.records if r.name == "graph_opt"]
    assert any("Dropped is in training mode, and drop (Dropout)" in w and "model.eval()" in w for w in said), said
    assert any("gave other values than eager" in w and "drop (Dropout) in training mode" in w for w in said), said
