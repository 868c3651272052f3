"""capture_model, clear_graphs and stats: what a user does with a decorated model once it is built."""
from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any, Callable, Optional, Sequence

from . import guards
from .replay import dispatch
from .capture import ranks
from .training import api as training
from .capture.capture_phase import paused_gc
from .decorator import GraphOptState, state_of
from .errors import GraphOptConfigError, GraphOptInputError
from .watch.fallbacks import reason_counts
from .replay.runner import GraphRunner
from .stats import CaptureReport, SizeReport, Stats

logger = logging.getLogger("graph_opt")


def _as_call(inputs, size: int):
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


_ACCEPTS = "a dict of forward's arguments, a tuple of positional arguments, or one tensor"


def _inputs_for(state: GraphOptState, make_inputs, size: int):
    """(args, kwargs) from make_inputs(size), checked against forward's signature before anything runs."""
    try:
        inputs = make_inputs(size)
    except Exception as exc:
        runner = state.runner
        kept = sorted(runner.captured_sizes()) if runner is not None else []
        raise GraphOptInputError(
            f"{state.name}: make_inputs({size}) raised {type(exc).__name__}: {exc}. "
            + (f"Sizes captured before it stay captured ({kept}); " if kept else "Nothing was captured; ")
            + "fix make_inputs and call capture_model again") from exc
    forward = inspect.signature(state.forward_fn)
    shown = f"{state.name}.forward({', '.join(list(forward.parameters)[1:])})"
    if inputs is None:
        raise GraphOptInputError(f"{state.name}: make_inputs({size}) returned None; it must return {_ACCEPTS} "
                                 f"for {shown}, with {size} rows")
    if isinstance(inputs, dict) and any(not isinstance(k, str) for k in inputs):
        bad = next(k for k in inputs if not isinstance(k, str))
        raise GraphOptInputError(f"{state.name}: make_inputs({size}) returned a dict with key {bad!r}; "
                                 f"its keys must be argument names of {shown}")
    args, kwargs = _as_call(inputs, size)
    try:
        forward.bind(state.model, *args, **kwargs)
    except TypeError as exc:
        raise GraphOptInputError(f"{state.name}: make_inputs({size}) returned inputs that do not fit {shown}: "
                                 f"{exc}; it must return {_ACCEPTS}") from None
    return args, kwargs


def capture_model(model, make_inputs: Callable[[int], Any], sizes: Optional[Sequence[int]] = None,
                  progress: bool = True) -> CaptureReport:
    """Capture one graph per padded size, largest first, and return what was done.

    make_inputs(size) returns the forward's inputs for a batch of `size`: a dict of keyword
    arguments, a tuple of positional arguments, or a single tensor. At level >= 1 the first warmup
    is also where SOT/Dynamo translate the forward, inside the capture phase.

    A failure while capturing does not raise: the model keeps running without graphs, one warning
    says why, and report.failed holds the reason.
    """
    state = state_of(model)
    if not callable(make_inputs):
        raise TypeError(
            f"capture_model(make_inputs=...) must be a callable size -> inputs ({_ACCEPTS} with that many rows), "
            f"got {type(make_inputs).__name__}"
        )
    cfg = state.config
    report = CaptureReport(mode=state.mode)
    start = time.perf_counter()
    runner = state.ensure_runner()
    if runner is None:
        report.notes.extend(state.notes or [f"nothing to capture in mode {state.mode}"])
        if cfg.graph_opt_level >= 1 and not state.disabled:
            # Translate now rather than on the first real call: at the sot_warmup_sizes where they are given
            # (the sizes the caller's buffers hold, as FastDeploy warms up), else at the max capture size.
            if not cfg.sot_warmup_sizes:
                args, kwargs = _inputs_for(state, make_inputs, cfg.effective_max_capture_size)
                with state.adapter.no_grad():
                    state.plain_call()(*args, **kwargs)
            _warm_static_path(state, state.plain_call(), make_inputs, 0, report)
        report.seconds = time.perf_counter() - start
        report.translations = _translations(state)
        return report
    in_training = state.adapter.training_modules(model)
    if in_training:
        msg = (f"{state.name} is in training mode, and {', '.join(in_training)} compute otherwise there "
               "(dropout draws other values at every run, batch norm uses the batch's own statistics): the graphs "
               "bake that and padded calls cannot match eager. "
               "Call model.eval() before capture_model() (for training steps use graph_opt.autocudagraph)")
        logger.warning(msg)
        report.notes.append(msg)
    group = ranks.group_for(state.adapter)  # None in a single process
    runner.group = group  # every replay is agreed between the ranks too
    with ranks.all_or_none(group, f"{state.name}: capture_model", GraphOptConfigError):
        wanted = _check_sizes(sizes, runner)
    # Largest first: smaller graphs then reuse the memory pool the largest one reserved.
    order = sorted(wanted, reverse=True)
    ranks.check_same_sizes(group, state.name, order, runner.table.sizes)
    if group is not None:
        report.rank, report.world_size = group.rank, group.world_size
    translations_before = _translations(state)
    with paused_gc():
        _capture_sizes(state, runner, order, make_inputs, report, progress)
        if state.runner is not runner:
            # The default level moved to level 1 (graph_opt.capture.level_switch): the failed capture and the
            # sizes captured before it are dropped, and level 1 captures every size asked for.
            runner = state.runner
            runner.group = group
            report.sizes.clear()
            report.notes.append(state.retraced_reason)
            _capture_sizes(state, runner, order, make_inputs, report, progress)
    runner.capture_model_done = report.failed is None
    if report.failed is None:
        strategy = getattr(state.runner, "strategy", None)  # what a call above the largest size runs
        run = state.plain_call() if strategy is None else (lambda *a, **k: strategy.run(a, k))
        _warm_static_path(state, run, make_inputs, max(order, default=0), report)
    report.notes.extend(note for note in runner.capture_notes if note not in report.notes)
    report.mode = state.mode
    report.seconds = time.perf_counter() - start
    report.translations = _translations(state) - translations_before
    if state.selection is not None:
        missing = state.selection.never_seen()
        if missing and report.failed is None:
            msg = f"splitting ops never seen in any captured graph: {', '.join(missing)}"
            logger.warning("%s: %s", state.name, msg)
            report.notes.append(msg)
    return report


