"""Several ranks capturing one model together (tensor parallelism): the same sizes, the same outcome.

Each rank of a tensor-parallel model captures graphs of its own, and each graph holds collectives
that the peers' graphs must match call for call. So when the framework's distributed package is
initialized with more than one rank:
- capture_model compares the sizes each rank is about to capture, and the padding tables, before
  capturing anything; a mismatch raises GraphOptConfigError on every rank, naming each rank's sizes;
- an error before a size is captured (bad `sizes`, make_inputs) raises on every rank: the failing
  rank its own error, the others one naming that rank, so no rank goes on into a collective alone;
- after each size is captured the ranks exchange the outcome. If any rank failed, every rank drops
  its graphs and runs without them, with one warning naming the failing ranks and why;
- a size first seen at call time (a lazy capture) is agreed the same way;
- every replay is agreed too: where a check before the replay (a guard, the training flag, autocast)
  fails on one rank, every rank runs that call without graphs, so that no rank replays a graph with
  the custom all-reduce while a peer runs NCCL eagerly. This costs one small all-reduce per call.

The exchange goes through a group of its own (gloo; the backend makes it), so it never interleaves
with the model's collectives. It waits for every rank: all ranks call capture_model together and
call the model with the same batch sizes, as tensor parallelism does. Ranks that serve batches of
their own (data parallelism) turn it off with set_agreement(False).

What it cannot prevent: a rank that fails in the middle of an eager run of the forward (a warmup)
leaves its peers waiting inside the model's own collective, until that collective's timeout. A
CUDA graph capture records collectives without running them, so a failure there does not block.
"""
from __future__ import annotations

import contextlib
from typing import Any, List, Optional, Protocol, Sequence, Type

from ..errors import GraphOptConfigError, GraphOptError
from .failures import describe
from ..watch.fallbacks import Fallback, Reason


_enabled = True


class RankGroup(Protocol):
    """Every rank of the job, as the backend exposes them for the exchange."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> List[Any]: ...  # obj of every rank, in rank order

    def any_rank(self, flag: bool) -> bool: ...  # whether flag is true on some rank (one small all-reduce)


def set_agreement(enabled: bool) -> None:
    """Turn the exchange between ranks on (the default) or off, process-wide. Off, every rank
    captures on its own, as a single process does: for ranks whose models share no collective."""
    global _enabled
    _enabled = bool(enabled)


def group_for(adapter) -> Optional[RankGroup]:
    """The ranks that capture together, or None: a single process, or agreement turned off."""
    if not _enabled:
        return None
    name = getattr(adapter, "name", None)
    if name not in ("torch", "paddle"):
        return None
    from .. import backends

    find = getattr(backends.load(name), "rank_group", None)
    return find() if find is not None else None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _failures(errors: Sequence[Optional[str]]) -> str:
    """'rank 1 (RuntimeError: x)' or 'ranks 0, 1 (rank 0: ...; rank 1: ...)' for the ranks with an error."""
    failed = [r for r, e in enumerate(errors) if e is not None]
    if len(failed) == 1:
        return f"rank {failed[0]} ({errors[failed[0]]})"
    return "ranks " + ", ".join(map(str, failed)) + " (" + "; ".join(f"rank {r}: {errors[r]}" for r in failed) + ")"


@contextlib.contextmanager
def all_or_none(group: Optional[RankGroup], what: str, error_type: Type[GraphOptError]):
    """Run the block on every rank; where it raises on some rank, it raises on all. The failing rank
    raises its own error; the others raise error_type naming that rank and its error."""
    if group is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        group.all_gather(_describe(exc))
        raise
    errors = group.all_gather(None)
    if any(e is not None for e in errors):
        raise error_type(f"{what} failed on {_failures(errors)}; every rank stops here")


def check_same_sizes(group: Optional[RankGroup], name: str, order: Sequence[int], table: Sequence[int]) -> None:
    """GraphOptConfigError on every rank unless all ranks capture the same sizes in the same order
    and pad to the same table."""
    if group is None:
        return
    gathered = group.all_gather((list(order), list(table)))
    for index, what in ((0, "would capture"), (1, "pad to the capture sizes")):
        lists = [g[index] for g in gathered]
        if any(lst != lists[0] for lst in lists):
            per_rank = ", ".join(f"rank {r}: {lst}" for r, lst in enumerate(lists))
            raise GraphOptConfigError(
                f"{name}: the ranks {what} different sizes ({per_rank}); every rank must capture the same sizes "
                "(cudagraph_capture_sizes, max_capture_size and capture_model(sizes=...)), since their graphs "
                "hold collectives that must match")


def agree_on_capture(group: Optional[RankGroup], size: int, error: Optional[BaseException]) -> Optional[str]:
    """After one size's capture: None when every rank captured it (or in a single process), else why
    every rank must drop its graphs, naming the ranks that failed."""
    if group is None:
        return None
    gathered = group.all_gather((size, None if error is None else describe(error)))
    sizes = [s for s, _ in gathered]
    if any(s != size for s in sizes):
        per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
        return (f"the ranks captured different sizes at once ({per_rank}); every rank must call the model with "
                f"the same batch sizes, so every rank of {group.world_size} drops its graphs")
    errors = [e for _, e in gathered]
    if all(e is None for e in errors):
        return None
    return f"capture of size {size} failed on {_failures(errors)}, so every rank of {group.world_size} drops its graphs"


def agree_on_replay(group: RankGroup, blocked):
    """Before a replay, with several ranks: None where every rank may replay, else the Fallback this
    rank runs the call without graphs for. blocked: this rank's own Fallback, or None."""
    if not group.any_rank(blocked is not None):
        return None
    reasons = group.all_gather(None if blocked is None else blocked.message)
    if blocked is not None:
        return blocked
    failed = [r for r, why in enumerate(reasons) if why is not None]
    return Fallback(Reason.PEER, f"rank {failed[0]} cannot replay this call ({reasons[failed[0]]}), so every rank "
                                 f"of {group.world_size} runs it without graphs, to keep their collectives matched")
