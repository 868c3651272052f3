"""A function's __code__, __defaults__ and __kwdefaults__, read at every replay without an audit event.

CPython raises an audit event ("object.__getattr__") at each read of those attributes. Where a library
installed an audit hook (filelock 4 does, under huggingface_hub), every read runs that Python hook:
~0.25 µs instead of ~0.03. A view reads the function's pointer to the value instead: a ctypes object
over the PyFunctionObject field, made once per function. Used only where it is the faster (measured
once), and only where the field layout is the one found on two sample functions.
"""
from __future__ import annotations

import ctypes
import sys
import time
from typing import Callable, Optional

_FIELDS = {"__code__": 6, "__defaults__": 7, "__kwdefaults__": 8}  # words into PyFunctionObject (CPython 3.8+)
_CHOICE: list = []


def _sample(a, b=1, *, c=2):
    return a, b, c


def _plain():
    return None


def _layout_holds() -> bool:
    if sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8 or hasattr(sys, "_is_gil_enabled"):
        return False  # another interpreter, 32-bit, or a free-threaded build (another object header)
    for fn in (_sample, _plain):
        for name, word in _FIELDS.items():
            value = getattr(fn, name)
            if ctypes.c_void_p.from_address(id(fn) + 8 * word).value != (None if value is None else id(value)):
                return False
    return True


def viewer() -> Optional[Callable]:
    """view(fn, name) -> (a ctypes object whose .value is the field's pointer now, the value's expected
    pointer), or None where attribute reads are as fast or the layout is not the known one."""
    if not _CHOICE:
        faster = False
        if _layout_holds():
            view, fn = ctypes.c_void_p.from_address(id(_sample) + 8 * _FIELDS["__code__"]), _sample
            start = time.perf_counter()
            for _ in range(2000):
                view.value
            middle = time.perf_counter()
            for _ in range(2000):
                fn.__code__
            faster = middle - start < (time.perf_counter() - middle) * 0.7
        _CHOICE.append(_view if faster else None)
    return _CHOICE[0]


def _view(fn, name: str):
    value = getattr(fn, name)
    # The caller holds fn: its memory, which the view reads, stays its own.
    return ctypes.c_void_p.from_address(id(fn) + 8 * _FIELDS[name]), None if value is None else id(value)
