"""Inference replays never silently wrong about the state the forward keeps: step counters, Python values
set at every call or at the first, counts in sets and arrays changed in place, buffers written at some
sizes: advanced once per call, as eager advances them. On both frameworks (the fixture `fw`), graphs
simulated on CPU.
"""
import copy

import pytest

import graph_opt
from replay_support import HIDDEN, advance_in_place, capture, eager_padded, pair, same, warned

_CI_SECONDS = 4  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch is left to tests/gpu here: Inductor changes nothing these cases check (tests/conftest.py)
_INDUCTOR_ON_CPU = set()


def _calls_keep_the_buffer_as_eager(F, m, twin, name, sizes):
    """Calls of these sizes against the twin (given the buffers as the capture left them): the outputs,
    and the buffer `name` after each call."""
    F.copy_weights(twin, m)
    with F.no_grad():
        for real in sizes:
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(getattr(m, name), getattr(twin, name)), f"after a call of {real} rows"


def test_a_step_counter_the_forward_advances_replays_padded_calls_and_counts_as_eager(F, M, level, logs):
    """The check's two runs each advance the counter: compared from one state, they agree."""
    m, twin = pair(F, M.CountsSteps, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert not warned(logs, "other values than eager")
    _calls_keep_the_buffer_as_eager(F, m, twin, "steps", (3, 8, 5, 1, 4))
    s = graph_opt.stats(m)
    assert s.replays == 5 and not s.fallback_reasons


def test_sizes_captured_at_calls_advance_a_step_counter_once_per_call(F, M, level):
    """No capture_model: each new size is captured at its first call, which runs the forward several
    times (warmups, the capture, its check); the counter is put back, and the call advances it once."""
    m, twin = pair(F, M.CountsSteps, level)
    with F.graphs():
        _calls_keep_the_buffer_as_eager(F, m, twin, "steps", (4, 3, 8, 4, 2, 8))
    s = graph_opt.stats(m)
    assert s.lazy_captures == 3 and s.replays == 6 and not s.fallback_reasons


def test_sizes_captured_at_calls_advance_a_counter_held_in_an_object_once_per_call(F, M, level):
    m, twin = pair(F, M.CountsInObject, level)
    with F.graphs(), F.no_grad():
        for real in (4, 3, 8, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(m.state.steps, twin.state.steps), f"after a call of {real} rows"
    assert graph_opt.stats(m).lazy_captures == 2


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_python_value_the_forward_sets_at_every_call_is_never_replayed_stale(F, M, level, logs, at_calls):
    """`self.calls += 1; return y * self.calls`: a level-0 replay runs no Python, so it would neither count
    nor compute with the new count. Its capture fails with one warning naming the attribute, and every
    call answers as eager, the counter advanced once per call. At level >= 1 the translated code makes
    the store. Captured at a call, the capture's runs must not advance it either."""
    m, twin = pair(F, M.CountsCalls, level)
    if not at_calls:
        with F.graphs():  # at level 1 Paddle's SOT may refuse the forward: that too answers as eager
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert report.failed is not None or level >= 1
        twin.calls = m.calls
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4, 8, 2)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.close(m(x), twin(x)), f"step {step}"
            assert m.calls == twin.calls, f"step {step}: the counter"
    if level == 0:
        assert len(warned(logs, "sets Python state as it runs", "'calls'")) == 1
        assert graph_opt.stats(m).replays == 0


def test_a_python_list_the_forward_appends_to_is_never_left_behind_at_level_0(F, M, logs):
    m, twin = pair(F, M.LogsCalls, 0)
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.equal(m(x), twin(x)), f"step {step}"
            assert m.seen == twin.seen, f"step {step}: the list"
    assert warned(logs, "sets Python state as it runs", "'seen'")


@pytest.mark.parametrize("kind", ["set", "numpy", "bytearray", "array"])
@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_count_the_forward_keeps_in_a_set_or_array_changed_in_place_is_never_replayed_stale(F, M, logs, kind, at_calls):
    """No binding changes, only the value inside the object: its capture fails naming it, and every call
    answers as eager, the count advanced once per call (a capture at a call puts it back)."""
    m, twin = pair(F, type(f"Counts_{kind}", (M.CountsInPlace,), {"kind": kind}), 0)
    if not at_calls:
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert report.failed is not None and "'seen'" in report.failed
        twin.seen = copy.copy(m.seen)
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4, 8)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.equal(m(x), twin(x)), f"step {step}"
            assert advance_in_place(copy.copy(m.seen)) == advance_in_place(copy.copy(twin.seen)), f"step {step}: the count"
    assert len(warned(logs, "sets Python state as it runs", "'seen'")) == 1
    assert graph_opt.stats(m).replays == 0


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_python_value_the_forward_sets_per_call_is_never_left_stale(F, M, level, logs, at_calls):
    """`self.rows = x.shape[0]`: each size's capture leaves it as its warmups found it, but a replay would
    leave another call's value: a level-0 replay makes no store, and torch's translated code stores the
    padded size's. Where a second size's capture sees it change, every graph goes; where the check of
    padded calls sees a replay leave another value than eager, padded calls run without graphs."""
    m, twin = pair(F, M.KeepsRows, level)
    calls = (4, 4, 8, 3, 2, 8, 5)
    if not at_calls:
        capture_ok = level >= 1 and F.static_makes_python_stores  # torch: its translated code makes the store
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert (report.failed is None) == capture_ok and (capture_ok or "'rows'" in report.failed), report.failed
        calls = calls[1:]
    with F.graphs(), F.no_grad():
        for step, real in enumerate(calls):
            x = F.randn(real, HIDDEN, seed=step)
            assert same(F, level, m(x), twin(x)), f"step {step}"
            assert m.rows == twin.rows, f"step {step}: the value"
    assert warned(logs, "'rows'")


