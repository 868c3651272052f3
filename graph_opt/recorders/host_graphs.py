"""The host stand-in for CUDA graphs (HostGraphs), so the whole capture/replay state machine runs where
CUDA graphs cannot (CPU builds, CI); the switch that turns it on (simulate_cuda_graphs(),
GRAPH_OPT_SIMULATE_CUDAGRAPH=1), and graphs_for(), which picks it or the device's graphs for a capture.
graph_opt.testing is its public face.

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
import threading
from typing import Any, Callable, List

from .. import env, guards
from ..capture import split
from ..replay.captured_size import Captured
from .device_graphs import DeviceGraphs
from ..pytree import flatten

_simulating = False

# Set on a tensor by as_host_tensor(): under the stand-in, a host tensor whose value a real graph bakes.
HOST_MARK = "_graph_opt_host_tensor"


class simulate_cuda_graphs:
    """Graphs captured by graph_opt from this call on are host stand-ins (see the module docstring).

    As `with simulate_cuda_graphs():` the stand-in is on within the block and off again after it; called
    alone, `simulate_cuda_graphs()`, it stays on, as GRAPH_OPT_SIMULATE_CUDAGRAPH=1 does process-wide.
    Graphs captured while it is on keep replaying after it is off.
    """

    def __init__(self):
        global _simulating
        self._old = _simulating
        _simulating = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        global _simulating
        _simulating = self._old
        return False


def simulation_enabled() -> bool:
    return _simulating or env.simulate_requested()


def as_host_tensor(t):
    """Marks `t` as host memory for the stand-in, which has no device (every tensor of a CPU build is on
    the host): graph_opt then treats it as a real graph run treats a CPU tensor argument of a model on
    the device, whose value the capture bakes in. Returns `t`."""
    setattr(t, HOST_MARK, True)
    return t


def graphs_for(adapter):
    """The graphs a capture records (contracts.Recorder): the stand-in's while simulate_cuda_graphs() or
    GRAPH_OPT_SIMULATE_CUDAGRAPH=1 is on, else the device's."""
    return HostGraphs(adapter) if simulation_enabled() else DeviceGraphs(adapter)


class HostGraph:
    """One simulated graph: replay() runs `run` again and writes its tensors into the captured outputs.

    `run` must read only the captured input buffers; `outputs` are the tensors the capture produced.
    """

    def __init__(self, adapter, run: Callable[[], Any], outputs: List[Any]):
        self.adapter = adapter
        self.run = run
        self.outputs = outputs

    def replay(self) -> None:
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


class HostGraphs:
    """The stand-in's side of contracts.Recorder: a recorded graph is Python that runs again at each
    replay and writes its results into the tensors the capture produced. No pool, no memory to measure."""

    def __init__(self, adapter):
        self.adapter = adapter

    def available(self) -> bool:
        return True

    def new_pool(self):
        return None

    def memory_in_use(self):
        return None

    def release_memory(self) -> None:
        pass

    # -- inference ---------------------------------------------------------------------------------
    def record(self, fn: Callable[[], None], pool):
        return fn, []  # no graph: fn itself runs at each replay, as a graph's recorded work would

    def record_outputs(self, fn: Callable[[], Any], pool, share=None):
        outputs = fn()
        if share is not None:
            outputs = share.redirect(outputs)  # the stand-in copies each replay's values there
            share.mark_written(outputs)
        return outputs, HostGraph(self.adapter, fn, flatten(outputs, self.adapter.is_tensor)[0])

    def op_recorded(self, capture: Callable[[], Any], plain: Callable[[], Any]):
        """The op runs as it would without graphs, at capture and at each replay."""
        outputs = plain()
        graph = HostGraph(self.adapter, plain, list(outputs))
        return outputs, lambda op: graph.replay(), graph

    def capture_eager(self, eager, args, kwargs, pool, tail=None, share=None) -> Captured:
        """Level 0: the forward runs again whole at each replay, with the capture-time flags, where a
        device records pieces between the splitting ops (level0.EagerStrategy.record_pieces)."""
        adapter = self.adapter
        splits = [0]
        host_reads: set = set()
        selection = eager.selection
        # The split hook is process-wide: a splitting op another thread calls meanwhile runs plain.
        owner = [threading.get_ident()]

        def count_split(op, a, k):
            if selection is not None and selection.matches_function(op) and threading.get_ident() == owner[0]:
                selection.mark_seen(op.name)
                splits[0] += 1
                host_reads.update(split.host_addresses(adapter, a, k))
            return op.fn(*a, **k)

        with split.active_hook(count_split):
            outputs = eager.call(*args, **kwargs)
        out_leaves, _ = flatten(outputs, adapter.is_tensor)
        kept = share.redirect(outputs) if share is not None else None
        if kept is not None:
            share.mark_written(kept)

        def eager_split(op, a, k):
            if selection is None or not selection.matches_function(op) or threading.get_ident() != owner[0]:
                return op.fn(*a, **k)
            with guards.sot_warmup_guard(False), guards._capture_phase_guard(False):
                return op.fn(*a, **k)

        def rerun():
            # Re-run with the capture-time flags: pieces see is_capturing() true, splitting ops false.
            # The flags are process-wide: hold guards.state_lock, as a capture does.
            with guards.state_lock:
                owner[0] = threading.get_ident()
                with guards.sot_warmup_guard(True), guards._capture_phase_guard(True), adapter.no_grad():
                    with split.active_hook(eager_split):
                        out = eager.call(*args, **kwargs)
                        if kept is not None:
                            share.copy(out, kept)
                        if tail is not None:
                            # as a real graph's tail reads them: the shared rows, and this run's other outputs
                            tail(share.merged(out, kept) if kept is not None else out)
                        return out

        graph = HostGraph(adapter, rerun, out_leaves)
        pieces = splits[0] + 1
        return Captured(outputs if kept is None else kept, graph.replay, True, pieces, pieces, keepalive=[graph],
                        split_reads=frozenset(host_reads))

    # -- training: one key's forward and backward --------------------------------------------------
    def capturing_parameters(self, bridge, module, params):
        return contextlib.nullcontext(params)

    def warm_up_step(self, bridge, forward, needs_grad: bool, grad_inputs, writes, rng) -> set:
        return set()  # no private warmup: the capture is the forward's first run

    def step_forward(self, bridge, forward, pool) -> "HostStepForward":
        return HostStepForward(bridge, forward)

    def captured_writes(self, writes: Callable[[], set]) -> set:
        return writes()  # the capture ran the forward

    def step_backward(self, bridge, forward, inputs, grad_out_buffers, pool, used=None) -> "HostStepBackward":
        return HostStepBackward(bridge, forward, inputs, grad_out_buffers, used)

    def keep(self, graph, *written) -> None:
        graph.keep(*written)

    def kept_outputs(self, outputs):
        return None  # the latest replay's outputs (HostStepForward.live) serve

    def partial_outputs(self, step):
        return step.forward.live

    def weak_alias(self, t):
        return t

    def after_capture(self, bridge, rng) -> None:
        bridge.set_rng_state(rng)  # the capture ran the block; the replay must draw as eager would


