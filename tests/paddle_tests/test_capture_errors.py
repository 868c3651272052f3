"""A capture failure names the line of model code that issued the failing operation: at level 0, at
level 1 (SOT reports the model's stack as text) and for training graphs; simulated graphs."""
import logging

import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from source_lines import line_of  # noqa: E402


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def scale_for(x):
    if graph_opt.is_capturing():
        return paddle.matmul(x, paddle.ones([3, 3]))  # MARK: the failing model line
    return x


class Model(paddle.nn.Layer):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        return scale_for(self.lin(x))


WHERE = f"{__file__}:{_line_of('MARK: the failing model line')} in scale_for: " \
        "return paddle.matmul(x, paddle.ones([3, 3]))  # MARK: the failing model line"


@pytest.fixture(autouse=True)
def _simulated():
    with graph_opt.testing.simulate_cuda_graphs():
        yield


@pytest.mark.parametrize("level", [0, 1])
def test_an_inference_capture_failure_names_the_model_line(level, caplog):
    cls = graph_opt.support_graph_optimization(type("Graphed", (Model,), {}))
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=[4]))
    graph_opt.capture_model(m, lambda n: (paddle.randn([n, 8]),), progress=False)
    reason = graph_opt.stats(m).disabled_reason
    assert reason.endswith(WHERE) and "InvalidArgument" in reason, reason
    warned = [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]
    assert sum(WHERE in w for w in warned) == 1
    x = paddle.randn([3, 8])
    assert bool((m(x) == Model.forward(m, x)).all())  # and the model still works, without graphs


def test_a_training_capture_failure_names_the_model_line():
    lin = paddle.nn.Linear(8, 8)
    f = graph_opt.autocudagraph(lambda x: scale_for(lin(x)), warmup_steps=0)
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    assert bool((f(x) == lin(x)).all())
    assert graph_opt.stats(f).disabled_reason.endswith(WHERE)


class WritesAViewedBuffer(paddle.nn.Layer):
    """paddle.assign into a buffer from slices of itself: SOT refuses it with a message of nested headers."""

    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)
        self.register_buffer("cache", paddle.zeros([4, 8]))

    def forward(self, x):
        b = x.shape[0]
        rows = self.cache[:b] + self.lin(x)
        paddle.assign(paddle.concat([rows, self.cache[b:]]) if b < 4 else rows, self.cache)
        return self.cache[:b] * 2


def test_a_sot_refusal_under_nested_headers_keeps_paddle_s_sentence():
    # SOT's message is "In simulate execution:", then "ValueError: In transformed code:", then a traceback,
    # then Paddle's reason: the reason must reach the warning, not the two headers alone.
    cls = graph_opt.support_graph_optimization(type("Graphed", (WritesAViewedBuffer,), {}))
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=[2, 4]))
    graph_opt.capture_model(m, lambda n: (paddle.randn([n, 8]),), progress=False)
    reason = graph_opt.stats(m).disabled_reason
    assert reason is not None and "assign_out_" in reason and "Sorry" not in reason, reason
    twin = WritesAViewedBuffer()
    twin.set_state_dict(m.state_dict())
    x = paddle.randn([3, 8])
    with paddle.no_grad():
        assert bool((m(x) == twin(x)).all()) and bool((m.cache == twin.cache).all())  # eager, right


class MakesAMask(paddle.nn.Layer):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        if graph_opt.is_capturing():  # what a device says of a copy from pageable memory while capturing
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                               "tensor is pinned")
        return self.lin(x)


def test_the_default_level_stays_at_level_0_on_paddle(caplog):
    """torch's default level traces such a model at level 1 instead (graph_opt/capture/level_switch.py);
    Paddle's tracer does not make host tensors once, so its failure stays the usual one."""
    cls = graph_opt.support_graph_optimization(type("Graphed", (MakesAMask,), {}))
    m = cls(graph_opt_config={"cudagraph_capture_sizes": [4]})
    report = graph_opt.capture_model(m, lambda n: (paddle.randn([n, 8]),), progress=False)
    assert report.failed is not None and "pinned" in report.failed
    s = graph_opt.stats(m)
    assert s.mode.startswith("eager") and s.retraced == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "running without graphs" in warned[0], warned
