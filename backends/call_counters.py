"""Process-wide change counters, for both frameworks: a class's methods (or a module's functions)
wrapped so that every call bumps a one-element list first. A replay compares the count with the one it saw and looks at the model
again only after a bump (graph_opt.watch.replay_guards). Installed through the patch registry (patches.py)."""
from __future__ import annotations

import functools
from typing import Callable, Iterable, List, Optional

from . import patches


def count_calls(owner, names: Iterable[str], counter: List[int], why: str,
                unless: Optional[Callable[[], bool]] = None) -> None:
    """Wrap owner.<name> for each name (a class's methods, or a module's functions looked up at call time):
    every call adds one to counter[0] before the original runs and one after, except while unless() is
    true. After as well: a replay in another thread that looked between the two (and found the model as
    it was) sees the second."""
    for name in names:
        method = getattr(owner, name)

        def counted(*args, _method=method, **kwargs):
            counting = unless is None or not unless()
            if counting:
                counter[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                if counting:
                    counter[0] += 1

        patches.replace(owner, name, functools.wraps(method)(counted), why)
