"""Inference replays never silently wrong when the forward writes its inputs: the caller's tensor is
written as eager writes it, once per call, and overlapping or fed-back arguments are read before any copy
(or the call runs without graphs). On both frameworks (the fixture `fw`), graphs simulated on CPU.
"""
import copy

import graph_opt
from graph_opt.decorator import state_of
from replay_support import HIDDEN, capture, eager_padded, pair, same, shortcut_taken, warned

_CI_SECONDS = 3  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch here only where Inductor's kernels change what a replay must get right; tests/gpu runs
# every case at every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {
    "test_an_in_place_op_on_an_intermediate_tensor_is_computed_as_eager",
    "test_a_forward_that_writes_its_input_writes_the_callers_tensor",
    "test_a_write_its_version_counter_does_not_show_reaches_the_callers_tensor",
    "test_an_input_written_and_returned_is_the_caller_s_tensor_as_in_eager",
}


def _calls_write_the_callers_tensor(F, m, twin):
    """Calls of a captured size, a padded one and the largest: outputs and the caller's written x as eager's."""
    with F.no_grad():
        for real in (4, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            x_twin = F.clone(x)
            assert F.close(m(x), twin(x_twin))
            assert F.equal(x, x_twin), "the caller's tensor did not see the forward's in-place write"


def test_a_forward_that_writes_its_input_writes_the_callers_tensor(F, M, level, logs):
    m, twin = pair(F, M.WritesInput, level)
    if level >= 1 and not F.static_writes_inputs:
        # Paddle's SOT programs do not write their inputs back ("not support input out tensor"): the
        # capture says so and the model runs eagerly, right.
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert "writes its argument 'x' in place" in report.failed
        assert len(warned(logs, "writes its argument 'x' in place", "graph_opt_level=0")) == 1
        x, x_twin = F.randn(3, HIDDEN, seed=3), F.randn(3, HIDDEN, seed=3)
        with F.no_grad():
            assert F.close(m(x), twin(x_twin)) and F.equal(x, x_twin)
        return
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_write_the_callers_tensor(F, m, twin)
    assert graph_opt.stats(m).replays == 3


def test_a_write_its_version_counter_does_not_show_reaches_the_callers_tensor(F, M, level):
    """Paddle's copy_ and set_value, torch's .data: the capture finds the write by the values it changed."""
    m, twin = pair(F, M.WritesUntracked, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_write_the_callers_tensor(F, m, twin)


def test_an_in_place_op_on_an_intermediate_tensor_is_computed_as_eager(F, M, level, logs):
    """Paddle's SOT drops it: the padded call's check finds the captured size itself wrong, and the
    capture fails (the model runs its plain forward) rather than replay it."""
    m, twin = pair(F, M.AddsInPlace, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    sot = level >= 1 and not F.static_writes_inputs
    if sot:
        assert "in-place op on an intermediate tensor" in report.failed, report.failed
        assert len(warned(logs, "gave other values than the plain forward on the same")) == 1
    else:
        assert report.failed is None, report.failed
    with F.no_grad():
        for real in (4, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            assert same(F, level, m(x), twin(x) if sot else eager_padded(F, twin, x)), f"{real} rows"
    assert graph_opt.stats(m).replays == (0 if sot else 3)


def test_nan_capture_inputs_are_not_taken_for_a_write(F, M, level, monkeypatch):
    """A write is also found by the values a warmup changed: NaN compares equal to NaN there."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n) * float("nan"))
    with F.no_grad():
        for seed in (1, 2):  # the full path replays once and keeps its plan: x is not written back
            x = F.randn(4, HIDDEN, seed=seed)
            assert same(F, level, m(x), twin(x))
        shortcut_taken(m, monkeypatch)
        x = F.randn(4, HIDDEN, seed=3)
        assert same(F, level, m(x), twin(x))
    assert graph_opt.stats(m).replays == 3


def test_the_same_tensor_passed_twice_and_written_runs_without_graphs(F, M, level):
    m, twin = pair(F, M.WritesFirst, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (test above)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    x = F.randn(3, HIDDEN, seed=1)
    x_twin = F.clone(x)
    with F.no_grad():
        assert F.close(m(x, x), twin(x_twin, x_twin)), "two arguments sharing memory got separate buffers"
        assert F.equal(x, x_twin)
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 1}


def test_arguments_overlapping_from_another_first_row_and_written_run_without_graphs(F, M, level):
    m, twin = pair(F, M.WritesFirst, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (above)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    base = F.randn(5, HIDDEN, seed=1)
    base_twin = F.clone(base)
    with F.no_grad():  # b starts one row after a: their first addresses differ, their rows overlap
        assert F.close(m(F.rows(base, 0, 4), F.rows(base, 1, 5)), twin(F.rows(base_twin, 0, 4), F.rows(base_twin, 1, 5)))
        assert F.equal(base, base_twin)
        assert F.close(m(F.rows(base, 1, 5), F.rows(base, 0, 4)), twin(F.rows(base_twin, 1, 5), F.rows(base_twin, 0, 4)))
        assert F.equal(base, base_twin)
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 2}


def test_an_output_fed_back_into_a_forward_that_writes_its_argument_runs_without_graphs(F, M, level):
    """The argument is the last replay's output: the replay writes the new output there, so writing the
    argument back after it would overwrite the output (and the argument would not hold eager's write)."""
    m, twin = pair(F, M.WritesInput, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (above)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        y = m(F.randn(4, HIDDEN, seed=4))
        y_twin = F.clone(y)
        for _ in range(3):  # a loop feeding each output back: every other output is the graph's
            want = twin(y_twin)
            y_next = m(y)
            assert F.close(y_next, want) and F.equal(y, y_twin), "the output or the argument's write differs"
            y, y_twin = y_next, F.clone(want)
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"aliased": 2}, s


def test_a_returned_input_fed_back_as_another_argument_is_read_before_any_copy(F, M, level):
    """x_next, x = m(x, x_prev), the returned x passed back as the next x_prev: it is a view of the graph's
    buffer for x, which copying the new x in would overwrite before x_prev is read."""
    m, twin = pair(F, M.Steps, level)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    with F.no_grad():
        for real in (4, 3):  # a captured size, a padded one
            s = (F.randn(real, HIDDEN, seed=real), F.randn(real, HIDDEN, seed=real + 9))
            t = (F.clone(s[0]), F.clone(s[1]))
            for step in range(4):
                s, t = m(*s), twin(*t)
                assert F.close(s[0], t[0]) and F.close(s[1], t[1]), f"step {step} of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.replays == 8 and stats.fallbacks == 0, stats


def test_returned_inputs_fed_back_through_shrinking_sizes_captured_at_calls(F, M, level):
    """No capture_model: each smaller size is captured at a call whose arguments are views of the last
    call's static buffers."""
    m, twin = pair(F, M.Steps, level)
    s = (F.randn(8, HIDDEN, seed=1), F.randn(8, HIDDEN, seed=2))
    t = (F.clone(s[0]), F.clone(s[1]))
    with F.graphs(), F.no_grad():
        for real in (8, 7, 5, 3, 3, 2, 1):
            s, t = m(F.rows(s[0], 0, real), F.rows(s[1], 0, real)), twin(F.rows(t[0], 0, real), F.rows(t[1], 0, real))
            assert F.close(s[0], t[0]) and F.close(s[1], t[1]), f"a call of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.lazy_captures == 3 and stats.replays == 7 and stats.fallbacks == 0, stats


def test_a_returned_input_fed_back_over_its_own_buffer_is_read_before_the_padding_is_filled(F, M, level, logs):
    """xs = m(x)[0][1:]: the padding row of the next call is xs's last row."""
    m, twin = pair(F, M.PassesThrough, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        out, _ = m(F.randn(8, HIDDEN, seed=8))
        xs = F.rows(out, 1, 8)
        want = twin(F.clone(xs))[1]
        assert F.close(m(xs)[1], want)
    stats = graph_opt.stats(m)
    assert stats.replays == 2 and stats.fallbacks == 0 and not warned(logs, "")
    assert state_of(m).runner.disabled_reason is None


def test_an_input_written_and_returned_is_the_caller_s_tensor_as_in_eager(F, M, level):
    """`h = m(h, y)` with `h.add_(...); return h`: eager returns the caller's h, updated; so does a replay,
    and the next call, given that h, replays too (the static copy fed back would be refused as aliased)."""
    m, twin = pair(F, M.AddsIntoAndReturns, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    with F.no_grad():
        for real in (4, 3):
            h0 = F.randn(real, HIDDEN, seed=1)
            t0 = F.clone(h0)
            h, t = h0, t0
            for step in range(3):
                y = F.randn(real, HIDDEN, seed=10 + step)
                h, t = m(h, y), twin(t, y)
                assert h is h0 and t is t0 and F.close(h0, t0), f"step {step} of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.replays == 6 and stats.fallbacks == 0, stats


def test_a_refused_call_has_written_nothing_when_it_runs_without_graphs(F, M, level):
    """The written argument is the last output (refused: "aliased"); the second is the last call's returned
    z, a view of the graph's buffer for z, which copying the third in would overwrite before eager reads it."""
    m, twin = pair(F, M.WritesAndPasses, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails
    capture(F, m, lambda n: tuple(F.randn(n, HIDDEN, seed=n + k) for k in (0, 50, 90)))
    with F.no_grad():
        a, b, c = (F.randn(4, HIDDEN, seed=k) for k in (1, 2, 3))
        o, zo = m(F.clone(a), b, c)
        o_t, zo_t = twin(F.clone(a), b, c)
        z = F.randn(4, HIDDEN, seed=7)
        args, args_t = (o, zo, z), (F.clone(o_t), F.clone(zo_t), z)
        got, want = m(*args), twin(*args_t)
        assert F.close(got[0], want[0]) and F.close(got[1], want[1]) and F.equal(args[0], args_t[0])
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 1}


def test_a_decode_loop_feeding_outputs_back_captures_lazily_and_equals_eager(F, M, level):
    """x = m(x)[:n] without capture_model: each new size is captured at its first call, and the check
    after that capture replays it, writing the outputs x is a view of, before x is copied in."""
    m, twin = pair(F, M.Scaled, level)
    x = F.randn(8, HIDDEN, seed=1)
    with F.graphs(), F.no_grad():
        for n in (8, 8, 4, 4, 2, 2):
            x = F.rows(x, 0, n)
            want = twin(F.clone(x))
            out = m(x)
            assert F.close(out, want), f"the call of {n} rows"
            x = out
    s = graph_opt.stats(m)
    assert s.lazy_captures == 3 and s.replays == 6, s


def test_a_forward_that_writes_its_input_writes_it_once_when_captured_at_the_call(F, M, level):
    """Without capture_model: the size is captured at the first call, and the check after the capture
    replays it. The caller's tensor gets the forward's write once, as in eager; where the capture fails
    (Paddle's SOT drops the write) the call that found it is answered by the plain forward too."""
    m, twin = pair(F, M.WritesInput, level)
    with F.graphs(), F.no_grad():
        for real in (3, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            x_twin = F.clone(x)
            assert F.close(m(x), twin(x_twin)), f"the call of {real} rows"
            assert F.equal(x, x_twin), f"the call of {real} rows wrote its argument other than eager did"
