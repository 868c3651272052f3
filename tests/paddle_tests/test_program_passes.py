"""Program passes inside the plugin: run on every static program before its first run, counted."""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from paddle_zoo.small import max_diff  # noqa: E402


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

        done = {"copies_inserted": 0, "reads_rewired": 0, "copies_removed": 2}
        assert graph_opt.optimize_program(main) == done
        assert "assign_out_" not in str(main)
        (got,) = exe.run(main, feed=feed, fetch_list=[out])
        assert np.array_equal(got, expected)

        loaded, feed_names, fetch_targets = paddle.static.load_inference_model(prefix, exe)
        assert graph_opt.optimize_program(loaded) == done
        (got,) = exe.run(loaded, feed={feed_names[0]: feed["x"]}, fetch_list=fetch_targets)
        assert np.array_equal(got, expected)

        with pytest.raises(ValueError, match="unknown pass 'nope'"):
            graph_opt.optimize_program(main, ["nope"])
    finally:
        paddle.disable_static()


@paddle.jit.marker.capture_control_flow
def decode_with_carry(h, c, steps):
    """A loop that writes its state in place, as decoding loops do: h and c are updated with
    assign(output=), and i counts."""
    i = paddle.zeros([1], dtype="int64")
    while i < steps:
        i = paddle.assign(i + 1, output=i)
        h = paddle.assign(paddle.tanh(h) * 1.25 + c * 0.5, output=h)
        c = paddle.assign(c * 0.5 + 0.125, output=c)
    return h, c


class CarryModel(paddle.nn.Layer):
    """The loop's operands are read after it: in dygraph, h and c are then the loop's final state
    (the loop wrote them in place). A static program must give the same, in every run."""

    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        c = x * 0.25
        out, _ = decode_with_carry(h, c, paddle.full([1], 3, dtype="int64"))
        return out + h * 0.5, c * 2.0  # h and c as the loop left them


GraphCarryModel = graph_opt.support_graph_optimization(type("GraphCarryModel", (CarryModel,), {}))


@pytest.mark.parametrize("use_cudagraph", [True, False])
def test_plugin_stress_loop_state_read_after_the_loop_equals_eager(use_cudagraph):
    rng = np.random.default_rng(0)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = GraphCarryModel(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=1, use_cudagraph=use_cudagraph, cudagraph_capture_sizes=[2, 4, 8]))
        twin = CarryModel()
        twin.set_state_dict(model.state_dict())
        report = graph_opt.capture_model(model, lambda bs: {"x": paddle.randn([bs, 8])}, progress=False)
        assert report.failed is None
        worst = 0.0
        for _ in range(150):
            bs = int(rng.integers(1, 12))  # captured, padded and beyond the largest size
            x = paddle.to_tensor(rng.standard_normal((bs, 8)).astype("float32"))
            got, want = model(x), twin(x)
            worst = max(worst, max_diff(got[0], want[0]), max_diff(got[1], want[1]))
        assert worst <= 1e-5
        s = graph_opt.stats(model)
        # Both reads after the loop (h, c) move to the loop's results; then every copy can go.
        programs = s.reads_rewired // 2
        assert programs >= 1 and s.reads_rewired == 2 * programs
        assert (s.copies_inserted, s.copies_removed) == (0, 3 * programs)


@paddle.jit.marker.capture_control_flow
def decode_fresh(h, steps):
    """A loop that computes new state instead of writing it: h itself never changes."""
    i = paddle.zeros([1], dtype="int64")
    while i < steps:
        i = i + 1
        h = paddle.tanh(h) * 1.25
    return h


class FreshLoopModel(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return decode_fresh(h, paddle.full([1], 3, dtype="int64")) + h  # h read after the loop


GraphFreshLoopModel = graph_opt.support_graph_optimization(type("GraphFreshLoopModel", (FreshLoopModel,), {}))


def test_plugin_operand_read_after_a_loop_that_does_not_write_it():
    # Paddle releases a loop's operands when the loop starts, so `+ h` after it would find no
    # memory (capture fails without the passes); the safety pass gives the loop its own copy.
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = GraphFreshLoopModel(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=1, cudagraph_capture_sizes=[2, 4]))
        twin = FreshLoopModel()
        twin.set_state_dict(model.state_dict())
        assert graph_opt.capture_model(model, lambda bs: {"x": paddle.randn([bs, 8])}, progress=False).failed is None
        for bs in (1, 2, 3, 4):
            x = paddle.randn([bs, 8])
            assert max_diff(model(x), twin(x)) <= 1e-6
        s = graph_opt.stats(model)
        assert (s.copies_inserted, s.reads_rewired, s.copies_removed, s.replays) == (1, 0, 0, 4)
