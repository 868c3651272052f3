"""The per-size runtime on Paddle: random sizes, fallbacks, failures, clear and recapture, lazy capture."""
import gc
import logging
import random
import weakref

import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt import guards  # noqa: E402
from graph_opt.capture import split  # noqa: E402
from graph_opt.backends.paddle.sot import translate_count  # noqa: E402
from paddle_zoo.small import SIZES, capture, config, decoder, inputs, max_diff, same  # noqa: E402

ROW_TOLERANCE = 1e-5


@pytest.mark.parametrize("level", [0, 1])
def test_thousand_random_sizes_zero_mismatches_and_fallbacks_count_calls_above_max(level):
    rng = random.Random(1234)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=level))
        capture(model)
        before = translate_count()
        above_max, mismatches = 0, 0
        for i in range(1000):
            bs = rng.randint(1, 2 * max(SIZES))
            above_max += bs > max(SIZES)
            x = inputs(bs, seed=i)
            out = model(x)
            if out.shape != [bs, 16] or max_diff(out, reference(x)) > ROW_TOLERANCE:
                mismatches += 1
        st = graph_opt.stats(model)
        assert mismatches == 0
        assert st.fallbacks == above_max and above_max > 0
        assert st.replays == 1000 - above_max
        if level == 1:
            # sizes above the max run the ordinary SOT path: it may translate once for them, never more
            assert translate_count() - before <= 1


def _leftover_capture_state():
    from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

    return {
        "is_capturing": graph_opt.is_capturing(),
        "sot_warmup": graph_opt.in_sot_warmup_mode(),
        "split_hook": split._split_hook is not None,
        "run_impl_hook": PartialProgramLayer.HOOKED_RUN_IMPL is not None,
        "eval_frame": paddle.framework.core.set_eval_frame(None) is not None,
    }


@pytest.mark.parametrize("level", [0, 1])
def test_exception_during_capture_leaves_a_working_model_and_one_warning(level, graph_opt_warnings):
    armed = {"on": False}

    @graph_opt.splitting_op(name=f"exploding_{level}")
    def explode(x):
        if armed["on"] and graph_opt.is_capturing():
            raise RuntimeError("injected failure")
        return x

    class Boom(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(16, 16)

        def forward(self, x):
            return explode(self.lin(x)) * 2.0

    Model = graph_opt.support_graph_optimization(type("BoomModel", (Boom,), {}))
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = Model(graph_opt_config=config(graph_opt_level=level, cudagraph_splitting_ops=["none"]))
        reference = Boom()
        reference.set_state_dict(model.state_dict())
        armed["on"] = True
        report = capture(model)
        armed["on"] = False
        assert report.failed and "injected failure" in report.failed
        assert _leftover_capture_state() == {k: False for k in _leftover_capture_state()}
        warnings = [w for w in graph_opt_warnings() if "injected failure" in w]
        assert len(warnings) == 1
        for bs in (1, 3, 8, 20):
            x = inputs(bs, seed=bs)
            assert max_diff(model(x), reference(x)) <= ROW_TOLERANCE
        st = graph_opt.stats(model)
        assert st.capture_failures == 1 and st.captured_sizes == [] and st.fallbacks == 4
        assert "injected failure" in st.disabled_reason
        assert len([w for w in graph_opt_warnings() if "injected failure" in w]) == 1


def test_ten_clear_and_recapture_cycles_hold_no_more_buffers():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=0))
        x = inputs(3, seed=5)
        expected = reference(x)
        held = []
        dead_buffers = []
        for cycle in range(10):
            capture(model)
            sig = next(iter(model._graph_opt_state.runner.signatures.values()))
            dead_buffers.append(weakref.ref(sig.buffers[0]))
            assert max_diff(model(x), expected) <= ROW_TOLERANCE
            held.append(graph_opt.stats(model).static_buffer_bytes)
            graph_opt.clear_graphs(model)
            assert graph_opt.stats(model).captured_sizes == []
            assert graph_opt.stats(model).static_buffer_bytes == 0
        del sig
        gc.collect()
        assert len(set(held)) == 1
        assert all(ref() is None for ref in dead_buffers), "buffers of cleared captures must be freed"
        assert graph_opt.stats(model).captures == 10 * len(SIZES)


