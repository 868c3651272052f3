"""simulate_cuda_graphs(): a host stand-in for CUDA graphs, so the whole capture/replay state machine
runs where CUDA graphs cannot (CPU builds, CI).

What the stand-in keeps of CUDA-graph discipline:
- capture happens once per padded size, after the configured warmups, largest size first;
- `is_capturing()` is true during the capture phase, exactly as with real graphs;
- replay reads the captured input buffers and writes the captured output tensors in place, so the
  tensors a replay returns are the same objects, at the same addresses, on every replay;
- at level >= 1 a replayed subgraph is the very program that was captured: what SOT/Dynamo baked at
  capture (the capture branch of `is_capturing()`, non-tensor arguments) stays baked;
- at level 0 the eager forward runs again on the captured buffers with the capture-time flags
  (`is_capturing()` true inside pieces, false inside splitting ops), so those branches stay baked too.

What it cannot imitate:
- at level 0, Python code inside a captured region runs again on every replay: host values read
  there (Python scalars, `.item()`, object attributes) are re-read, where a real graph would have
  baked them; side effects in that code repeat;
- kernels are not recorded, so there is no device memory to account for (memory reads n/a), no
  stream semantics, and no capture-time errors for syncs a real capture would refuse;
- random ops draw new host random numbers on each replay (a real graph advances its Philox offset).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List

from . import env

_simulating = False

# Set on a tensor by as_host_tensor(): under the stand-in, a host tensor whose value a real graph bakes.
HOST_MARK = "_graph_opt_host_tensor"


@contextlib.contextmanager
def simulate_cuda_graphs():
    """Within this block, graphs captured by graph_opt are host stand-ins (see the module docstring).

    Graphs captured inside keep replaying after the block ends. GRAPH_OPT_SIMULATE_CUDAGRAPH=1 has the
    same effect process-wide.
    """
    global _simulating
    old = _simulating
    _simulating = True
    try:
        yield
    finally:
        _simulating = old


@contextlib.contextmanager
def slow_host_copies(polls: int = 3):
    """Within this block, host copies (to_host_async, host_outputs) start but land only after `polls`
    calls of the future's ready(), at its result(), or when graph_opt next replays a graph (the
    producing stream waits for them, as on a device). A stand-in for a slow device-to-host copy."""
    from . import host_outputs

    old = host_outputs._slow_polls
    host_outputs._slow_polls = polls
    try:
        yield
    finally:
        host_outputs._slow_polls = old


def as_host_tensor(t):
    """Marks `t` as host memory for the stand-in, which has no device (every tensor of a CPU build is on
    the host): graph_opt then treats it as a real graph run treats a CPU tensor argument of a model on
    the device, whose value the capture bakes in. Returns `t`."""
    setattr(t, HOST_MARK, True)
    return t


def simulation_enabled() -> bool:
    return _simulating or env.simulate_requested()


class HostGraph:
    """One simulated graph: replay() runs `run` again and writes its tensors into the captured outputs.

    `run` must read only the captured input buffers; `outputs` are the tensors the capture produced.
    """

    def __init__(self, adapter, run: Callable[[], Any], outputs: List[Any]):
        self.adapter = adapter
        self.run = run
        self.outputs = outputs

    def replay(self) -> None:
        from .pytree import flatten

        fresh, _ = flatten(self.run(), self.adapter.is_tensor)
        if len(fresh) != len(self.outputs):
            raise RuntimeError(
                f"simulated replay produced {len(fresh)} tensors where the capture produced {len(self.outputs)}"
            )
        adapter = self.adapter
        for dst, src in zip(self.outputs, fresh):
            # Skipped where src is dst's very memory (a view of a parameter, made anew each run): a copy
            # would write the parameter in place, which a real replay does not do
            if src is not dst and not (adapter.data_ptr(src) == adapter.data_ptr(dst)
                                       and adapter.stride(src) == adapter.stride(dst)):
                if list(self.adapter.shape(src)) != list(self.adapter.shape(dst)):
                    raise RuntimeError(
                        f"simulated replay produced shape {list(self.adapter.shape(src))} where the capture "
                        f"produced {list(self.adapter.shape(dst))}; a CUDA graph cannot replay a shape change"
                    )
                if not self.adapter.dense(dst):
                    # A broadcast view (arange(n).expand(bs, -1)): a real graph rewrites the memory
                    # under it; here that memory is the view with its stride-0 dimensions cut to one.
                    dst, src = self.adapter.compact(dst), self.adapter.compact(src)
                self.adapter.copy_(dst, src)

    def reset(self) -> None:
        self.run = None
        self.outputs = []
