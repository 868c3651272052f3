"""simulate_cuda_graphs(): a host stand-in for CUDA graphs, so the whole capture/replay state machine
runs where CUDA graphs cannot (CPU builds, CI). What the stand-in keeps of CUDA-graph discipline, and
what it cannot imitate, is said in graph_opt/recorders/host_graphs.py, which holds it.

- simulate_cuda_graphs(): within a `with` block, captures are host stand-ins; called alone, from then on
  (GRAPH_OPT_SIMULATE_CUDAGRAPH=1: process-wide); simulation_enabled() says whether they are now.
- as_host_tensor(t): marks t as host memory, whose value a real graph would bake in.
- slow_host_copies(): host copies (to_host_async, host_outputs) that land late.
- HostGraph: one stand-in graph.
"""
from __future__ import annotations

import contextlib

from .recorders.host_graphs import HOST_MARK, HostGraph, as_host_tensor, simulate_cuda_graphs, simulation_enabled

__all__ = ["HOST_MARK", "HostGraph", "as_host_tensor", "simulate_cuda_graphs", "simulation_enabled",
           "slow_host_copies"]


@contextlib.contextmanager
def slow_host_copies(polls: int = 3):
    """Within this block, host copies (to_host_async, host_outputs) start but land only after `polls`
    calls of the future's ready(), at its result(), or when graph_opt next replays a graph (the
    producing stream waits for them, as on a device). A stand-in for a slow device-to-host copy."""
    from .replay import host_outputs

    old = host_outputs._slow_polls
    host_outputs._slow_polls = polls
    try:
        yield
    finally:
        host_outputs._slow_polls = old
