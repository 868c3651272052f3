"""Capture failures, clear and recapture, host metadata, and model isolation, on CPU with simulated graphs."""
import logging
import subprocess
import sys

import pytest
import torch

import graph_opt
from graph_opt.backends.torch import pieces
from graph_opt.backends.torch.dynamo import graphs_compiled
from graph_opt.decorator import state_of
from torch_zoo.small import SIZES, HostMeta, Stack, make_lens, make_x, padded

_CI_SECONDS = 4  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(level, full=True, **kw):
    return graph_opt.GraphOptConfig(graph_opt_level=level, full_cuda_graph=full, cudagraph_capture_sizes=SIZES, **kw)


def _eager(m, *args):
    with torch.no_grad():
        return type(m).forward(m, *args)


def test_importing_graph_opt_imports_no_framework():
    code = "import sys, graph_opt; assert 'torch' not in sys.modules and 'paddle' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("level", [0, 1])
def test_a_failure_mid_capture_warns_once_and_the_model_keeps_working(level, monkeypatch, caplog):
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(level, full=False))
    calls = {"n": 0}
    if level == 0:
        from graph_opt import testing

        real_init = testing.HostGraph.__init__

        def failing_init(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 3:  # the third size, after two were captured
                raise RuntimeError("injected capture failure")
            real_init(self, *a, **k)

        monkeypatch.setattr(testing.HostGraph, "__init__", failing_init)
    else:
        real_capture = pieces.CapturablePiece._capture

        def failing_capture(self, args):
            calls["n"] += 1
            if calls["n"] == 7:  # the first piece of the third size (3 pieces per size)
                raise RuntimeError("injected capture failure")
            return real_capture(self, args)

        monkeypatch.setattr(pieces.CapturablePiece, "_capture", failing_capture)
    with caplog.at_level(logging.WARNING, logger="graph_opt"), graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, make_x, progress=False)
    warnings = [r for r in caplog.records if "injected capture failure" in r.getMessage()]
    assert len(warnings) == 1
    s = graph_opt.stats(m)
    assert "injected capture failure" in s.disabled_reason and report.failed == s.disabled_reason
    assert s.capture_failures == 1 and s.captured_sizes == []
    with torch.no_grad():
        for real in (1, 5, 9):
            torch.testing.assert_close(m(make_x(real)), _eager(m, make_x(real)), **TOL)
    assert graph_opt.stats(m).fallbacks == 3


@pytest.mark.parametrize("level,full", [(0, False), (1, False), (1, True)])
def test_clear_and_recapture_needs_no_new_trace(level, full):
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(level, full))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
        compiled = graphs_compiled()
        for _ in range(3):
            graph_opt.clear_graphs(m)
            assert graph_opt.stats(m).captured_sizes == []
            with torch.no_grad():
                m.head.bias.add_(1.0)  # a weight update between captures
            graph_opt.capture_model(m, make_x, progress=False)
    assert graphs_compiled() == compiled
    with torch.no_grad():
        torch.testing.assert_close(m(make_x(3)), _eager(m, make_x(3)), **TOL)
    assert graph_opt.stats(m).replays == 1


@pytest.mark.parametrize("level,split_ops", [(0, None), (1, None), (1, ["graph_opt_test::row_scale"])])
def test_a_splitting_op_that_reads_host_metadata_is_right_at_every_size(level, split_ops):
    torch.manual_seed(0)
    m = HostMeta(graph_opt_config=_cfg(level, full=False, cudagraph_splitting_ops=split_ops))
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda bs: (make_x(bs), make_lens(bs)), progress=False)
    assert report.notes == [] and report.failed is None
    assert graph_opt.stats(m).graphs == {size: 2 for size in SIZES}
    with torch.no_grad():
        for real in (1, 2, 3, 5, 8):
            x, lens = make_x(real, seed=3), make_lens(real, seed=real)
            torch.testing.assert_close(m(x, lens), _eager(m, x, lens), **TOL)
    assert graph_opt.stats(m).replays == 5


def test_a_splitting_op_never_seen_is_reported():
    m = Stack(graph_opt_config=_cfg(1, full=False, cudagraph_splitting_ops=["test_mix", "nolib::missing"]))
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, make_x, progress=False)
    assert any("nolib::missing" in n and "test_mix" not in n for n in report.notes)


def test_two_models_of_one_class_do_not_share_compiled_graphs():
    torch.manual_seed(0)
    a = Stack(graph_opt_config=_cfg(1, full=False))
    b = Stack(graph_opt_config=_cfg(1, full=False))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(a, make_x, progress=False)
        graph_opt.capture_model(b, make_x, progress=False)
    with torch.no_grad():
        x = make_x(3)
        ya, yb = a(x).clone(), b(x).clone()
    torch.testing.assert_close(ya, _eager(a, x), **TOL)
    torch.testing.assert_close(yb, _eager(b, x), **TOL)
    assert not torch.allclose(ya, yb)


def test_a_forward_dynamo_cannot_trace_in_one_graph_falls_back_with_a_clear_reason(caplog):
    @graph_opt.support_graph_optimization
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.proj(x)
            torch._dynamo.graph_break()
            return y + 1

    m = Breaks(graph_opt_config=_cfg(1))
    with caplog.at_level(logging.WARNING, logger="graph_opt"), graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda bs: torch.randn(bs, 4), progress=False)
    assert "one Dynamo graph" in report.failed
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(m(x), m.proj(x) + 1)  # the guarded path copes with graph breaks


