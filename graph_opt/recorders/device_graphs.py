"""The device's graphs (DeviceGraphs): the adapter's CUDA graphs in its memory pools, with their memory
measured. One side of contracts.Recorder; host_graphs.HostGraphs is the other, and host_graphs.graphs_for
picks between them for each capture."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from ..pytree import flatten


class DeviceGraphs:
    """Graphs recorded by the device: work captured between capture_begin() and capture_end() runs
    again, without Python, at each replay()."""

    def __init__(self, adapter):
        self.adapter = adapter

    def available(self) -> bool:
        return self.adapter.graphs_supported()

    def new_pool(self):
        return self.adapter.new_pool()

    def memory_in_use(self):
        return self.adapter.memory_in_use()

    def release_memory(self) -> None:
        self.adapter.release_memory()

    # -- inference ---------------------------------------------------------------------------------
    def record(self, fn: Callable[[], None], pool):
        graph = self.adapter.new_graph(pool)
        graph.capture_begin()
        try:
            fn()
        finally:
            graph.capture_end()
        return graph.replay, [graph]

    def record_outputs(self, fn: Callable[[], Any], pool, share=None):
        graph = self.adapter.new_graph(pool)
        graph.capture_begin()
        try:
            outputs = fn()
            if share is not None:
                kept = share.redirect(outputs)
                share.copy(outputs, kept)
                outputs = kept  # this size's own output blocks are free once the capture ends
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            with contextlib.suppress(Exception):
                graph.reset()
            raise
        graph.capture_end()
        return outputs, graph

    def op_recorded(self, capture: Callable[[], Any], plain: Callable[[], Any]):
        """The op records its graph itself when told (Paddle's run_program with cuda_graph_state), and
        replays it when told so: a replay is the op's call with the replay state."""
        return capture(), _run, None

    def capture_eager(self, eager, args, kwargs, pool, tail=None, share=None):
        return eager.record_pieces(args, kwargs, pool, tail, share)

    # -- training: one key's forward and backward --------------------------------------------------
    def capturing_parameters(self, bridge, module, params):
        # The capture reads the parameters through fresh aliases: autograd keeps one gradient
        # accumulator per leaf, created on the stream of its first use, and one left from an eager step
        # (alive while that step's loss is) would make the captured backward wait on the caller's stream.
        return bridge.parameters_for_capture(module, params) if params else contextlib.nullcontext(params)

    def warm_up_step(self, bridge, forward, needs_grad: bool, grad_inputs, writes, rng) -> set:
        """One private run of forward and backward on the capture stream (libraries allocate workspaces
        on first use, which a capture must not do). Returns what `writes` finds the forward wrote."""
        mark = bridge.graph_mark() if needs_grad else None
        outs = forward()
        written = writes()
        if needs_grad:
            diff = [o for o in flatten(outs, bridge.is_tensor)[0] if bridge.requires_grad(o)]
            if diff:
                # The backward the capture will record, tensors read from outside the block included
                targets = grad_inputs + bridge.outside_tensors(diff, {id(t): t for t in grad_inputs}, mark)[0]
                with bridge.leaf_hooks_off(targets):
                    bridge.grad(diff, targets, [bridge.ones_like(o) for o in diff])
        del outs
        bridge.set_rng_state(rng)
        self.adapter.synchronize()
        return written

    def step_forward(self, bridge, forward, pool):
        return self.adapter.new_graph(pool)

    def captured_writes(self, writes: Callable[[], set]) -> set:
        return set()  # a capture records kernels without running them

    def step_backward(self, bridge, forward, inputs, grad_out_buffers, pool, used=None):
        return self.adapter.new_graph(pool)

    def keep(self, graph, *written) -> None:
        pass  # a replay writes where the capture's kernels wrote

    def kept_outputs(self, outputs):
        return outputs

    def partial_outputs(self, step):
        return step.kept_outs

    def weak_alias(self, t):
        # Outputs and gradients were allocated in the pool during capture. Holding them weakly lets the
        # next key's capture reuse those blocks (calls in one pool never overlap: training/slots.py), so
        # all keys together stay close to one key's memory.
        return self.adapter.weak_alias(t)

    def after_capture(self, bridge, rng) -> None:
        self.adapter.synchronize()


def _run(op: Callable[[], Any]) -> None:
    op()
