"""The capture of one key of a graphed block: the module's state kept as the capture found it (buffers,
parameters the forward writes, gradients, random state), the forward and backward recorded
(graphs.py), and what a failed capture leaves: the key runs eagerly, with one warning per kind."""
from __future__ import annotations

import logging
import time
from typing import Optional

from .. import guards
from ..backends import patches
from ..capture.capture_phase import paused_gc
from ..capture.failures import describe
from ..errors import CaptureError, TraceLimitReached
from ..recorders.host_graphs import graphs_for
from ..watch.fallbacks import Reason
from ..watch.held_state import HeldState
from .graphs import KeyState, StepGraphs, _capture_key

logger = logging.getLogger("graph_opt")


class KeyCapturer:
    """A block's captures (the block holds one; its pool, memory and counters stay the block's)."""

    def __init__(self, block):
        self.block = block

    def capture(self, state: KeyState, leaves, spec, args, kwargs, needs_grad: bool) -> Optional[StepGraphs]:
        block = self.block
        bridge, adapter = block.bridge, block.adapter
        recorder = graphs_for(adapter)
        if block.lent:  # a leaf still holding a lent buffer keeps a copy: the capture may reuse the memory
            block.reclaim()
        buffers = None
        if block.watch is not None and block.watch.armed and block.watch.moved():
            # Changed since the graphs of other keys were captured: theirs are as stale as a replay would be.
            # Before any capture (a buffer the forward registers at its first call) nothing is stale.
            run = state.run
            block.recapture(quiet=not block.holds_graphs())
            state.run = run  # this key's outputs were counted at its first call, after the change
        held = None
        if block.module is not None:  # what the graphs will read: parameters as they are now
            block.lazy = False
            block.params = bridge.trainable_parameters(block.module)
            block.watch.arm()
            # Tensors the module holds in other attributes (a count of rows seen, a cache object's): the
            # capture's runs must not advance them.
            held = HeldState(adapter, block.module, [], adapter.framework_attributes | {"forward"})  # this block
            with adapter.no_grad():  # not parameters of modules held unregistered: the optimizer's to write
                kept = [(t, adapter.clone(t)) for _, t in held.tensors if not bridge.requires_grad(t)]
            buffers = bridge.snapshot_buffers(block.module) + block.watch.written_parameters() + kept
        watch = block.watch
        before = watch.before_run() if watch is not None else None
        targets = [t for t in leaves if bridge.requires_grad(t)] + block.params
        grads_before = bridge.snapshot_grads(targets)
        rng = bridge.rng_state(block.module)
        start = time.perf_counter()
        mem_before = recorder.memory_in_use()
        try:
            if block.pool is None:
                block.pool = recorder.new_pool()
            with guards.state_lock, paused_gc(collect=False), guards.capture_custom_allreduce(), adapter.capture_stream():
                graphs = _capture_key(block, recorder, state, leaves, spec, needs_grad, rng, (args, kwargs))
            advanced = held.advanced() if held is not None else None
            if advanced:
                held.put_back_values()  # the eager call that answers instead sets them once
                if state.warmups or state.retried:
                    raise CaptureError(_ADVANCES.format(", ".join(advanced[:3])))
                # warmup_steps=0: the capture was this key's first run, and what it sets once (a flag, the
                # key's own `self.rows`) is the forward's own; this call runs eagerly, the next captures
                state.retried = True
                graphs.release()
                bridge.set_rng_state(rng)
                graphs = None
        except Exception as exc:  # noqa: BLE001 - any failure leaves the key eager, with one warning
            bridge.set_rng_state(rng)
            self.failed(state, exc)
            return None
        finally:
            bridge.restore_grads(grads_before)
            if buffers is not None:
                # The capture ran the forward (a private warmup, or the stand-in's capture): its in-place
                # updates of buffers (batch norm's running stats) are undone; the replay that follows
                # makes this call's.
                # Only those it changed: putting back the same values would still move their version
                # counters, and an eager call earlier in this step that saved one for its backward
                # (a frozen weight of a tower applied twice) would refuse its backward.
                same = adapter.same_values
                bridge.restore_buffers([(t, saved) for t, saved in buffers if not same(t, saved)])
        if graphs is None:
            block.counters.warmups += 1
            return None
        recorder.after_capture(bridge, rng)
        after = recorder.memory_in_use()
        if mem_before is not None and after is not None:
            block.memory_bytes = (block.memory_bytes or 0) + max(0, after - mem_before)
        if watch is not None:  # what the capture's forward wrote is the forward's own
            watch.after_run(before)
            state.attrs = watch.attributes_now()
        state.graphs = graphs
        patches.depend(block)  # its replays rely on the change counters (backends/patches.py)
        block.counters.captures += 1
        block.counters.capture_seconds += time.perf_counter() - start
        return graphs

    def failed(self, state: KeyState, exc: BaseException) -> None:
        block = self.block
        block.adapter.after_failed_capture()  # the CUDA generators must leave capture mode
        # The failed graph gave its hold on the pool back: with no graph of another key holding it, torch
        # has retired the pool, and a capture into it would fail an internal assert. The next one takes a
        # pool of its own.
        block.pool = None
        if isinstance(exc, TraceLimitReached):
            block.levels.untraced(state, str(exc))  # the next call captures from the eager forward
            return
        if block.levels.after_failure(state, exc):
            return
        why = describe(exc, traced=state.level > 0)
        state.failed = why
        block.disabled_reason = why
        block.counters.capture_failures += 1
        block.counters.fallbacks += 1
        reasons = block.counters.fallback_reasons
        reasons[Reason.CAPTURE_FAILED] = reasons.get(Reason.CAPTURE_FAILED, 0) + 1
        kind = ("capture_failed", why.split(" (")[0])  # once per kind: each key of a forward that counts fails so
        log = logger.info if kind in block.warned else logger.warning
        block.warned.add(kind)
        log("%s: capture failed, this key runs eagerly: %s", block.name, why)


_ADVANCES = ("the forward sets Python state as it runs ({}), as `self.t += 1` or a list appended to do; a replay "
             "runs no Python, so it would neither set it nor compute with the new value. Keep such a value in a "
             "tensor the forward updates in place (a buffer: self.t.add_(1)), or set it outside the block")
