"""What a replay checks of the frames SOT hands back instead of running SOT's own guard pass: each
frame's non-tensor arguments (_argument_key), and SOT's guard function of the translation, with
graph_opt's capture flags as at capture (the first failing term names what changed).
"""
from __future__ import annotations

import paddle
from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache

from ...guards import as_captured
from ...pytree import value_key


class _FrameView:
    """What SOT's guard functions read of a frame (f_locals, f_globals), for a check before a replay."""

    __slots__ = ("f_locals", "f_globals", "f_code", "f_builtins")

    def __init__(self, f_locals, f_globals, f_code):
        self.f_locals = f_locals
        self.f_globals = f_globals
        self.f_code = f_code
        self.f_builtins = f_globals.get("__builtins__", {})


def _guard_of(code, custom):
    """SOT's guard function of the translation it handed back for `code` (None if not found)."""
    entry = OpcodeExecutorCache().cache.get(code)
    if entry is None:
        return None
    return next((guard for translated, guard in entry[0] if translated is custom), None)


def _failed_guard(guard, frame) -> str:
    """The first failing term of a SOT guard, as SOT's own cache miss analysis finds it."""
    text = getattr(guard, "inlined_expr", None) or getattr(guard, "expr", "")
    head = "lambda frame: "
    failing = "a guard of SOT's translation"
    for term in text.replace(head, "", 1).split(" and "):
        try:
            ok = as_captured(eval(head + term, guard.__globals__), frame)
        except Exception:  # noqa: BLE001 - a term that needs an earlier one: keep looking
            continue
        if ok is False:
            failing = f"`{term.strip()}`"
            break
    return f"Python state the forward read changed since capture: SOT's guard {failing} fails"


_VALUE_TYPES = (bool, int, float, str, bytes, type(None))
# Made afresh at every call, and wholly described by their value: by identity they never match a
# capture (paddle.finfo(dtype).min and outputs[1:] on the stack at a graph break, in PaddleFormers).
_INFO_TYPES = (type(paddle.finfo(paddle.float32)), type(paddle.iinfo(paddle.int32)))


def _argument_key(frame):
    """The non-tensor arguments of a frame: plain values by value, other objects by identity,
    containers walked, tensors skipped (their shapes are checked where the graph reads them)."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    local_values = frame.f_locals
    return tuple(_value_key(local_values.get(name)) for name in code.co_varnames[:count])


def _value_key(value, depth=0):
    if isinstance(value, paddle.Tensor):
        return None
    if isinstance(value, _VALUE_TYPES):
        return value_key(value)  # 1, 1.0 and True differ; so do 0.0 and -0.0
    if depth < 4 and isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_value_key(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return ("dict",) + tuple((k, _value_key(v, depth + 1)) for k, v in value.items())
    if isinstance(value, slice):
        return ("slice", _value_key(value.start, depth + 1), _value_key(value.stop, depth + 1),
                _value_key(value.step, depth + 1))
    if isinstance(value, _INFO_TYPES):
        return (type(value).__name__, str(value))  # dtype, bits, min, max...
    return ("id", id(value))
