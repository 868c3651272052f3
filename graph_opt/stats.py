"""Counters that tests assert on, and the report capture_model returns; the same for autocudagraph
blocks (TrainingCounters, TrainingStats)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional


@dataclass
class Counters:
    captures: int = 0  # sizes captured (a size split in pieces counts once)
    replays: int = 0  # calls answered by replaying a captured size
    fallbacks: int = 0  # calls that ran without graphs while graphs were enabled
    lazy_captures: int = 0  # sizes first captured at call time, after capture_model
    capture_failures: int = 0
    replay_failures: int = 0  # replays that raised (the graphs were then dropped; see disabled_reason)
    translations: int = 0  # SOT / Dynamo translations done for this model


@dataclass(frozen=True)
class Stats:
    """A snapshot of one model's counters (graph_opt.stats(model))."""

    mode: str
    captures: int
    replays: int
    fallbacks: int
    lazy_captures: int
    capture_failures: int
    translations: int
    copies_inserted: int  # copies the safety pass inserted (program passes, Paddle level >= 1)
    reads_rewired: int  # reads after a loop it moved to the loop's result
    copies_removed: int  # loop-carried copies removed
    captured_sizes: List[int]
    pieces: Dict[int, int]  # padded size -> pieces in its graph
    graphs: Dict[int, int]  # padded size -> device graphs captured for it
    capture_seconds: float
    graph_memory_bytes: Optional[int]  # None where not measurable (simulated graphs, CPU)
    static_buffer_bytes: int
    disabled_reason: Optional[str]  # why graphs are off: a capture or replay that failed
    replay_failures: int = 0  # replays that raised; the call then ran eagerly and graphs were dropped
    host_copies_in_graph: int = 0  # replays whose graph copied the host_outputs into pinned memory itself
    host_copies_streamed: int = 0  # calls whose host_outputs were copied on the copy stream afterwards
    replays_by_kind: Dict[str, int] = field(default_factory=dict)  # cudagraph_mode full_and_piecewise
    # why calls ran without graphs: graph_opt.watch.fallbacks.Reason's values (docs/fallbacks.md: cause, fix)
    fallback_reasons: Dict[str, int] = field(default_factory=dict)
    # 1 where the default level 0 was left for level 1 (graph_opt.capture.level_switch): the eager forward's
    # capture failed on a copy from host memory, which tracing removes; retraced_reason is that warning
    retraced: int = 0
    retraced_reason: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SizeReport:
    size: int
    pieces: int
    graphs: int
    warmups: int
    capture_ms: float
    memory_bytes: Optional[int]


@dataclass
class CaptureReport:
    """What capture_model did; str(report) is a table."""

    mode: str
    sizes: List[SizeReport] = field(default_factory=list)
    seconds: float = 0.0
    translations: int = 0
    failed: Optional[str] = None  # why capture stopped; the model then runs without graphs
    notes: List[str] = field(default_factory=list)
    rank: Optional[int] = None  # this process's rank when several captured together (graph_opt.capture.ranks)
    world_size: int = 1

    @property
    def captured_sizes(self) -> List[int]:
        return sorted(s.size for s in self.sizes)

    @property
    def memory_bytes(self) -> Optional[int]:
        known = [s.memory_bytes for s in self.sizes if s.memory_bytes is not None]
        return sum(known) if known else None

    def __str__(self) -> str:
        where = "" if self.rank is None else f", rank {self.rank} of {self.world_size}"
        lines = [f"graph_opt capture: mode={self.mode}, {len(self.sizes)} sizes in {self.seconds:.2f} s, "
                 f"translations={self.translations}{where}"]
        if self.sizes:
            lines.append(f"{'size':>6} {'pieces':>6} {'graphs':>6} {'warmups':>7} {'capture ms':>10} {'memory':>10}")
            for s in sorted(self.sizes, key=lambda r: -r.size):
                mem = "n/a" if s.memory_bytes is None else _human_bytes(s.memory_bytes)
                lines.append(f"{s.size:>6} {s.pieces:>6} {s.graphs:>6} {s.warmups:>7} {s.capture_ms:>10.2f} {mem:>10}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.failed:
            lines.append(f"capture failed, running without graphs: {self.failed}")
        return "\n".join(lines)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


@dataclass
class TrainingCounters:
    warmups: int = 0  # eager calls spent warming a key up
    captures: int = 0  # keys captured (a forward graph, plus a backward graph when grads are needed)
    replays: int = 0  # forward replays
    backward_replays: int = 0
    fallbacks: int = 0  # calls that ran eagerly with graphs enabled; why: fallback_reasons
    capture_failures: int = 0
    recaptures: int = 0  # graphs dropped because a parameter or buffer was replaced
    capture_seconds: float = 0.0
    fallback_reasons: Dict[str, int] = field(default_factory=dict)
    untraced: int = 0  # keys of a traced level captured from the eager forward: the compiler's limit was spent
    retraced: int = 0  # keys of level 0 traced at level 1: the eager forward's capture failed for a host copy


@dataclass(frozen=True)
class TrainingStats:
    """graph_opt.stats(block) for a block made by autocudagraph."""

    mode: str
    keys: int  # dispatch keys with captured graphs
    graphs: int  # device graphs held: forward, backward, and one per set of outputs a loss left out
    warmups: int
    captures: int
    replays: int  # forward replays
    backward_replays: int
    fallbacks: int
    fallback_reasons: Dict[str, int]  # Reason's values (docs/fallbacks.md): max_graphs, backward_pending, ...
    capture_failures: int
    recaptures: int
    capture_seconds: float
    graph_memory_bytes: Optional[int]  # device memory the pool grew by; None where not measurable
    static_buffer_bytes: int  # inputs, outputs and gradient buffers the graphs read and write
    disabled_reason: Optional[str]  # the last capture failure
    # Keys with graphs by the level each was captured at ({0: 1, 1: 5}): a traced block's keys captured
    # from the eager forward (untraced, or several outputs), a level-0 block's keys traced (retraced)
    key_levels: Dict[int, int] = field(default_factory=dict)
    untraced: int = 0
    retraced: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
