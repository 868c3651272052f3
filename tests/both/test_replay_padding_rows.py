"""Inference replays never silently wrong about padding rows: they hold the pad value, never write state
that real rows or the caller read, and a forward that mixes rows (or branches on values or on the batch
size) replays only the sizes it was captured at; the check of padded calls runs for every size. On both
frameworks (the fixture `fw`), graphs simulated on CPU.
"""
import copy

import pytest

import graph_opt
from graph_opt.decorator import state_of
from replay_support import HIDDEN, capture, eager_padded, pair, same, warned

_CI_SECONDS = 5  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch here only where Inductor's kernels change what a replay must get right; tests/gpu runs
# every case at every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {
    "test_padding_rows_hold_the_pad_value_never_an_earlier_calls_rows",
}


def test_padding_rows_hold_the_pad_value_never_an_earlier_calls_rows(F, M, level):
    trash = 15  # the cache slot padding rows may write: kernels skip it, as vLLM's slot -1
    m, twin = pair(F, M.KVCache, level, sizes=[4, 8], pad_values={"pos": trash})
    if level >= 1 and not F.static_writes_inputs:  # Paddle's SOT drops the write into the buffer: named
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)), progress=False)
        assert "the model's buffer 'cache' in place" in report.failed
        return
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)))
    F.zero_buffer(m.cache)
    F.zero_buffer(twin.cache)
    with F.no_grad():
        for real, first in ((8, 0), (3, 9), (2, 12), (3, 4)):
            x, pos = F.randn(real, HIDDEN, seed=real + first), F.arange(real, start=first)
            want = eager_padded(F, twin, x, pos, sizes=[4, 8], batch=(0, 1), pads={1: trash})
            assert F.close(m(x, pos), want)
            assert F.equal(F.rows(m.cache, 0, trash), F.rows(twin.cache, 0, trash)), \
                f"cache slots differ from eager after a call of {real} rows at {first}"
    runner = state_of(m).runner
    (sig,) = runner.signatures.values()
    pos_buffer = sig.buffers[1]
    assert F.tolist(pos_buffer)[3:] == [trash] * 5, "padding rows must hold the pad value"
    assert graph_opt.stats(m).replays == 4


def test_padding_rows_are_filled_only_where_an_earlier_call_left_rows(F, M, monkeypatch):
    m, twin = pair(F, M.Scaled, 0, sizes=[4, 8])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    adapter = state_of(m).adapter
    fills = []
    real_fill = adapter.fill_rows
    monkeypatch.setattr(adapter, "fill_rows", lambda t, d, a, b, v: (fills.append((a, b)), real_fill(t, d, a, b, v)))
    with F.no_grad():
        for real in (3, 3, 3, 8, 5, 5, 2, 7):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x))
    # The capture ended with a check of size 4 for a call of 1 row (capture_checks): rows 1..3 hold the
    # pad value. 3 rows: none to fill; 5 after 8: rows 5..7; 2 after 5: rows 2..4; 7: none.
    assert fills == [(5, 8), (2, 5)]
    assert graph_opt.stats(m).replays == 8


def test_a_forward_whose_real_rows_depend_on_other_rows_replays_only_captured_sizes(F, M, level, logs):
    m, twin = pair(F, M.BatchMean, level)
    report = capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "gave other values than eager in output", "capture every batch size")
    assert any("other values than eager" in note for note in report.notes)
    with F.no_grad():
        for real in (3, 8, 5, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"outputs": 2}  # 8 and 4 replay; 3 and 5 run eagerly
    ok, _ = pair(F, M.Scaled, level)
    logs.clear()
    capture(F, ok, lambda n: F.randn(n, HIDDEN, seed=n))
    assert not warned(logs, "other values than eager")


def _state_as_eager(F, m, twin, call, state_of_pair, sizes, level=0):
    """Calls of these sizes, each against the twin run on the real rows alone: the outputs (within
    rounding: a padded batch may round otherwise) and the state after each call (bitwise: a padded call
    that runs without graphs, or a replay of a captured size, leaves exactly what eager leaves; at level
    2 within rounding, as Inductor's fused kernels round otherwise, with or without graphs). A padding
    row's write into another sequence's row is far outside that rounding."""
    same = F.equal if level < 2 else F.close
    with F.no_grad():
        for step, real in enumerate(sizes):
            got, want = call(m, real, step), call(twin, real, step)
            assert F.close(got, want), f"call {step} of {real} rows"
            mine, theirs = state_of_pair()
            assert same(mine, theirs), f"the state after call {step} of {real} rows differs from eager's"


