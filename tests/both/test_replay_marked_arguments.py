"""Inference replays never silently wrong through the common call's shortcut (graph_opt/replay/fast_replay.py) or
arguments read in place (graph_opt.mark_static_address): a marked cache written once per call and left as
found by the capture, another tensor in a marked argument answered without graphs, memory shared with a
marked cache never taking the shortcut. On both frameworks (the fixture `fw`), graphs simulated on CPU.
"""
import copy
import dataclasses

import pytest

import graph_opt
from graph_opt.decorator import state_of
from replay_support import HIDDEN, capture, eager_padded, pair, same, shortcut_taken, warned

_CI_SECONDS = 3  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch here only where Inductor's kernels change what a replay must get right; tests/gpu runs
# every case at every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {
    "test_the_common_call_replays_through_its_plan_and_equals_eager",
    "test_a_marked_cache_is_written_in_place_once_per_call_and_left_as_found_by_the_capture",
}


def test_an_output_that_is_rows_of_a_marked_argument_stays_a_view_of_it(F, M, level):
    """Eager returns a view of the caller's cache, which later calls write: so does the replay's output,
    kept or not (the argument is the caller's memory, not the graphs')."""
    if level >= 1 and not F.static_writes_inputs:
        pytest.skip("Paddle's SOT returns a copy of an argument's slice (docs/calls-and-captures.md)")
    m, twin = pair(F, M.ReturnsRowsOfMarked, level)
    cache = graph_opt.mark_static_address(F.randn(8, HIDDEN, seed=9))
    cache_twin = F.clone(cache)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), cache))
    x1, x2 = F.randn(4, HIDDEN, seed=1), F.randn(4, HIDDEN, seed=2)
    with F.graphs(), F.no_grad():
        a, w = m(x1, cache), twin(x1, cache_twin)
        m(x2, cache), twin(x2, cache_twin)
        assert F.close(a, w) and F.close(a, F.rows(cache, 0, 4))  # both views show the second call's write


def test_the_common_call_replays_through_its_plan_and_equals_eager(F, M, level, monkeypatch):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (8, 3):  # the full path replays each size once and keeps its plan
            x = F.randn(real, HIDDEN, seed=real)
            assert same(F, level, m(x), eager_padded(F, twin, x))
        runner = state_of(m).runner
        assert runner.shortcut is not None and sorted(runner.shortcut.plans) == [3, 8]
        shortcut_taken(m, monkeypatch)
        for real in (8, 3, 3, 8):
            x = F.randn(real, HIDDEN, seed=10 + real)
            assert same(F, level, m(x), eager_padded(F, twin, x)), f"a call of {real} rows through the shortcut"
    assert graph_opt.stats(m).replays == 6


def test_a_call_the_shortcut_refuses_has_written_nothing(F, M):
    m, twin = pair(F, M.KVCache, 0, sizes=[4, 8], pad_values={"pos": 15})
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)))
    with F.no_grad():
        x, pos = F.randn(8, HIDDEN, seed=1), F.arange(8)
        assert F.close(m(x, pos), twin(x, pos))
        (sig,) = state_of(m).runner.signatures.values()
        assert state_of(m).runner.shortcut.plans
        before = [F.clone(b) for b in sig.buffers]
        with pytest.raises(graph_opt.GraphOptInputError, match="pos"):
            m(F.randn(8, HIDDEN, seed=2), F.randn(8, seed=3))  # pos of another dtype
        assert all(F.equal(a, b) for a, b in zip(before, sig.buffers)), "a refused call wrote a static buffer"
        assert F.close(m(x, pos), twin(x, pos))


def test_the_plans_go_with_the_graphs(F, M, level, monkeypatch):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(4, HIDDEN, seed=4)
    with F.no_grad():
        m(x)
        assert state_of(m).runner.shortcut is not None
        graph_opt.clear_graphs(m)
        assert state_of(m).runner is None or state_of(m).runner.shortcut is None
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
        assert same(F, level, m(x), twin(x))
        shortcut_taken(m, monkeypatch)
        assert same(F, level, m(x), twin(x))


