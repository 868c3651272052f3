"""cudagraph_mode "full_and_piecewise" (graph_opt.replay.dispatch), run on each framework through the fixture `D`
(tests/both/conftest.py): `D.demo` is the framework's demo module (benchmarks/torch_demo.py or
paddle_demo.py: DemoDecoder, whose attention is a splitting op), `D.simulated()` where captures run.
tests/gpu/test_gpu_dispatch.py runs them on real graphs."""
from __future__ import annotations

import logging

import pytest

import graph_opt
from graph_opt.decorator import state_of

SIZES = [1, 2, 4, 8]
HIDDEN, LAYERS = 16, 2


class Kind:
    """What dispatch_key_fn answers: set by the test, read at each call."""

    def __init__(self):
        self.value = "full"

    def __call__(self, x):
        return self.value


def _model(D, level=0, key=None, **cfg):
    key = key or Kind()
    cls = graph_opt.support_graph_optimization(type("Dispatched", (D.demo.DemoDecoder,), {}), dispatch_key_fn=key)
    config = graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_mode="full_and_piecewise",
                                      cudagraph_capture_sizes=SIZES, **cfg)
    model, reference = D.demo.build(config, hidden=HIDDEN, layers=LAYERS, cls=cls)
    return model, reference, key


def _capture(D, model):
    with D.simulated():
        return graph_opt.capture_model(model, lambda n: D.demo.make_inputs(n, HIDDEN, seed=n), progress=False)


@pytest.mark.parametrize("level", [0, 1])
def test_each_size_has_both_kinds_and_the_key_picks_one_per_call(D, level):
    model, reference, kind = _model(D, level)
    report = _capture(D, model)
    assert report.failed is None and [s.size for s in report.sizes] == sorted(SIZES, reverse=True)
    pieces = report.sizes[0].pieces  # cut at each layer's attention (Paddle's SOT may cut once more)
    assert pieces >= LAYERS + 1 and all(s.pieces == pieces and s.graphs == pieces + 1 for s in report.sizes), \
        str(report)
    with D.demo.no_grad():
        for step, (k, bs) in enumerate([("full", 4), ("piecewise", 4), ("full", 3), ("piecewise", 8)]):
            kind.value = k
            x = D.demo.make_inputs(bs, HIDDEN, seed=100 + step)["x"]
            same, diff = D.demo.compare(model(x), reference(x))
            # bitwise where the replay computed what eager does: level 0 at a captured size
            assert same if level == 0 and bs in SIZES else diff <= 1e-5, f"{k} at batch {bs}: max diff {diff}"
    stats = graph_opt.stats(model)
    assert stats.replays_by_kind == {"full": 2, "piecewise": 2} and stats.replays == 4 and stats.fallbacks == 0
    assert stats.graphs == {size: pieces + 1 for size in SIZES} and "full and piecewise" in stats.mode


def test_the_kinds_share_one_memory_pool_and_one_guard(D):
    model, _, _ = _model(D)
    _capture(D, model)
    runner = state_of(model).runner
    assert runner.piecewise.pool is runner.full.pool
    assert runner.full.guard is runner.piecewise.guard is runner.guard


def test_a_capture_failure_drops_both_kinds_with_one_warning(D, caplog, monkeypatch):
    model, reference, kind = _model(D)
    with D.simulated():
        runner = state_of(model).ensure_runner()
    real = runner.piecewise.strategy.capture

    def failing(args, kwargs, padded, *rest, **kw):
        if padded == 4:
            raise RuntimeError("injected piecewise capture fault")
        return real(args, kwargs, padded, *rest, **kw)

    monkeypatch.setattr(runner.piecewise.strategy, "capture", failing)
    with caplog.at_level(logging.WARNING, logger="graph_opt"):
        report = _capture(D, model)
    assert "injected piecewise capture fault" in report.failed
    assert len([r for r in caplog.records if "injected" in r.getMessage()]) == 1
    x = D.demo.make_inputs(4, HIDDEN, seed=1)["x"]
    with D.demo.no_grad():
        for k in ("full", "piecewise"):
            kind.value = k
            assert D.demo.compare(model(x), reference(x))[0]
    assert graph_opt.stats(model).replays == 0 and graph_opt.stats(model).captured_sizes == []
    graph_opt.clear_graphs(model)
    monkeypatch.setattr(runner.piecewise.strategy, "capture", real)
    assert _capture(D, model).failed is None
    assert graph_opt.stats(model).captured_sizes == SIZES


def test_a_lazy_capture_failing_in_one_kind_stops_both_and_train_mode_never_replays(D, caplog, monkeypatch):
    """The kinds share the model's state (training flags, replaced parameters...): one kind failing at a
    call must not leave the other replaying without those checks."""
    model, reference, kind = _model(D)
    x = D.demo.make_inputs(4, HIDDEN, seed=1)["x"]
    with D.simulated(), D.demo.no_grad():
        model(x)
        model(x)  # full@4 captured at the call, then replayed
        runner = state_of(model).runner

        def failing(*a, **k):
            raise RuntimeError("injected piecewise capture fault")

        monkeypatch.setattr(runner.piecewise.strategy, "capture", failing)
        kind.value = "piecewise"
        with caplog.at_level(logging.WARNING, logger="graph_opt"):
            assert D.demo.compare(model(x), reference(x))[0]
        assert len([r for r in caplog.records if "injected" in r.getMessage()]) == 1
        model.train()
        reference.train()
        kind.value = "full"
        before = graph_opt.stats(model).replays
        assert D.demo.compare(model(x), reference(x))[0]
    stats = graph_opt.stats(model)
    assert stats.replays == before and "injected" in stats.disabled_reason


def test_a_bad_key_and_a_missing_key_fn_are_named(D):
    model, _, kind = _model(D)
    _capture(D, model)
    kind.value = "decode"
    with D.demo.no_grad(), pytest.raises(graph_opt.GraphOptInputError,
                                         match=r"dispatch_key_fn returned 'decode'; it must return 'full'"):
        model(D.demo.make_inputs(2, HIDDEN)["x"])
    cls = graph_opt.support_graph_optimization(type("NoKey", (D.demo.DemoDecoder,), {}))
    named = r"cudagraph_mode='full_and_piecewise' \(from GraphOptConfig\(\)\) for NoKey.*dispatch_key_fn"
    with pytest.raises(graph_opt.GraphOptConfigError, match=named):
        cls(HIDDEN, LAYERS, graph_opt_config=graph_opt.GraphOptConfig(cudagraph_mode="full_and_piecewise"))
    with pytest.raises(graph_opt.GraphOptInputError, match=r"dispatch_key_fn='full'.*expected a callable"):
        graph_opt.support_graph_optimization(type("BadKey", (D.demo.DemoDecoder,), {}), dispatch_key_fn="full")


def test_a_call_above_the_largest_size_warns_once_for_the_model_whichever_kind(D, caplog):
    """The two kinds are one model: "above_max" is said once, and counted per call."""
    caplog.set_level(logging.WARNING, logger="graph_opt")
    model, reference, kind = _model(D)
    _capture(D, model)
    with D.demo.no_grad():
        for k, bs in (("full", SIZES[-1] + 1), ("piecewise", SIZES[-1] + 9)):
            kind.value = k
            x = D.demo.make_inputs(bs, HIDDEN, seed=bs)["x"]
            assert D.demo.compare(model(x), reference(x))[1] <= 1e-5
    said = [r.getMessage() for r in caplog.records if "above the largest capture size" in r.getMessage()]
    assert len(said) == 1 and graph_opt.stats(model).fallback_reasons == {"above_max": 2}, (said, graph_opt.stats(model))