def _written_by_padding(F, logs, report, level, name, failure):
    """A capture that succeeded warned once that padding rows write `name` where a later call reads; one
    that failed (Paddle's SOT drops the write into the state at level >= 1) says `failure`."""
    if report.failed is None:
        assert len(warned(logs, name, "padding rows write")) == 1, [r.getMessage() for r in logs.records]
    elif level >= 1 and not F.static_writes_inputs:
        assert failure in report.failed
    else:
        raise AssertionError(report.failed)


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_per_row_state_buffer_is_never_written_by_padding_rows(F, M, level, full, logs):
    """`self.h[:n] = f(self.h[:n], x)`: a call of 3 rows replayed at 4 would write h[3] too, which the
    next call of 4 rows reads. Padded calls run without graphs; captured sizes replay."""
    m, twin = pair(F, M.RowState, level, full=full)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'h'", "buffer 'h'")
    F.copy_weights(twin, m)
    _state_as_eager(F, m, twin, lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step)),
                    lambda: (m.h, twin.h), (3, 4, 3, 8, 5, 8, 2))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 4 and s.fallback_reasons == {"outputs": 3}, s  # 4, 8, 8 and 2 replay


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_per_row_state_passed_as_a_marked_argument_is_never_written_by_padding_rows(F, M, level, full, logs):
    m, twin = pair(F, M.ArgRowState, level, full=full)
    state = graph_opt.mark_static_address(F.randn(8, HIDDEN, seed=99))
    state_twin = F.clone(state)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), state), progress=False)
    _written_by_padding(F, logs, report, level, "argument 'state'", "'state' in place")
    assert F.equal(state, state_twin), "capturing left the marked state other than it found it"
    _state_as_eager(F, m, twin,
                    lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step), state if model is m else state_twin),
                    lambda: (state, state_twin), (3, 4, 3, 8, 5, 8, 2))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 4 and s.fallback_reasons == {"outputs": 3}, s


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_count_per_token_id_is_never_advanced_by_padding_rows(F, M, level, full, logs):
    """A repetition penalty's counts, `counts.index_add_(0, ids, ones)`: padding rows hold id 0 and would
    count it at every padded call, and later logits would be penalized."""
    m, twin = pair(F, M.PenaltyCounts, level, full=full)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.arange(n, start=1), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'counts'", "buffer 'counts'")
    F.copy_weights(twin, m)
    _state_as_eager(F, m, twin, lambda model, n, step: model(F.arange(n, start=1 + step)),
                    lambda: (m.counts, twin.counts), (3, 3, 5, 4, 8, 3))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 2 and s.fallback_reasons == {"outputs": 4}, s


def test_an_unmarked_argument_the_forward_writes_keeps_what_eager_leaves_in_its_other_rows(F, M, level, logs):
    """`last[:n] = y` into an argument without a batch dimension that is not marked: its static copy is
    written back whole after a replay, so padding rows' writes would reach the caller's rows of other
    slots. Padded calls run without graphs; captured sizes replay."""
    m, twin = pair(F, M.ArgLastRows, level, dims={"x": 0})
    last = F.randn(8, HIDDEN, seed=99)
    mine, theirs = F.clone(last), F.clone(last)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.clone(last)), progress=False)
    if report.failed is not None:
        assert level >= 1 and not F.static_writes_inputs, report.failed
        return
    assert len(warned(logs, "argument 'last'", "padding rows write")) == 1
    _state_as_eager(F, m, twin,
                    lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step), mine if model is m else theirs),
                    lambda: (mine, theirs), (8, 3, 4, 3, 8, 5, 2), level)
    assert graph_opt.stats(m).fallback_reasons == {"outputs": 3}, graph_opt.stats(m)