def test_a_replay_that_raises_in_the_shortcut_answers_eagerly_and_drops_the_graphs(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(8, HIDDEN, seed=8)
    with F.no_grad():
        m(x)
        plans = state_of(m).runner.shortcut.plans

        def broken():
            raise RuntimeError("device lost")
        plans[8] = dataclasses.replace(plans[8], replay=broken)
        assert F.close(m(x), twin(x))
        assert F.close(m(x), twin(x))
    s = graph_opt.stats(m)
    assert "replay of size 8 failed: RuntimeError: device lost" in s.disabled_reason
    assert s.replay_failures == 1 and len(warned(logs, "device lost")) == 1


SLOTS = 16  # the cache's rows; padding rows write the last one, which no real call uses


def _cache_pair(F, M, level, **kw):
    m, twin = pair(F, M.ArgCache, level, pad_values={"slots": SLOTS - 1}, **kw)
    cache = graph_opt.mark_static_address(F.randn(SLOTS, HIDDEN, seed=99))
    return m, twin, cache, F.clone(cache)


def _cache_inputs(F, cache, n, start=0, seed=0):
    return F.randn(n, HIDDEN, seed=seed or n), cache, F.arange(n, start=start)


def _sot_drops_the_write(F, level):
    return level >= 1 and not F.static_writes_inputs  # Paddle's SOT: the capture fails, eager answers (case 8)


def _twin_call(F, level, twin, x, cache, slots):
    """The twin's answer to a call, run once (it adds into the cache): on the rows the replay runs."""
    if _sot_drops_the_write(F, level):
        return twin(x, cache, slots)
    return eager_padded(F, twin, x, cache, slots, batch=(0, 2), pads={2: SLOTS - 1})


def test_a_marked_cache_is_written_in_place_once_per_call_and_left_as_found_by_the_capture(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: _cache_inputs(F, cache, n), progress=False)
    if _sot_drops_the_write(F, level):
        assert "writes its argument 'cache' in place" in report.failed
    else:
        assert report.failed is None, report.failed
        assert state_of(m).runner.buffer_bytes() < 8 * SLOTS * HIDDEN, "the cache was given a static buffer"
    assert F.equal(cache, cache_twin), "capturing left the marked cache other than it found it"
    with F.no_grad():
        for real, start in ((3, 0), (8, 4), (2, 12), (3, 0), (8, 4)):
            x, _, slots = _cache_inputs(F, cache, real, start, seed=real + start)
            assert F.close(m(x, cache, slots), _twin_call(F, level, twin, x, cache_twin, slots)), \
                f"the call of {real} rows at {start}"
            assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1)), \
                f"the cache after the call of {real} rows at {start} differs from eager's"
    s = graph_opt.stats(m)
    assert s.replays == (0 if _sot_drops_the_write(F, level) else 5), s


def test_a_marked_cache_captured_at_its_first_call_is_written_once(F, M, level):
    """No capture_model: the warmups, the capture and its check run on the caller's cache, which gets the
    call's one write all the same."""
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    with F.graphs(), F.no_grad():
        for real, start in ((3, 0), (3, 4), (8, 7), (2, 0)):
            x, _, slots = _cache_inputs(F, cache, real, start, seed=real + start)
            assert F.close(m(x, cache, slots), _twin_call(F, level, twin, x, cache_twin, slots)), \
                f"the call of {real} rows at {start}"
            assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1)), \
                f"the cache after the call of {real} rows at {start} differs from eager's"
    s = graph_opt.stats(m)
    assert s.replays + s.fallbacks == 4 and (s.replays > 0) != _sot_drops_the_write(F, level), s


def test_another_tensor_in_a_marked_argument_runs_without_graphs_and_the_marked_one_is_untouched(F, M, level, logs):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    if _sot_drops_the_write(F, level):
        return  # no graphs to refuse: the first test of this section
    capture(F, m, lambda n: _cache_inputs(F, cache, n))
    other, other_twin = F.randn(SLOTS, HIDDEN, seed=5), F.randn(SLOTS, HIDDEN, seed=5)
    with F.no_grad():
        for _ in range(2):
            x, _, slots = _cache_inputs(F, other, 3)
            assert F.close(m(x, other, slots), twin(x, other_twin, slots))
            assert F.equal(other, other_twin)
        assert F.equal(cache, cache_twin), "a call with another tensor wrote the marked one"
        x, _, slots = _cache_inputs(F, cache, 3)
        assert F.close(m(x, cache, slots), twin(x, cache_twin, slots))  # the marked one replays again
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallback_reasons == {"moved": 2}, s
    assert len(warned(logs, "'cache'", "mark_static_address")) == 1


