"""Every row of the mode table on torch, on CPU with simulated graphs (graph_opt.testing).

Each graph mode is checked for: replays bitwise equal to eager (level 2: to its Inductor kernels run
without graphs) on the same padded inputs at every
captured size; real rows equal to eager on the unpadded inputs within 1e-5; fallback above the max;
no Dynamo recompile after capture.
"""
import pytest
import torch

import graph_opt
from graph_opt.backends.torch.dynamo import graphs_compiled
from graph_opt.decorator import state_of
from torch_zoo.small import SIZES, Stack, make_x

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: padding changes the matmul blocking, not the math

GRAPH_MODES = [  # (graph_opt_level, full_cuda_graph, graphs per size)
    pytest.param(0, True, 1, id="level0-full"),
    pytest.param(0, False, 3, id="level0-piecewise"),
    pytest.param(1, True, 1, id="level1-full"),
    pytest.param(1, False, 3, id="level1-piecewise"),
    pytest.param(2, False, 3, id="level2-piecewise", marks=pytest.mark.inductor),
]


def _model(level, full, use_cudagraph=True, sizes=SIZES):
    torch.manual_seed(0)
    cfg = graph_opt.GraphOptConfig(graph_opt_level=level, use_cudagraph=use_cudagraph, full_cuda_graph=full,
                                   cudagraph_capture_sizes=sizes)
    return Stack(graph_opt_config=cfg)


def _eager(m, *args):
    with torch.no_grad():
        return type(m).forward(m, *args)


def _same_kernels(m, *args):
    """What the replayed kernels compute without graphs: eager at levels 0-1 (the traced FX graph runs
    the same ops); at level 2 the Inductor-compiled pieces, run through Dynamo on the capture branch."""
    state = state_of(m)
    if state.config.graph_opt_level < 2:
        return _eager(m, *args)
    (sig,) = state.runner.signatures.values()
    with graph_opt.sot_warmup_guard(True), graph_opt.capture_custom_allreduce(), torch.no_grad():
        return state.runner.strategy.warmup(args, {}, args[0].shape[0], sig)


def _entry(m, padded):
    (sig,) = state_of(m).runner.signatures.values()
    return sig.entries[padded]


@pytest.mark.parametrize("level,full,graphs", GRAPH_MODES)
def test_graph_mode_replays_match_eager(level, full, graphs):
    m = _model(level, full)
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, make_x, progress=False)
    assert report.failed is None
    assert report.captured_sizes == SIZES
    compiled_after_capture = graphs_compiled()
    translations = graph_opt.stats(m).translations
    with torch.no_grad():
        for real in (1, 2, 3, 4, 5, 7, 8):
            x = make_x(real, seed=100)
            y = m(x)
            assert y.shape == (real, x.shape[1])
            torch.testing.assert_close(y, _eager(m, x), **TOL)
            padded = state_of(m).runner.table.padded_size(real)
            entry = _entry(m, padded)
            assert entry.captured.stable_outputs
            static = [t.clone() for t in entry.inputs]
            assert torch.equal(entry.captured.outputs, _same_kernels(m, *static)), f"replay of size {padded} differs"
        y = m(make_x(9))  # above the max capture size
    s = graph_opt.stats(m)
    assert s.fallbacks == 1
    assert s.replays == 7
    assert s.graphs == {size: graphs for size in SIZES}
    assert graphs_compiled() - compiled_after_capture == (1 if level >= 1 else 0)  # only the call above the max
    assert s.translations - translations == (1 if level >= 1 else 0)
    torch.testing.assert_close(y, _eager(m, make_x(9)), **TOL)


@pytest.mark.parametrize("level", [0, 1])
def test_without_graphs_the_plugin_runs_the_plain_path(level):
    m = _model(level, True, use_cudagraph=False)
    report = graph_opt.capture_model(m, make_x, progress=False)
    assert report.captured_sizes == []
    with torch.no_grad():
        for real in (1, 3, 9):
            torch.testing.assert_close(m(make_x(real)), _eager(m, make_x(real)), **TOL)
    s = graph_opt.stats(m)
    assert s.captures == 0 and s.replays == 0
    assert s.mode == ("eager" if level == 0 else "static (level 1)")
    assert (s.translations > 0) == (level == 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="graphs are available on a CUDA machine; this is the CPU case")
def test_level1_without_cuda_graphs_warns_once_and_runs_dynamo():
    m = _model(1, False)  # graphs wanted, none here, no simulation
    report = graph_opt.capture_model(m, make_x, progress=False)
    assert report.captured_sizes == []
    assert any("CUDA graphs are unavailable" in n for n in report.notes)
    with torch.no_grad():
        torch.testing.assert_close(m(make_x(3)), _eager(m, make_x(3)), **TOL)
    assert graph_opt.stats(m).translations >= 1
    assert graph_opt.stats(m).mode == "static (level 1); cuda graphs (piecewise) configured but unavailable here"
