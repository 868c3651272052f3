"""One process per rank for the multi-GPU benchmarks (bench tp, bench ddp), under a hard deadline: a rank
still running then is killed, and the run reports it (a process group's teardown can hang, and a hang is a
failure, never a wait)."""
from __future__ import annotations

import time
from typing import Callable, List, Tuple


def spawn_ranks(target: Callable, args_of: Callable[[int], tuple], world: int,
                timeout_s: float) -> Tuple[List[int], List[int]]:
    """Run target(*args_of(rank)) in `world` spawned processes; (the ranks killed at the deadline, every
    rank's exit code)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    return hung, [p.exitcode for p in procs]
