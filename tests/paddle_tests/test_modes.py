"""Every mode of the mode table against eager, with simulated graphs (Paddle 3.3.1 on CPU)."""
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt.backends.paddle.sot import translate_count  # noqa: E402
from paddle_zoo.small import SIZES, capture, config, decoder, inputs, max_diff, same  # noqa: E402

# float32; a padded batch may take another kernel than the unpadded eager run
ROW_TOLERANCE = 1e-5

_CI_SECONDS = 4  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

MODES = {
    "L0 eager": dict(graph_opt_level=0, use_cudagraph=False),
    "L0 full graph": dict(graph_opt_level=0, full_cuda_graph=True),
    "L0 piecewise": dict(graph_opt_level=0, full_cuda_graph=False),
    "L1 static": dict(graph_opt_level=1, use_cudagraph=False),
    "L1 full graph": dict(graph_opt_level=1, full_cuda_graph=True),
    "L1 piecewise": dict(graph_opt_level=1, full_cuda_graph=False),
    "L2 full graph": dict(graph_opt_level=2, full_cuda_graph=True),
    "L2 piecewise": dict(graph_opt_level=2, full_cuda_graph=False),
}
# layers=2: L0 piecewise cuts the forward at both attentions (3 pieces); L1 piecewise is two
# subgraphs per block (SOT breaks at the attention), each captured whole.
EXPECTED_PIECES = {"L0 full graph": 1, "L0 piecewise": 3, "L1 full graph": 1, "L1 piecewise": 4,
                   "L2 full graph": 1, "L2 piecewise": 4}


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_eager(mode):
    cfg = config(**MODES[mode])
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(cfg)
        report = capture(model)
        assert report.failed is None
        st = graph_opt.stats(model)
        uses_graphs = cfg.use_cudagraph
        assert st.captured_sizes == (SIZES if uses_graphs else [])
        if uses_graphs:
            assert set(st.pieces.values()) == {EXPECTED_PIECES[mode]}
            assert [s.size for s in report.sizes] == sorted(SIZES, reverse=True)  # largest first
        translations_before = translate_count()
        # Captured sizes: bitwise equal to eager on the same (already padded) inputs.
        for bs in SIZES:
            x = inputs(bs, seed=bs)
            out = model(x)
            assert out.shape == [bs, 16]
            assert same(out, reference(x)), f"{mode}: size {bs} differs from eager"
        # Real rows of padded sizes: against an unpadded eager run.
        for bs in (3, 5, 6, 7):
            x = inputs(bs, seed=10 + bs)
            out = model(x)
            assert out.shape == [bs, 16]
            assert max_diff(out, reference(x)) <= ROW_TOLERANCE
        if uses_graphs:
            assert translate_count() == translations_before, "no SOT translation after capture"
            st = graph_opt.stats(model)
            assert st.replays == 8 and st.fallbacks == 0


def test_replayed_padded_rows_equal_eager_on_the_same_padded_input():
    """Bitwise on the same padded inputs: replay size 8 with 5 real rows and compare the 8-row eager run."""
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=1))
        capture(model)
        x8 = inputs(8, seed=3)
        model(x8)  # fills the static buffer's rows 5..7 with x8's rows
        out5 = model(x8[:5])
        entry = next(iter(model._graph_opt_state.runner.signatures.values())).entries[8]
        padded_input = entry.inputs[0]
        assert same(padded_input[:5], x8[:5])
        full = reference(padded_input)
        assert same(out5, full[:5])


def test_outputs_are_the_graphs_memory_and_a_kept_one_keeps_its_values():
    """Every replay writes its outputs in the same memory, as a CUDA graph does, and hands them out
    without a copy; an output a caller still holds gets its values copied at the next replay. With
    keep_outputs=False it is the same tensor, overwritten."""
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for level in (0, 1):
            for keep in (True, False):
                model, reference = decoder(config(graph_opt_level=level, keep_outputs=keep))
                capture(model)
                x1, x2 = inputs(4, seed=1), inputs(4, seed=2)
                a = model(x1)
                ptr = a.data_ptr()
                b = model(x2)
                assert b.data_ptr() == ptr and same(b, reference(x2))
                if keep:
                    assert b is not a and a.data_ptr() != ptr and same(a, reference(x1))
                else:
                    assert b is a


def test_static_input_buffers_are_allocated_once_at_the_max_size():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, _ = decoder(config(graph_opt_level=0))
        capture(model)
        sig = next(iter(model._graph_opt_state.runner.signatures.values()))
        (buffer,) = sig.buffers
        assert buffer.shape == [8, 16]
        for size, entry in sig.entries.items():
            assert entry.inputs[0].data_ptr() == buffer.data_ptr()  # a view, not a copy
            assert entry.inputs[0].shape == [size, 16]
        assert graph_opt.stats(model).static_buffer_bytes == 8 * 16 * 4
