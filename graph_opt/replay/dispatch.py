"""cudagraph_mode "full_and_piecewise": per padded size a full graph and piecewise graphs, in one pool.

A decode-only batch replays the full graph (attention captured inside); a mixed batch, whose attention
cannot be captured, replays the pieces with attention run eagerly between them. Which kind a call is,
the model's dispatch_key_fn says: it gets the call's arguments and returns "full" or "piecewise".

Each kind is an ordinary GraphRunner (its own strategy, signatures and static input buffers); this
object dispatches between them and answers for both where the plugin asks one runner: capture_model
captures both kinds of each size (largest first, full then piecewise, into one memory pool), stats()
sums them and counts replays per kind, clear_graphs() drops both.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional

from ..errors import GraphOptInputError
from ..stats import Counters

KINDS = ("full", "piecewise")


@dataclass
class _Captured:
    pieces: int
    graphs: int


@dataclass
class BothKinds:
    """What capturing one size did, for capture_model's report."""

    captured: _Captured
    capture_ms: float
    memory_bytes: Optional[int]


class _Strategies:
    """The two kinds' strategies, as one for the counters capture_model and stats() read."""

    def __init__(self, runners):
        self._runners = runners

    @property
    def translations(self) -> int:
        return sum(r.strategy.translations for r in self._runners)

    @property
    def pass_counts(self) -> dict:
        counts: Dict[str, int] = {}
        for r in self._runners:
            for k, v in r.strategy.pass_counts.items():
                counts[k] = counts.get(k, 0) + v
        return counts


class KindDispatch:
    """Two runners, "full" and "piecewise", behind the interface of one (see the module doc)."""

    def __init__(self, full, piecewise, key_fn: Callable, name: str):
        self.full = full
        self.piecewise = piecewise
        self.kinds = {"full": full, "piecewise": piecewise}
        self.key_fn = key_fn
        self.name = name
        self.table = full.table
        self.strategy = _Strategies([full, piecewise])
        if full.guard is not piecewise.guard:
            raise ValueError("KindDispatch: the two runners must share one guard (GraphRunner(guard=...))")
        self.guard = full.guard
        full.siblings, piecewise.siblings = [piecewise], [full]  # one model state: a failure stops both
        piecewise.handed = full.handed  # one pool: a piecewise replay may write where a full one's outputs are

    # -- the call ------------------------------------------------------------------------------------
    fast = None  # no shortcut: each call's kind is the key function's

    def full_call(self, args, kwargs):
        return self(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        kind = self.key_fn(*args, **kwargs)
        runner = self.kinds.get(kind)
        if runner is None:
            raise GraphOptInputError(
                f"{self.name}: dispatch_key_fn returned {kind!r}; it must return 'full' (a batch whose whole "
                "forward can be captured, e.g. decode-only) or 'piecewise' (e.g. a mixed batch)")
        return runner(*args, **kwargs)

    def busy_error(self):
        return self.full.busy_error()

    # -- capture -------------------------------------------------------------------------------------
    def check_capture_inputs(self, args, kwargs, size: int):
        return [r.check_capture_inputs(args, kwargs, size) for r in (self.full, self.piecewise)], None

    def capture_checked(self, checked, _leaves, size: int) -> BothKinds:
        (full_sig, full_leaves), (piece_sig, piece_leaves) = checked
        full = self.full.capture_checked(full_sig, full_leaves, size)
        if self.piecewise.capturer.pool is None:
            self.piecewise.capturer.pool = self.full.pool  # one pool: the pieces reuse what the full graph reserved
        pieces = self.piecewise.capture_checked(piece_sig, piece_leaves, size)
        memory = None if full.memory_bytes is None else full.memory_bytes + (pieces.memory_bytes or 0)
        return BothKinds(_Captured(pieces.captured.pieces, full.captured.graphs + pieces.captured.graphs),
                         full.capture_ms + pieces.capture_ms, memory)

    def finish_captures(self) -> None:
        self.full.finish_captures()
        self.piecewise.finish_captures()

    def capture_failed(self, exc, size: int, across_ranks: Optional[str] = None) -> None:
        self.full.capture_failed(exc, size, across_ranks)  # the one warning; it disables piecewise too
        self.piecewise.counters.capture_failures += 1

    @property
    def disabled_reason(self) -> Optional[str]:
        return self.full.disabled_reason or self.piecewise.disabled_reason

    @disabled_reason.setter
    def disabled_reason(self, value) -> None:
        self.full.disabled_reason = self.piecewise.disabled_reason = value

    @property
    def capture_model_done(self) -> bool:
        return self.full.capture_model_done and self.piecewise.capture_model_done

    @capture_model_done.setter
    def capture_model_done(self, value: bool) -> None:
        self.full.capture_model_done = self.piecewise.capture_model_done = value

    @property
    def pool(self):
        return self.full.pool

    @property
    def group(self):
        return self.full.group

    @group.setter
    def group(self, value) -> None:
        self.full.group = self.piecewise.group = value

    @property
    def capture_notes(self) -> List[str]:
        return self.full.capture_notes + [n for n in self.piecewise.capture_notes if n not in self.full.capture_notes]

    @property
    def fallback_reasons(self) -> Dict[str, int]:
        merged = dict(self.full.fallback_reasons)
        for kind, n in self.piecewise.fallback_reasons.items():
            merged[kind] = merged.get(kind, 0) + n
        return merged

    def release(self) -> None:
        self.full.release()
        self.piecewise.release()

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def counters(self) -> Counters:
        a, b = self.full.counters, self.piecewise.counters
        return Counters(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(Counters)})

    def replays_by_kind(self) -> Dict[str, int]:
        return {kind: r.counters.replays for kind, r in self.kinds.items()}

    def captured_sizes(self) -> List[int]:
        return sorted(set(self.full.captured_sizes()) | set(self.piecewise.captured_sizes()))

    def pieces(self) -> Dict[int, int]:
        return self.piecewise.pieces()

    def graphs(self) -> Dict[int, int]:
        full, pieces = self.full.graphs(), self.piecewise.graphs()
        return {size: full.get(size, 0) + pieces.get(size, 0) for size in self.captured_sizes()}

    @property
    def capture_seconds(self) -> float:
        return self.full.capture_seconds + self.piecewise.capture_seconds

    @property
    def memory_bytes(self) -> Optional[int]:
        known = [r.memory_bytes for r in (self.full, self.piecewise) if r.memory_bytes is not None]
        return sum(known) if known else None

    def buffer_bytes(self) -> int:
        return self.full.buffer_bytes() + self.piecewise.buffer_bytes()


def check_key_fn(key_fn: Any, cls_name: str) -> None:
    if key_fn is not None and not callable(key_fn):
        raise GraphOptInputError(
            f"@support_graph_optimization(dispatch_key_fn={key_fn!r}) on {cls_name}: expected a callable that "
            "takes the forward's arguments and returns 'full' or 'piecewise'")
