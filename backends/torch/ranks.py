"""The ranks of a torch.distributed job, for graph_opt.capture.ranks: a gloo group of their own.

The exchange runs on a separate gloo group, created once per default group (a collective call: every
rank reaches it together, in capture_model or a lazy capture), so it never interleaves with the
model's NCCL collectives and needs no device. Its timeout is the default group's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist


@dataclass
class TorchRankGroup:
    group: Any  # gloo ProcessGroup over every rank of the default group
    rank: int
    world_size: int
    world: Any  # the default group it was made for

    flag: Any = None  # one int on the host, reused by any_rank

    def all_gather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any_rank(self, flag: bool) -> bool:
        if self.flag is None:
            self.flag = torch.zeros(1, dtype=torch.int32)
        self.flag.fill_(1 if flag else 0)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())


_cached: Optional[TorchRankGroup] = None


def rank_group() -> Optional[TorchRankGroup]:
    """The job's ranks, or None without torch.distributed or with one rank."""
    global _cached
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    size = dist.get_world_size()
    if size == 1:
        return None
    if _cached is None or _cached.world is not world:  # a new default group after destroy/init
        _cached = TorchRankGroup(dist.new_group(backend="gloo"), dist.get_rank(), size, world)
    return _cached
