"""Splitting ops: where piecewise graphs are cut, and the split plan over an op sequence.

A splitting op runs eagerly between captured pieces: attention that reads host-side metadata,
communication that cannot be captured, anything that syncs with the host.

- Level 0 (eager): functions marked with @splitting_op cut the eager capture into pieces.
- Level >= 1: on Paddle, marked functions become SOT graph breaks, and names of PIR ops
  ("pd_op.softmax", "custom_op.x") go to FLAGS_cuda_graph_blacklist; on torch, the FX graph is
  split at nodes whose target has a listed name.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..pytree import flatten

# name -> the wrapper returned by @splitting_op
_REGISTRY: Dict[str, Callable] = {}
# Set by the level-0 capture while it records pieces: hook(op, args, kwargs) -> result.
_split_hook: Optional[Callable] = None


@dataclass(frozen=True)
class SplittingOp:
    name: str
    qualified_name: str
    fn: Callable
    out: Optional[str] = None  # keyword through which fn writes its one tensor result into a given tensor


def splitting_op(fn: Optional[Callable] = None, *, name: Optional[str] = None, out: Optional[str] = None):
    """Mark `fn` as a splitting op. Use as @splitting_op or @splitting_op(name="attention").

    The name (default: the function's __name__) is what `cudagraph_splitting_ops` refers to; the
    fully qualified "module.qualname" is accepted too.

    out="output": fn accepts that keyword, writes its (one tensor) result into the tensor given there
    and returns it, as attention kernels with an output argument do; called without it (at capture, and
    at level >= 1) it returns a new tensor. A level-0 piecewise replay then passes the buffer the next
    piece's graph reads, instead of copying a fresh result there: about 8 µs of host time per splitting
    op on an H200 (a copy launch and the fresh tensor's allocation and free).
    """
    if out is not None and (not isinstance(out, str) or not out.isidentifier()):
        raise ValueError(f"@splitting_op(out={out!r}): expected the name of the keyword argument through which "
                         "the function writes its result, e.g. out='output'")

    def mark(fn: Callable) -> Callable:
        if out is not None and not _accepts_keyword(fn, out):
            raise ValueError(f"@splitting_op(out={out!r}) on {fn.__qualname__}: the function has no {out!r} "
                             "parameter (nor **kwargs); it must accept the tensor to write its result into")
        op = SplittingOp(name or fn.__name__, f"{fn.__module__}.{fn.__qualname__}", fn, out)
        existing = _REGISTRY.get(op.name)
        if existing is not None and existing.__graph_opt_split__.qualified_name != op.qualified_name:
            raise ValueError(
                f"splitting op name {op.name!r} is already used by {existing.__graph_opt_split__.qualified_name}; "
                f"pass @splitting_op(name=...) to give {op.qualified_name} another name"
            )

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            hook = _split_hook
            if hook is None:
                return fn(*args, **kwargs)
            return hook(op, args, kwargs)

        wrapper.__graph_opt_split__ = op
        _REGISTRY[op.name] = wrapper
        return wrapper

    if fn is not None:
        return mark(fn)
    return mark


def _accepts_keyword(fn: Callable, keyword: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: trust the caller
        return True
    return any(p.name == keyword and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in params)


def registered() -> Dict[str, Callable]:
    return dict(_REGISTRY)


def op_of(obj) -> Optional[SplittingOp]:
    return getattr(obj, "__graph_opt_split__", None)


class SplitSelection:
    """Which names split, for one model: every marked function when names is None, else those listed."""

    def __init__(self, names: Optional[Sequence[str]]):
        self.names = None if names is None else list(names)
        self._set = None if names is None else set(names)
        self.seen: set = set()

    def matches_function(self, op: SplittingOp) -> bool:
        if self._set is None:
            return True
        return op.name in self._set or op.qualified_name in self._set

    def matches_name(self, name: str) -> bool:
        return self._set is not None and name in self._set

    def selected_functions(self) -> List[Callable]:
        return [w for w in _REGISTRY.values() if self.matches_function(w.__graph_opt_split__)]

    def mark_seen(self, name: str) -> None:
        self.seen.add(name)

    def never_seen(self) -> List[str]:
        if self.names is None:
            return []
        seen = set(self.seen)
        for w in _REGISTRY.values():
            op = w.__graph_opt_split__
            if op.name in seen or op.qualified_name in seen:
                seen.update((op.name, op.qualified_name))
        return [n for n in self.names if n not in seen]


@dataclass
class SplitPlan:
    """Pieces of an op sequence: maximal runs of capturable ops, split ops between them."""

    pieces: List[range] = field(default_factory=list)
    split_at: List[int] = field(default_factory=list)

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)


def plan(op_names: Sequence[str], is_split: Callable[[str], bool]) -> SplitPlan:
    """Split `op_names` (in program order; order is kept because mutations must not be reordered)."""
    result = SplitPlan()
    start = 0
    for i, name in enumerate(op_names):
        if is_split(name):
            if i > start:
                result.pieces.append(range(start, i))
            result.split_at.append(i)
            start = i + 1
    if len(op_names) > start:
        result.pieces.append(range(start, len(op_names)))
    return result


def names_in(op_names: Iterable[str], wanted: Iterable[str]) -> set:
    present = set(op_names)
    return {w for w in wanted if w in present}


def set_hook(hook: Optional[Callable]) -> Optional[Callable]:
    """Install `hook` as the split hook until the caller puts back the one returned (a scope that
    cannot be a with block: backends/paddle/sot_scope.py)."""
    global _split_hook
    old, _split_hook = _split_hook, hook
    return old


def active_hook(hook: Optional[Callable]):
    """Install the level-0 split hook for the duration of a with block."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        global _split_hook
        old = _split_hook
        _split_hook = hook
        try:
            yield
        finally:
            _split_hook = old

    return scope()


def host_addresses(adapter, args, kwargs) -> List[int]:
    """The addresses of the host tensors a splitting op is given: it reads them at every replay, as they
    are then (Captured.split_reads)."""
    return [adapter.data_ptr(t) for t in flatten((args, kwargs), adapter.is_tensor)[0] if adapter.on_host(t)]
