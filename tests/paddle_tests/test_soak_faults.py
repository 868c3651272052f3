"""Soak and faults, Paddle's own cases (the shared suite is tests/both/test_soak_and_faults.py)."""
import threading

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
import soak_support  # noqa: E402
from graph_opt import testing  # noqa: E402
from paddle_zoo.soak import KIT, build, capture, make_inputs  # noqa: E402
from soak_support import FAULT, HIDDEN, ROW_TOLERANCE, SIZES, WARNINGS  # noqa: E402


def test_a_replay_failing_on_the_callers_inputs_raises_their_error_and_keeps_the_graphs(graph_opt_warnings):
    """A splitting op runs eagerly at every piecewise replay: an error it raises for these inputs is
    the caller's (the plain forward raises it too), so it propagates and the graphs stay."""
    calls = {"n": 0}

    @graph_opt.splitting_op(name="soak_paddle_picky")
    def picky(h):
        if not graph_opt.is_capturing() and float(h.abs().max()) > 1e3:
            raise ValueError("picky: values above 1e3")
        calls["n"] += 1
        return h * 2.0

    class Picky(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return picky(self.lin(x)) + 1.0

    Model = graph_opt.support_graph_optimization(type("PickyModel", (Picky,), {}))
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model = Model(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=0, full_cuda_graph=False, cudagraph_capture_sizes=SIZES))
        graph_opt.capture_model(model, lambda bs: paddle.randn([bs, HIDDEN]), progress=False)
        with pytest.raises(ValueError, match="picky: values above 1e3") as err:
            model(paddle.full([2, HIDDEN], 1e6))
        assert err.value.__suppress_context__
        x = paddle.randn([3, HIDDEN])
        assert np.allclose(model(x).numpy(), (Picky.forward(model, x)).numpy(), atol=ROW_TOLERANCE)
        st = graph_opt.stats(model)
        assert st.disabled_reason is None and st.replay_failures == 0 and st.replays == 1
        assert graph_opt_warnings(WARNINGS) == []


def test_eager_code_in_another_thread_during_a_replay_leaves_no_flag_set():
    """The capture flags and the split hook are process-wide. A level-0 replay (simulated: the eager
    forward again, with is_capturing() true in its pieces) is held inside a piece while another thread
    runs an eager model that calls the same splitting op, and leaves after the replay. That thread must
    not go through the replay's split hook: it would save is_capturing() true on entry and restore it
    after the replay ended, leaving it true for good (every later capture and call then takes the
    capture branch)."""
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model, twin = build(graph_opt_level=0, full_cuda_graph=False)
        in_piece, release_replay = threading.Event(), threading.Event()
        held = {"on": False}

        def hold_in_piece(layer, inputs):
            if held["on"] and graph_opt.is_capturing():
                held["on"] = False
                in_piece.set()
                assert release_replay.wait(30)

        # Registered before the capture: a hook added after it stops the replays (replay_guards).
        handle = model.gate.register_forward_pre_hook(hold_in_piece)
        capture(model)
        x, g = make_inputs(4)
        result = {}

        def replay():
            with paddle.no_grad():
                result["out"] = model(x, g).numpy()

        entered, release_eager = threading.Event(), threading.Event()

        def eager():
            FAULT["hold"] = (threading.get_ident(), entered, release_eager)  # blocks this thread in soak_gate
            with paddle.no_grad():
                result["eager"] = twin(x, g).numpy()

        try:
            held["on"] = True
            a = threading.Thread(target=replay)
            a.start()
            assert in_piece.wait(30)
            b = threading.Thread(target=eager)
            b.start()
            assert entered.wait(30)  # the eager thread is inside the splitting op
            release_replay.set()
            a.join(30)  # the replay has ended
            release_eager.set()
            b.join(30)
        finally:
            FAULT["hold"] = None
            release_replay.set()
            release_eager.set()
            handle.remove()
        assert soak_support.leftover_capture_state(KIT) == {k: False for k in soak_support.leftover_capture_state(KIT)}
        assert np.array_equal(result["out"], result["eager"])
        assert graph_opt.stats(model).replays == 1
