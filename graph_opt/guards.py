"""Mode flags that model code may branch on, and the custom all-reduce capture protocol.

`is_capturing()` is true during the whole capture phase of a size: its warmups, its SOT/Dynamo
translation and its capture. Code that branches on it is therefore traced on its capture branch,
and that branch is what the replayed graph runs.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager, List, Tuple

# The flags below, the split hook (split.set_hook) and SOT's run_program hook are process-wide, and
# each guard restores the value it found: two threads setting them at once would restore each other's
# values and could leave is_capturing() true for good. graph_opt holds this lock wherever it sets them
# for a call: the capture phase of a size, Paddle's SOT scope, a simulated level-0 replay. Re-entrant,
# for a graph-optimized model called inside another. Code in other threads still reads the flags as
# set (is_capturing() is true for every thread while one captures), as with vLLM's global flags.
state_lock = threading.RLock()


def create_guard(default) -> Tuple[Callable[[Any], ContextManager[None]], Callable[[], Any]]:
    """A (context manager, getter) pair over one value held in a closure."""
    guard, get, _ = _create_flag(default)
    return guard, get


def _create_flag(default):
    """create_guard's pair, and a plain setter (returns the old value) for graph_opt's own fast paths."""
    state = default

    @contextlib.contextmanager
    def guard(value):
        nonlocal state
        old = state
        state = value
        try:
            yield
        finally:
            state = old

    def get():
        return state

    def set_(value):
        nonlocal state
        old = state
        state = value
        return old

    return guard, get, set_


sot_warmup_guard, in_sot_warmup_mode, _set_sot_warmup = _create_flag(False)
_capture_phase_guard, is_capturing, _set_capturing = _create_flag(False)


_this_thread = threading.local()


def capture_phase_in_this_thread() -> bool:
    """Whether this thread is inside a size's capture phase: a graph-optimized model called now is a
    submodule of the model being captured, whose graph records its work (runner.py)."""
    return getattr(_this_thread, "phase", False)


@contextlib.contextmanager
def this_thread_captures():
    was = getattr(_this_thread, "phase", False)
    _this_thread.phase = True
    try:
        yield
    finally:
        _this_thread.phase = was


def as_captured(check: Callable[..., Any], *args) -> Any:
    """check(*args) with graph_opt's flags as they were at capture (in_sot_warmup_mode() and
    is_capturing() true). For evaluating the framework's guards before a replay: those on these flags
    hold by construction (the graph was captured on that branch), the others are checked."""
    return _with_flags(True, check, args)


def as_outside_capture(check: Callable[..., Any], *args) -> Any:
    """check(*args) with graph_opt's flags off, as a call outside any capture finds them."""
    return _with_flags(False, check, args)


def _with_flags(value: bool, check: Callable[..., Any], args) -> Any:
    with state_lock:
        warm, capturing = _set_sot_warmup(value), _set_capturing(value)
        try:
            return check(*args)
        finally:
            _set_sot_warmup(warm)
            _set_capturing(capturing)


_communicators: List[Any] = []


def register_custom_allreduce(comm):
    """Register a communicator whose `capture()` context must be entered while graphs are captured.

    This is the vLLM / FastDeploy custom all-reduce protocol: `comm.capture()` returns a context
    manager; inside it the communicator records the buffers that captured graphs will use.
    """
    capture = getattr(comm, "capture", None)
    if not callable(capture):
        raise TypeError(
            f"register_custom_allreduce(comm): comm must have a capture() method returning a context manager, "
            f"got {type(comm).__name__}"
        )
    if not any(c is comm for c in _communicators):
        _communicators.append(comm)
    return comm


def unregister_custom_allreduce(comm) -> None:
    _communicators[:] = [c for c in _communicators if c is not comm]


@contextlib.contextmanager
def capture_custom_allreduce():
    """Enter every registered communicator's capture() and set is_capturing() for the block."""
    with contextlib.ExitStack() as stack:
        for comm in list(_communicators):
            stack.enter_context(comm.capture())
        stack.enter_context(_capture_phase_guard(True))
        yield