@pytest.mark.parametrize("pads", [None, {"x": 1.0}, {"slots": 15}], ids=["default", "other_argument", "reserved"])
def test_a_slot_padding_rows_write_is_checked_unless_its_own_pad_value_is_reserved(F, M, level, pads, logs):
    """Padding rows write the cache at slot 0, which a real call's row may own: padded calls run without
    graphs, also when pad_values names only another argument (a value for `x`). A slot reserved for
    padding (pad_values={"slots": 15}) is written by padding rows alone, and padded calls replay."""
    m, twin = pair(F, M.SlotCache, level, pad_values=pads)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n, start=1)),
                                         progress=False)
    if report.failed is not None:
        assert level >= 1 and not F.static_writes_inputs, report.failed
        return
    F.copy_weights(twin, m)
    with F.no_grad():
        for step, slots in enumerate([[0, 9, 10, 11], [5, 6, 7], [12, 13], [0, 3, 4]]):
            x = F.randn(len(slots), HIDDEN, seed=20 + step)
            assert F.close(m(x, F.ids(slots)), twin(x, F.ids(slots))), step
            # every slot but the reserved one (15) as eager leaves it (within rounding: a padded replay's
            # rows round as a batch of the padded size does); another row's values are far outside it
            assert F.close(m.cache[:15], twin.cache[:15]), f"the cache after call {step}"
    s = graph_opt.stats(m)
    if pads == {"slots": 15}:
        assert s.replays == 4 and not s.fallback_reasons, s
    else:
        assert s.fallback_reasons.get("outputs", 0) >= 1, s


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
@pytest.mark.parametrize("kind, name", [("DecayRowState", "h"), ("RowAverage", "avg"), ("LastRows", "last")])
def test_padding_rows_writing_state_as_it_was_or_state_only_the_caller_reads_are_seen(F, M, level, kind, name,
                                                                                       at_calls, logs):
    """A state of zeros that padding rows of zeros write as zeros (the check also starts from a shifted
    state), a running average the caller reads but the output does not (the check compares the state
    later calls leave), and rows the forward only writes, for the caller (a later call writes them too:
    they hold a call's data): padded calls would change rows of other sequences, so they run without
    graphs."""
    m, twin = pair(F, getattr(M, kind), level)
    report = None
    if not at_calls:
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        _written_by_padding(F, logs, report, level, f"buffer '{name}'", f"buffer '{name}'")
    F.copy_weights(twin, m)
    with F.graphs():
        _state_as_eager(F, m, twin, lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step)),
                        lambda: (getattr(m, name), getattr(twin, name)), (3, 4, 3, 8, 5, 8, 3, 4), level)
    if (report is None or report.failed is None) and (level == 0 or F.static_writes_inputs):
        assert graph_opt.stats(m).fallback_reasons.get("outputs", 0) >= 3, graph_opt.stats(m)


def test_counts_read_only_at_the_calls_own_ids_are_never_advanced_by_padding_rows(F, M, level, logs):
    """Capture inputs of random ids in range never hold id 0, the padding rows' id: the check also runs a
    call whose rows all hold the pad values, as a real call holding token 0 would."""
    m, twin = pair(F, M.PenaltyAtIds, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.arange(n, start=5), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'counts'", "buffer 'counts'")
    F.copy_weights(twin, m)
    with F.graphs():
        _state_as_eager(F, m, twin, lambda model, n, step: model(F.arange(n, start=step)),
                        lambda: (m.counts, twin.counts), (3, 5, 4, 3, 8))


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("kind", ["BranchOnValue", "LoopOnValue"])
def test_a_branch_or_loop_on_a_tensor_value_answers_as_eager_on_every_path(F, M, level, full, kind, logs):
    """A call of a captured size that takes another path than the capture did (the branch not taken, a
    loop's other number of turns) gets eager's answer: Paddle's SOT runs the frames it did not record as
    plain Python, and their result is the call's. A padded call would decide such a branch over the
    padding rows too (`x.min()` sees the pad value 0): where the translator shows the branch (level >= 1)
    padded calls run without graphs; at level 0 a real capture fails on the branch's host sync (tests/gpu),
    while the host stand-in re-runs it on the padded rows, so padded calls are checked only there."""
    m, twin = pair(F, getattr(M, kind), level, full=full)
    with F.graphs():
        simulated = graph_opt.testing.simulation_enabled()
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    calls = [(4, "mixed"), (4, "positive"), (8, "large"), (8, "mixed"), (8, "positive"), (4, "large")]
    if level >= 1 or not simulated:
        calls += [(3, "positive"), (5, "large"), (3, "mixed")]
    with F.graphs(), F.no_grad():
        for real, kind_of_x in calls:
            x = F.randn(real, HIDDEN, seed=real)
            x = {"mixed": x, "positive": x * x + 0.1, "large": x * 10.0}[kind_of_x]
            assert F.close(m(x), twin(x)), f"a call of {real} {kind_of_x} rows"
    if report.failed is None and level >= 1 and not F.static_writes_inputs:  # Paddle's SOT traced the branch
        assert warned(logs, "reads a tensor's value on the host")


def test_dummy_capture_inputs_of_zeros_do_not_hide_a_forward_that_mixes_rows(F, M, level, logs):
    """Captured with all-zero inputs (a serving engine's dummy run): padding rows hold the pad value 0
    too, so the check must probe with rows that differ from them."""
    m, twin = pair(F, M.BatchMean, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n) * 0.0)
    assert warned(logs, "gave other values than eager")
    with F.no_grad():
        for real in (3, 5):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).fallback_reasons == {"outputs": 2}