def _warm_static_path(state: GraphOptState, run: Callable, make_inputs, largest: int, report: CaptureReport) -> None:
    """sot_warmup_sizes (FastDeploy's key) above the largest captured size: one call each through the path
    such calls take (the translated forward without graphs), under sot_warmup_guard(True) as FastDeploy
    runs it, so that their first real call does not translate."""
    cfg = state.config
    sizes = sorted(s for s in cfg.sot_warmup_sizes or () if s > largest)
    if not sizes or cfg.graph_opt_level == 0 or state.disabled:
        return
    with guards.sot_warmup_guard(True), state.adapter.no_grad():
        for size in sizes:
            args, kwargs = _inputs_for(state, make_inputs, size)
            run(*args, **kwargs)
    report.notes.append(f"sot_warmup_sizes: the static path ran once at {sizes} (above the largest captured size)")


def _capture_sizes(state: GraphOptState, runner, order, make_inputs, report: CaptureReport, progress: bool) -> None:
    """Capture each size in order into report; at a failure, run without graphs (report.failed), or stop
    where the model took the failure over (a runner of another level is then state.runner)."""
    from tqdm import tqdm

    group = runner.group
    with _guarded(runner), tqdm(total=len(order), desc=f"graph_opt capture {state.name}", unit="size",
                                disable=not progress, leave=False) as bar:
        for size in order:
            # One size at a time in the process, its inputs and its check included: while a thread
            # captures, CUDA refuses another thread's allocations and synchronizations ("operation not
            # permitted when stream is capturing"), so two models captured from two threads take turns.
            with guards.state_lock:
                entry = _capture_size(state, runner, group, size, make_inputs, report)
            if entry is None:
                return
            report.sizes.append(SizeReport(size, entry.captured.pieces, entry.captured.graphs,
                                           state.config.cudagraph_num_of_warmups, entry.capture_ms, entry.memory_bytes))
            bar.update(1)


def _capture_size(state: GraphOptState, runner, group, size: int, make_inputs, report: CaptureReport):
    """The captured entry of one size, checked; None where the capture or its check failed (report.failed)."""
    # Inputs that cannot be captured are the caller's error: raised before anything of this size runs
    # (sizes captured before stay captured), not reported as a capture failure.
    with ranks.all_or_none(group, f"{state.name}: make_inputs({size})", GraphOptInputError):
        sig, leaves = runner.check_capture_inputs(*_inputs_for(state, make_inputs, size), size)
    error = None
    try:
        entry = runner.capture_checked(sig, leaves, size)
    except Exception as exc:  # keep the model working; say why once
        error = exc
    across_ranks = ranks.agree_on_capture(group, size, error)
    if error is not None or across_ranks is not None:
        runner.capture_failed(error, size, across_ranks)
        if state.runner is runner:
            report.failed = runner.disabled_reason
        return None
    runner.finish_captures()
    if runner.disabled_reason is not None:  # the size's check failed the capture
        report.failed = runner.disabled_reason
        return None
    return entry


