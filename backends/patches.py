"""Every change graph_opt makes to a framework's own objects, in one registry: what was replaced, with
what, and why (docs/patches.md lists them; a test keeps that list true).

Nothing is patched at import. Each group is installed at its first use (the first model that needs the
counter it feeds) through once(), and remove_all() puts every original back, in reverse order, once no
captured model or graphed block holds graphs (depend/release); the next use installs the group again. Patches held only for the length of a call (the capture's
gc.collect, SOT's program hook) are context managers where they are made, not here.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..errors import GraphOptError

_ABSENT = object()


@dataclass
class Patch:
    group: str  # "torch.modes": what installed it, as once() names it
    where: str  # "torch.nn.Module.train"
    why: str
    undo: Callable[[], None]


_patches: List[Patch] = []
# What reads the counters the patches feed: a captured model's state, a graphed block. While one holds
# graphs, removing the patches would leave its replays blind to the changes they count.
_dependents: "weakref.WeakSet" = weakref.WeakSet()
_groups: Dict[str, bool] = {}
_lock = threading.Lock()
_current: List[str] = []  # the group being installed


def once(group: str, install: Callable[[], None]) -> None:
    """Run install() the first time `group` is asked for (and again after remove_all())."""
    if _groups.get(group):
        return
    with _lock:
        if _groups.get(group):
            return
        _current.append(group)
        try:
            install()
        finally:
            _current.pop()
        _groups[group] = True


def replace(owner: Any, name: str, new: Any, why: str, where: Optional[str] = None) -> Any:
    """Set owner.<name> to `new`, remembering what was there (an attribute the owner only inherited is
    deleted again on removal, not copied onto it). Returns the original."""
    original = owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
    current = getattr(owner, name)

    def undo():
        if original is _ABSENT:
            try:
                delattr(owner, name)
            except AttributeError:
                setattr(owner, name, current)
        else:
            setattr(owner, name, original)

    setattr(owner, name, new)
    _patches.append(Patch(_group(), where or f"{_qualname(owner)}.{name}", why, undo))
    return current


def on_removal(undo: Callable[[], None], where: str, why: str) -> None:
    """A change made another way (a global hook the framework registers, with a handle to remove it)."""
    _patches.append(Patch(_group(), where, why, undo))


def depend(owner) -> None:
    """`owner` (held weakly) replays graphs that rely on the counters until release(owner)."""
    _dependents.add(owner)


def release(owner) -> None:
    _dependents.discard(owner)


def installed() -> List[Patch]:
    return list(_patches)


def remove_all() -> int:
    """Put every original back (last installed first); the groups install again at their next use.
    Returns how many were removed. Refused while a captured model or graphed block still holds graphs
    (clear_graphs() them first): its replays would no longer see what the counters count."""
    holders = len(_dependents)
    if holders:
        raise GraphOptError(
            f"graph_opt.backends.patches.remove_all(): {holders} captured model(s) or graphed block(s) hold graphs "
            "whose replays rely on the change counters these patches feed; call graph_opt.clear_graphs() on each "
            "(or drop them) first")
    with _lock:
        n = len(_patches)
        while _patches:
            _patches.pop().undo()
        _groups.clear()
    return n


def _group() -> str:
    return _current[-1] if _current else "(none)"


def _qualname(owner) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", type(owner).__name__)