def test_a_marked_read_only_table_replays_through_the_shortcut_and_sees_the_callers_writes(F, M, level, monkeypatch):
    m, twin = pair(F, M.ReadsTable, level)
    table = graph_opt.mark_static_address(F.randn(HIDDEN, seed=4))
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), table))
    with F.no_grad():
        x = F.randn(3, HIDDEN, seed=1)
        assert same(F, level, m(x, table), eager_padded(F, twin, x, table))
        shortcut_taken(m, monkeypatch)
        for scale in (2.0, 3.0):
            F.zero_buffer(table)  # the caller writes its table: the graph reads it where it is
            x = F.randn(3, HIDDEN, seed=int(scale))
            assert same(F, level, m(x, table), eager_padded(F, twin, x, table))
    assert graph_opt.stats(m).replays == 3


def test_marked_arguments_that_cannot_be_read_in_place_are_errors_naming_them(F, M):
    m, _ = pair(F, M.ReadsTable, 0, dims={"x": 0, "table": 0})
    table = graph_opt.mark_static_address(F.randn(HIDDEN, seed=4))
    with pytest.raises(graph_opt.GraphOptConfigError, match="dynamic_arg_dims\\['table'\\]=0.*mark_static_address"):
        capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), table))
    m, _ = pair(F, M.ReadsTable, 0)
    with F.graphs():
        report = graph_opt.capture_model(
            m, lambda n: (F.randn(n, HIDDEN, seed=n), graph_opt.mark_static_address(F.randn(HIDDEN, seed=n))),
            progress=False)
    assert report.failed is not None and "'table'" in report.failed and "same tensor for every size" in report.failed
    with pytest.raises(TypeError, match="mark_static_address takes a torch.Tensor or paddle.Tensor; got list"):
        graph_opt.mark_static_address([1.0])


def test_another_tensor_in_a_marked_argument_at_a_new_size_is_not_captured_and_graphs_stay(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    other, other_twin = F.randn(SLOTS, HIDDEN, seed=5), F.randn(SLOTS, HIDDEN, seed=5)
    with F.graphs(), F.no_grad():
        for real, c, c_twin in ((3, cache, cache_twin), (8, other, other_twin), (3, cache, cache_twin),
                                (8, cache, cache_twin)):
            x, _, slots = _cache_inputs(F, c, real)
            assert F.close(m(x, c, slots), _twin_call(F, level, twin, x, c_twin, slots))
            assert F.equal(F.rows(c, 0, SLOTS - 1), F.rows(c_twin, 0, SLOTS - 1))
    s = graph_opt.stats(m)
    if not _sot_drops_the_write(F, level):
        assert s.disabled_reason is None and s.lazy_captures == 2 and s.fallback_reasons == {"moved": 1}, s


def test_arguments_sharing_memory_with_a_marked_cache_the_forward_writes_never_take_the_shortcut(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    if _sot_drops_the_write(F, level):
        return  # no graphs (the first test of this section)
    capture(F, m, lambda n: _cache_inputs(F, cache, n))
    with F.no_grad():
        x, _, slots = _cache_inputs(F, cache, 4, start=8)
        assert F.close(m(x, cache, slots), twin(x, cache_twin, slots))  # a replay: the plan for 4 rows is kept
        slots = F.arange(4)
        want = twin(F.rows(cache_twin, 0, 4), cache_twin, slots)  # x is a view of the rows the forward adds to
        translations = graph_opt.stats(m).translations
        assert F.close(m(F.rows(cache, 0, 4), cache, slots), want)
        assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1))
        slots = F.arange(4, start=4)  # x overlaps the rows the forward adds to from another first address
        want = twin(F.rows(cache_twin, 2, 6), cache_twin, slots)
        assert F.close(m(F.rows(cache, 2, 6), cache, slots), want)
        assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1))
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"aliased": 2}
    assert s.translations == translations  # the plain forward answers it: nothing compiled for the aliasing
