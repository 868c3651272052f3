"""Process-wide change counters, for both frameworks: a class's methods wrapped so that every call
bumps a one-element list first. A replay compares the count with the one it saw and looks at the model
again only after a bump (graph_opt.replay_guards)."""
from __future__ import annotations

import functools
from typing import Iterable, List


def count_calls(owner: type, names: Iterable[str], counter: List[int]) -> None:
    """Wrap owner.<name> for each name: every call adds one to counter[0], then runs the method."""
    for name in names:
        method = getattr(owner, name)

        def counted(self, *args, _method=method, **kwargs):
            counter[0] += 1
            return _method(self, *args, **kwargs)

        setattr(owner, name, functools.wraps(method)(counted))
