"""The ranks of a paddle.distributed job, for graph_opt.capture.ranks: a gloo group of their own.

As on torch, the exchange runs on a separate gloo group made once per job (a collective call, which
every rank reaches together), so it never interleaves with the model's collectives. Where Paddle
cannot make a gloo group (a build without gloo), the default group carries the exchange.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional

import paddle
import paddle.distributed as dist

logger = logging.getLogger("graph_opt")


@dataclass
class PaddleRankGroup:
    group: Any  # paddle.distributed Group over every rank, or None for the default group
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> List[Any]:
        out: List[Any] = []
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any_rank(self, flag: bool) -> bool:
        value = paddle.to_tensor([1 if flag else 0], dtype="int32", place=paddle.CPUPlace())
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(int(value.numpy()[0]))


_cached: Optional[PaddleRankGroup] = None


def rank_group() -> Optional[PaddleRankGroup]:
    """The job's ranks, or None before init_parallel_env or with one rank."""
    global _cached
    if not dist.is_initialized():
        return None
    size = dist.get_world_size()
    if size == 1:
        return None
    if _cached is None or _cached.world_size != size:
        try:
            group = dist.new_group(list(range(size)), backend="gloo")
        except Exception as exc:  # noqa: BLE001 - any failure: the default group still works
            logger.debug("graph_opt: no gloo group for the rank exchange (%s); using the default group", exc)
            group = None
        _cached = PaddleRankGroup(group, dist.get_rank(), size)
    return _cached