def _check_sizes(sizes, runner) -> list:
    allowed = runner.table.sizes
    if sizes is None:
        return list(allowed)
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise GraphOptConfigError(
            f"capture_model(sizes={sizes!r}): expected a list of capture sizes, or None for all; "
            f"capture sizes are {allowed}"
        )
    sizes = list(sizes)
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise GraphOptConfigError(
                f"capture_model(sizes=...): {s!r} is not a positive integer; capture sizes are {allowed}"
            )
        if s not in allowed:
            raise GraphOptConfigError(
                f"capture_model(sizes=...): {s!r} is not a capture size; capture sizes are {allowed}"
            )
    return sizes


def _translations(state) -> int:
    strategy = state.runner.strategy if state.runner is not None else getattr(state.plain, "strategy", None)
    return 0 if strategy is None else strategy.translations


def clear_graphs(model) -> None:
    """Drop every graph and static buffer of `model` (e.g. after a weight update); capture_model again after.

    For a block made by autocudagraph: its keys start over (warmup, capture) at their next call."""
    block = training.state_of_training(model)
    if block is not None:
        block.release()
        return
    state = state_of(model)
    if state.runner is not None:
        with _guarded(state.runner):
            state.runner.release()
            state.runner.disabled_reason = None


@contextlib.contextmanager
def _guarded(runner: GraphRunner):
    """Hold the runner's guard: a call from another thread meanwhile is refused, and this is refused
    while another thread's call uses the graphs."""
    if not runner.guard.acquire(False):
        raise runner.busy_error()
    try:
        yield
    finally:
        runner.guard.release()


def _pass_counts(strategy) -> dict:
    """What the program passes did to the strategy's programs (zeros where none ran)."""
    counts = {} if strategy is None else strategy.pass_counts
    return {name: counts.get(name, 0) for name in ("copies_inserted", "reads_rewired", "copies_removed")}


def _host_copy_counts(state) -> dict:
    host = state.host_outputs
    if host is None:
        return {}
    return {"host_copies_in_graph": host.copies_in_graph, "host_copies_streamed": host.streamed}


def _retraced(state) -> dict:
    return {"retraced": int(state.retraced_reason is not None), "retraced_reason": state.retraced_reason}


def stats(model):
    """Counters of a decorated model (Stats), or of a block made by autocudagraph (TrainingStats)."""
    block = training.state_of_training(model)
    if block is not None:
        return block.stats()
    state = state_of(model)
    runner = state.runner
    strategy = runner.strategy if runner is not None else getattr(state.plain, "strategy", None)
    if runner is None:
        return Stats(mode=state.mode, captures=0, replays=0, fallbacks=0, lazy_captures=0, capture_failures=0,
                     translations=0 if strategy is None else strategy.translations, **_pass_counts(strategy),
                     captured_sizes=[], pieces={}, graphs={},
                     capture_seconds=0.0, graph_memory_bytes=None, static_buffer_bytes=0, disabled_reason=None,
                     **_host_copy_counts(state), **_retraced(state))
    c = runner.counters
    return Stats(
        mode=state.mode, captures=c.captures, replays=c.replays, fallbacks=c.fallbacks,
        lazy_captures=c.lazy_captures, capture_failures=c.capture_failures,
        translations=0 if strategy is None else strategy.translations, **_pass_counts(strategy),
        captured_sizes=runner.captured_sizes(), pieces=runner.pieces(), graphs=runner.graphs(),
        capture_seconds=runner.capture_seconds, graph_memory_bytes=runner.memory_bytes,
        static_buffer_bytes=runner.buffer_bytes(), disabled_reason=runner.disabled_reason,
        replay_failures=c.replay_failures, **_host_copy_counts(state),
        replays_by_kind=runner.replays_by_kind() if isinstance(runner, dispatch.KindDispatch) else {},
        fallback_reasons=reason_counts(runner.fallback_reasons), **_retraced(state),
    )
