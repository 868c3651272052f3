"""Program passes inside the plugin: run on every static program before its first run, counted."""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from paddle_models import max_diff  # noqa: E402


@paddle.jit.marker.capture_control_flow
def decode_loop(h, steps):
    """SOT captures this loop as a pd_op.while whose body writes its state with assign(output=)."""
    i = paddle.zeros([1], dtype="int64")
    while i < steps:
        i = paddle.assign(i + 1, output=i)
        h = paddle.assign(paddle.tanh(h) * 1.5 + 0.25, output=h)
    return h


class LoopModel(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        return decode_loop(self.lin(x), paddle.full([1], 4, dtype="int64"))


GraphLoopModel = graph_opt.support_graph_optimization(type("GraphLoopModel", (LoopModel,), {}))


@pytest.mark.parametrize("use_cudagraph", [True, False])
def test_plugin_removes_loop_carried_copies_and_keeps_outputs(use_cudagraph):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = GraphLoopModel(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=1, use_cudagraph=use_cudagraph, cudagraph_capture_sizes=[2, 4]))
        reference = LoopModel()
        reference.set_state_dict(model.state_dict())
        report = graph_opt.capture_model(model, lambda bs: {"x": paddle.randn([bs, 8])}, progress=False)
        assert report.failed is None
        for bs in (1, 2, 3, 4, 6):
            x = paddle.randn([bs, 8])
            assert max_diff(model(x), reference(x)) <= 1e-6
        # Each static program holds one loop with two droppable copies (counter and state). With graphs
        # one symbolic program serves every size; the plain static path may build one per shape.
        strategy = model._graph_opt_state.runner.strategy if use_cudagraph else model._graph_opt_state.plain.strategy
        programs = len(strategy.program_ops)
        assert programs == 1 if use_cudagraph else programs >= 1
        assert graph_opt.stats(model).copies_removed == 2 * programs


def test_passes_can_be_turned_off_by_config():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model = GraphLoopModel(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=1, cudagraph_capture_sizes=[2], program_passes=[]))
        graph_opt.capture_model(model, lambda bs: {"x": paddle.randn([bs, 8])}, progress=False)
        model(paddle.randn([2, 8]))
        assert graph_opt.stats(model).copies_removed == 0


def _static_loop_program():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 16], "float32")
        i = paddle.full([1], 0, "int64")
        h = paddle.assign(x)

        def cond(i, h):
            return i < 8

        def body(i, h):
            return [paddle.assign(i + 1, output=i), paddle.assign(paddle.tanh(h) + 1.0, output=h)]

        i, h = paddle.static.nn.while_loop(cond, body, [i, h])
        out = h * 2.0
    return main, startup, x, out


def test_optimize_program_on_a_program_and_on_a_loaded_inference_model(tmp_path):
    paddle.enable_static()
    try:
        exe = paddle.static.Executor(paddle.CPUPlace())
        feed = {"x": np.random.RandomState(0).randn(4, 16).astype("float32")}
        reference, ref_startup, _, ref_out = _static_loop_program()
        exe.run(ref_startup)
        (expected,) = exe.run(reference, feed=feed, fetch_list=[ref_out])

        main, startup, x, out = _static_loop_program()
        exe.run(startup)
        prefix = str(tmp_path / "loop_model")
        paddle.static.save_inference_model(prefix, [x], [out], exe, program=main)

        assert graph_opt.optimize_program(main) == {"remove_loop_carried_copies": 2}
        assert "assign_out_" not in str(main)
        (got,) = exe.run(main, feed=feed, fetch_list=[out])
        assert np.array_equal(got, expected)

        loaded, feed_names, fetch_targets = paddle.static.load_inference_model(prefix, exe)
        assert graph_opt.optimize_program(loaded) == {"remove_loop_carried_copies": 2}
        (got,) = exe.run(loaded, feed={feed_names[0]: feed["x"]}, fetch_list=fetch_targets)
        assert np.array_equal(got, expected)

        with pytest.raises(ValueError, match="unknown pass 'nope'"):
            graph_opt.optimize_program(main, ["nope"])
    finally:
        paddle.disable_static()