def test_clear_graphs_recaptures_new_weights():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=1))
        capture(model)
        x = inputs(4, seed=9)
        before = model(x).clone()
        for p_model, p_ref in zip(model.parameters(), reference.parameters()):
            p_model.set_value(p_model * 0.5)
            p_ref.set_value(p_ref * 0.5)
        graph_opt.clear_graphs(model)
        capture(model)
        after = model(x)
        assert not same(after, before)
        assert same(after, reference(x))


def test_size_first_seen_after_capture_is_captured_lazily_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="graph_opt")
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=0))
        capture(model, sizes=[8, 2])
        for _ in range(3):
            x = inputs(3, seed=1)
            assert max_diff(model(x), reference(x)) <= ROW_TOLERANCE
        lines = [r.getMessage() for r in caplog.records if "lazily" in r.getMessage()]
        assert lines == ["GraphDecoder: capturing padded size 4 lazily (first seen at call time)"]
        st = graph_opt.stats(model)
        assert st.lazy_captures == 1 and st.captured_sizes == [2, 4, 8] and st.replays == 3


def test_capture_model_rejects_sizes_that_are_not_capture_sizes():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, _ = decoder(config(graph_opt_level=0))
        with pytest.raises(graph_opt.GraphOptConfigError, match=r"3 is not a capture size; capture sizes are \[1, 2, 4, 8\]"):
            capture(model, sizes=[3])


def test_make_inputs_with_wrong_batch_is_a_clear_error_and_captures_nothing():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=0))
        with pytest.raises(graph_opt.GraphOptInputError,
                           match=r"make_inputs\(8\): argument 'x' has 9 rows .*; expected 8, the size being captured"):
            graph_opt.capture_model(model, lambda bs: {"x": inputs(bs + 1)}, progress=False)
        assert graph_opt.stats(model).captured_sizes == [] and graph_opt.stats(model).disabled_reason is None
        x = inputs(2, seed=1)
        assert max_diff(model(x), reference(x)) <= ROW_TOLERANCE


def test_graph_opt_disable_makes_the_plugin_transparent(monkeypatch):
    monkeypatch.setenv("GRAPH_OPT_DISABLE", "1")
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=1))
        report = capture(model)
        assert report.sizes == [] and "disabled" in report.mode
        x = inputs(3, seed=2)
        assert same(model(x), reference(x))
        st = graph_opt.stats(model)
        assert st.captures == 0 and st.replays == 0 and st.translations == 0


def test_without_simulation_on_cpu_it_warns_once_and_runs(graph_opt_warnings):
    with paddle.no_grad():
        for level in (0, 1):
            model, reference = decoder(config(graph_opt_level=level))
            report = capture(model)
            assert report.sizes == []
            for bs in (2, 5):
                x = inputs(bs, seed=bs)
                assert max_diff(model(x), reference(x)) <= ROW_TOLERANCE
        unavailable = [w for w in graph_opt_warnings() if "CUDA graphs are unavailable" in w]
        assert len(unavailable) == 2  # once per model


def test_grad_enabled_calls_run_without_graphs(graph_opt_warnings):
    with graph_opt.testing.simulate_cuda_graphs():
        with paddle.no_grad():
            model, reference = decoder(config(graph_opt_level=0))
            capture(model)
        x = inputs(4, seed=1)
        out = model(x)
        assert not out.stop_gradient or any(not p.stop_gradient for p in model.parameters())
        assert graph_opt.stats(model).fallbacks == 1
        assert len([w for w in graph_opt_warnings() if "autograd is enabled" in w]) == 1


def test_simulate_environment_variable_captures_without_the_context_manager(monkeypatch):
    monkeypatch.setenv("GRAPH_OPT_SIMULATE_CUDAGRAPH", "1")
    with paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=1))
        assert capture(model).captured_sizes == SIZES
        x = inputs(5, seed=3)
        assert max_diff(model(x), reference(x)) <= ROW_TOLERANCE
        assert graph_opt.stats(model).replays == 1