def test_dummy_token_ids_of_zeros_do_not_hide_a_forward_that_mixes_rows(F, M, level, logs):
    """make_inputs gives all-zero ids, as the padding rows hold: the check cannot tell rows apart, so
    padded calls run without graphs, and the warning says how to keep them."""
    m, twin = pair(F, M.EmbedsBatchMean, level)
    capture(F, m, lambda n: F.arange(n) * 0)
    assert warned(logs, "could not be checked", "holds the pad value", "rows that differ")
    with F.no_grad():
        for real in (3, 5, 4):
            ids = F.arange(real, start=1)
            assert F.close(m(ids), twin(ids)), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"outputs": 2} and s.replays == 1


def test_token_ids_whose_rows_differ_from_the_padding_keep_padded_replays(F, M, level, logs):
    """Rows of distinct ids, or every row the largest id (a pad token at the vocabulary's end): the check
    runs on the ids as given (never another id, which could be out of the embedding's range)."""
    for make in (lambda n: F.arange(n, start=1), lambda n: F.arange(n) * 0 + 31):
        m, twin = pair(F, M.Embeds, level)
        logs.clear()
        capture(F, m, make)
        assert not warned(logs, "could not be checked") and not warned(logs, "other values than eager")
        with F.no_grad():
            for real in (3, 5, 4, 1):
                ids = F.arange(real, start=1)
                assert F.close(m(ids), twin(ids)), f"a call of {real} rows"  # padded: other kernels' rounding
        s = graph_opt.stats(m)
        assert s.fallback_reasons == {} and s.replays == 4


def test_a_scalar_output_of_a_batch_statistic_blocks_padded_calls(F, M, level, logs):
    """A 0-d loss beside the rows: the padded check compares it too (Paddle's comparison of 0-d arrays
    used to raise and leave the size captured and unchecked)."""
    m, twin = pair(F, M.MeanLoss, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "other values than eager")
    with F.no_grad():
        for real in (3, 4, 5):
            x = F.randn(real, HIDDEN, seed=real)
            (y, loss), (want_y, want_loss) = m(x), twin(x)
            assert F.close(y, want_y) and F.close(loss, want_loss), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"outputs": 2} and s.replays == 1


def test_padded_calls_the_check_cannot_run_do_not_replay(F, M, level, logs):
    """The plain forward cannot run 3 rows (it pairs rows): nothing checked size 4's padded calls, so a
    call of 3 rows runs eagerly and fails as eager does, instead of replaying size 4."""
    m, twin = pair(F, M.PairsRows, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "could not be checked", "3 rows")
    x3 = F.randn(3, HIDDEN, seed=3)
    with F.no_grad():
        with pytest.raises(Exception):
            twin(x3)
        with pytest.raises(Exception):
            m(x3)
        for real in (4, 2, 8):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).replays == 3


def test_a_forward_that_branches_on_the_batch_size_replays_only_captured_sizes(F, M, level, logs):
    m, twin = pair(F, M.BranchOnBatch, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "other values than eager")
    with F.no_grad():
        for real in (5, 7, 8, 3):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).fallback_reasons.get("outputs", 0) >= 2


def test_the_check_runs_for_every_size_even_when_the_first_capture_is_size_1(F, M, level, logs):
    m, twin = pair(F, M.BatchMean, level, sizes=[1, 2, 4, 8])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n), sizes=[1])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (3, 5, 7):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).replays == 0


def test_a_pad_value_its_argument_cannot_hold_is_an_error_naming_it(F, M):
    m, _ = pair(F, M.KVCache, 0, sizes=[4, 8], pad_values={"pos": 2 ** 70})
    with F.graphs(), pytest.raises(graph_opt.GraphOptConfigError, match=r"pad_values\['pos'\]=1180591620717411303424 "
                                                                      r"does not fit argument 'pos' of dtype"):
        graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)), progress=False)
    assert graph_opt.stats(m).captures == 0
