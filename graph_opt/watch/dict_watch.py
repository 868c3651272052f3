"""Whether any dict of a set was written since a moment, in one compare.

From Python 3.12, CPython calls a dict watcher (PyDict_AddWatcher) at every write to a dict it watches:
a key added, replaced by another object, deleted, the dict cleared, cloned into or deallocated. A set
of the same object is not a write. One watcher per process bumps one counter; watch() remembers the
counter and its moved() compares it, whatever the number of dicts. Before 3.12 there is no watcher: the caller
compares each dict's version tag (it moves at every write), one per dict.

The watcher's callback is Python called from C through ctypes: it only bumps the counter, and it is
cleared at exit (a callback left set runs while the interpreter is being torn down, and crashes it).
"""
from __future__ import annotations

import atexit
import ctypes
import sys
from typing import Callable, Iterable, List, Optional

_EVENTS = [0]
_WATCHER: List[Optional[int]] = []  # [id] once set up; [None] where this interpreter cannot watch


def _on_event(event, d, key, value):
    _EVENTS[0] += 1
    return 0


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_KEEP = []  # the callback object must outlive the watcher


def _watcher() -> Optional[int]:
    if _WATCHER:
        return _WATCHER[0]
    wid = None
    if sys.version_info >= (3, 12) and sys.implementation.name == "cpython":
        try:
            api = ctypes.pythonapi
            api.PyDict_AddWatcher.argtypes = [_CALLBACK]
            api.PyDict_AddWatcher.restype = ctypes.c_int
            api.PyDict_Watch.argtypes = [ctypes.c_int, ctypes.py_object]
            api.PyDict_Watch.restype = ctypes.c_int
            api.PyDict_ClearWatcher.argtypes = [ctypes.c_int]
            api.PyDict_ClearWatcher.restype = ctypes.c_int
            callback = _CALLBACK(_on_event)
            got = api.PyDict_AddWatcher(callback)
            if got >= 0:
                _KEEP.append(callback)
                atexit.register(api.PyDict_ClearWatcher, got)
                wid = got
        except (AttributeError, OSError, ctypes.ArgumentError):  # no such API, or all watcher slots taken
            wid = None
    _WATCHER.append(wid)
    return wid


def can_watch() -> bool:
    """Whether this interpreter offers dict watchers (CPython 3.12+ with a free watcher slot)."""
    return _watcher() is not None


def watch(dicts: Iterable[dict]) -> Optional[Callable[[], bool]]:
    """moved(): whether any of these dicts was written since this call; None where the interpreter
    cannot watch dicts (before 3.12: the caller compares the dicts' versions itself)."""
    wid = _watcher()
    if wid is None:
        return None
    api = ctypes.pythonapi
    for d in {id(d): d for d in dicts}.values():
        if api.PyDict_Watch(wid, d) != 0:  # pragma: no cover - only a non-dict is refused
            return None
    events = _EVENTS
    seen = events[0]

    def moved() -> bool:
        return events[0] != seen

    return moved