class HostStepForward:
    """replay() runs the forward again on the static inputs, with autograd on when the key needs it,
    writes the output buffers in place and keeps the fresh outputs for the backward's replay."""

    def __init__(self, bridge, run: Callable[[], Any]):
        self.bridge = bridge
        self.run = run
        self.out_buffers: List[Any] = []
        self.live: List[Any] = []  # the latest replay's differentiable outputs, with their autograd graph

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def keep(self, out_buffers, differentiable) -> None:
        self.out_buffers = out_buffers
        self.differentiable = differentiable

    def replay(self) -> None:
        fresh = flatten(self.run(), self.bridge.is_tensor)[0]
        if len(fresh) != len(self.out_buffers):
            raise RuntimeError(f"simulated replay produced {len(fresh)} tensors where the capture produced "
                               f"{len(self.out_buffers)}")
        copy_, same = self.bridge.copy_detached, self.bridge.same_memory
        for dst, src in zip(self.out_buffers, fresh):
            if not same(dst, src):  # an output that is (a view of) an input: a copy would bump its version
                copy_(dst, src)
        self.live = [o for o, d in zip(fresh, self.differentiable) if d]

    def reset(self) -> None:
        self.run, self.out_buffers, self.live = None, [], []


class HostStepBackward:
    """replay() takes autograd.grad of the forward's latest outputs into the static gradient buffers."""

    def __init__(self, bridge, forward: HostStepForward, inputs, grad_out_buffers, used=None):
        self.bridge = bridge
        self.forward = forward
        self.inputs = inputs
        self.grad_out_buffers = grad_out_buffers
        self.used = used  # the outputs it differentiates (None: all)
        self.grad_buffers: List[Any] = []

    def capture_begin(self) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def keep(self, grads) -> None:
        self.grad_buffers = grads

    def replay(self) -> None:
        self.bridge.check_nested_grad()
        outs, grad_outs = self.forward.live, self.grad_out_buffers
        if self.used is not None:
            outs = [o for o, u in zip(outs, self.used) if u]
            grad_outs = [b for b, u in zip(grad_outs, self.used) if u]
        with self.bridge.leaf_hooks_off(self.inputs):
            fresh = self.bridge.grad(outs, self.inputs, grad_outs, retain_graph=True)
        copy_ = self.bridge.copy_detached
        for dst, src in zip(self.grad_buffers, fresh):
            if dst is not None:
                copy_(dst, src)

    def reset(self) -> None:
        self.forward = None
        self.inputs = self.grad_out_buffers = self.grad_buffers = []