def test_a_flag_the_forward_sets_at_its_first_call_only_still_replays(F, M, level, logs):
    m, twin = pair(F, M.ReadyOnce, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    twin.ready = m.ready
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 8)):
            x = F.randn(real, HIDDEN, seed=step)
            assert same(F, level, m(x), eager_padded(F, twin, x)), f"step {step}"
    assert m.ready is True
    assert graph_opt.stats(m).replays == 3 and not warned(logs, "sets Python state")


def test_a_model_writing_more_state_than_a_call_copies_aside_is_captured_only_by_capture_model(F, M, level, logs):
    """Each of a capture's runs would advance the large buffer, and it is too large to put back."""
    m, twin = pair(F, M.HoldsLargeBuffer, level)
    with F.graphs():
        _calls_keep_the_buffer_as_eager(F, m, twin, "table", (4, 3, 4))
    assert warned(logs, "captured at a call only where", "buffer 'table'", "capture_model()")
    s = graph_opt.stats(m)
    assert s.lazy_captures == 0 and s.replays == 0 and s.fallback_reasons.get("lazy_state", 0) >= 2
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_keep_the_buffer_as_eager(F, m, twin, "table", (4,))  # the buffer as the capture left it, both
    assert graph_opt.stats(m).replays == 1


def test_a_step_counter_reset_by_a_new_tensor_after_capture_is_the_one_advanced(F, M, level):
    """`m.steps = zeros` after capture_model (the natural reset): replays advance the new tensor, or run
    without graphs; never the captured one in its place."""
    m, twin = pair(F, M.AdvancesInPlace, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    m.steps = F.clone(m.steps) * 0
    twin.steps = F.clone(twin.steps) * 0
    with F.no_grad():
        for real in (4, 3, 8, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(m.steps, twin.steps), f"the counter after a call of {real} rows"


def test_a_count_of_rows_seen_replays_only_captured_sizes_and_counts_as_eager(F, M, level, logs):
    """Padding rows run through the forward: a count of rows would count them. The check compares the
    state the two runs leave, and padded calls run without graphs."""
    m, twin = pair(F, M.TalliesRows, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "buffer 'rows_seen'", "padding rows change state")
    _calls_keep_the_buffer_as_eager(F, m, twin, "rows_seen", (3, 8, 5, 1, 4))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"outputs": 3}  # 8 and 4 replay


def test_a_buffer_written_only_at_small_sizes_keeps_captured_sizes_and_counts_as_eager_at_level_0(F, M, logs):
    """A padded call of 3 rows would replay size 4, whose graph never writes the buffer."""
    m, twin = pair(F, M.CountsSmallBatches, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "buffer 'small_batches'")
    _calls_keep_the_buffer_as_eager(F, m, twin, "small_batches", (4, 8, 3, 2, 5))
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallback_reasons == {"outputs": 2}  # 4, 8 and 2 replay; 3 and 5 do not