def test_autograd_calls_run_without_graphs():
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full=False))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    y = m(make_x(2))
    assert y.requires_grad
    assert graph_opt.stats(m).fallbacks == 1


def test_piece_boundaries_share_one_landing_buffer_across_sizes():
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full=False))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    dynamic, size_one = state_of(m).runner.strategy.forwards  # Dynamo traces size 1 on its own
    assert sorted(k & 0xFFFFF for p in dynamic.pieces for k in p.entries) == [2, 2, 2, 4, 4, 4, 8, 8, 8]
    after_split = [p for p in dynamic.pieces if p.landing]
    assert len(after_split) == 2  # the pieces after each of the two splitting ops
    for piece in after_split:
        (slot, buffer), = piece.landing.items()
        base = buffer.data_ptr()
        for entry in piece.entries.values():  # every size reads a view of the one buffer
            assert base <= entry.inputs[slot].data_ptr() < base + buffer.numel()
    with torch.no_grad():
        for real in (1, 2, 3, 5, 8):
            torch.testing.assert_close(m(make_x(real, seed=real)), _eager(m, make_x(real, seed=real)), **TOL)


def test_a_replaced_parameter_is_never_replayed_stale_and_the_captured_one_keeps_its_values():
    """The graph reads the captured parameter's memory: the replacement's values are not copied there
    (the user may put the captured one back, as an EMA swap does). The call runs without graphs;
    with the captured one back, the replays resume with its own values."""
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full=True))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    captured = m.head.weight
    values = captured.detach().clone()
    m.head.weight = torch.nn.Parameter(torch.randn_like(m.head.weight))  # a new object, not an in-place update
    with torch.no_grad():
        torch.testing.assert_close(m(make_x(3)), _eager(m, make_x(3)), **TOL)
    assert graph_opt.stats(m).replays == 0 and torch.equal(captured, values)
    m.head.weight = captured
    with torch.no_grad():
        assert torch.equal(m(make_x(3)), _eager(m, padded(make_x(3)))[:3])
    assert graph_opt.stats(m).replays == 1


def test_inputs_are_freed_by_refcount_alone_after_a_replay():
    """gc is frozen while graphs are captured: a reference cycle would keep tensors until capture ends."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full=False))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    gc.disable()
    try:
        x = make_x(3)
        ref = weakref.ref(x)
        with torch.no_grad():
            m(x)
        del x
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("level,full", [(0, True), (1, True), (1, False)])
def test_a_captured_model_is_freed_when_its_user_lets_it_go(level, full):
    """A server that builds a new model (new weights, a draft model) and drops the old one gets its memory
    back: nothing process-wide keeps a captured model, its graphs or their pool (torch keeps every
    torch.compile backend until torch._dynamo.reset(): the graph path's backend holds its model weakly)."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(level, full=full))
    with graph_opt.testing.simulate_cuda_graphs():
        assert graph_opt.capture_model(m, make_x, progress=False).failed is None
        with torch.no_grad():
            m(make_x(3))
            m(make_x(max(SIZES) + 1))  # above the largest size: the ordinary compiled path too
    assert graph_opt.stats(m).replays == 1
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_a_decorated_subclass_of_a_decorated_class_calls_through_once():
    """The subclass's decorator wraps the framework's __call__, not the base's plugin call (which would
    recurse), and the subclass's config and options win."""
    Sub = graph_opt.support_graph_optimization(type("Sub", (Stack,), {}), dispatch_key_fn=lambda x: "piecewise")
    torch.manual_seed(0)
    m = Sub(graph_opt_config=graph_opt.GraphOptConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=SIZES))
    with graph_opt.testing.simulate_cuda_graphs():
        assert graph_opt.capture_model(m, make_x, progress=False).failed is None
        with torch.no_grad():
            torch.testing.assert_close(m(make_x(3)), _eager(m, make_x(3)), **TOL)
    assert graph_opt.stats(m).replays_by_kind == {"full": 0, "piecewise": 1}


def test_decorating_again_is_a_no_op_unless_it_asks_for_other_options():
    class Step(torch.nn.Module):
        __call__ = torch.nn.Module.__call__  # the framework's own, spelled out: not a __call__ of the user's

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return {"y": self.lin(x)}

    cls = graph_opt.support_graph_optimization(host_outputs=["y"], pad_values={"x": float("nan")})(Step)
    assert graph_opt.support_graph_optimization(cls) is cls  # asks for nothing
    assert graph_opt.support_graph_optimization(host_outputs=("y",), pad_values={"x": float("nan")})(cls) is cls
    with pytest.raises(graph_opt.GraphOptConfigError, match=r"already decorated with host_outputs=\['y'\]"):
        graph_opt.support_graph_optimization(host_outputs=["z"])(cls)
    m = cls(graph_opt_config={"cudagraph_capture_sizes": [1, 2, 4]}).eval()
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        graph_opt.capture_model(m, lambda bs: torch.randn(bs, 4), progress=False)
        x = torch.randn(3, 4)
        assert torch.allclose(torch.from_numpy(m(x)["y"].result()), Step.forward(m, x)["y"], atol=1e-6)
        assert graph_opt.stats(m).replays == 1
