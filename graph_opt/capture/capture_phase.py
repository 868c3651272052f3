"""The capture phase: warmups, capture and checks of one padded size, and what a failed capture does.

Capturer, held by GraphRunner (runner.py), copies a size's inputs into the static buffers, runs
the strategy's warmups and capture inside _capture_phase (SOT/Dynamo translate there, on the capture
branch of is_capturing()), records what the forward writes in place, and hands the size to
capture_checks. A capture that fails drops every graph: the model runs without them from then on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import List, Optional

from . import capture_checks, failures, writes
from .. import guards
from ..replay import output_layout, output_sharing, static_address, static_inputs
from ..watch.arguments import entry_host_values
from ..replay.captured_size import Captured, CapturedSize, returned_inputs
from ..errors import CaptureError, GraphOptInputError
from .failures import describe
from ..recorders.host_graphs import graphs_for
from ..replay.host_outputs import SizeCopies
from ..pytree import flatten, holding_tensors_message, objects_holding_tensors, unflatten
from ..replay.signature import Signature, _opaque_message, mapping_note

logger = logging.getLogger("graph_opt")


@contextlib.contextmanager
def paused_gc(collect: bool = True):
    """Collect once, then keep the collector out of the capture phase.

    A collection during capture is slow (it walks every object); the one before frees what is already
    garbage, so that the captures start from the memory the model really holds. collect=False skips it
    (a capture in the middle of training, where one costs about 0.1 s of a large heap and frees little).

    The heap is not frozen: a process that froze its own (gc.freeze() after start-up, as servers do to
    keep collections short) keeps its freeze, even one made by another thread while this capture runs
    (torch's own gc.collect() calls are no-ops in the capture phase: the adapter's capture_stream).
    """
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _capture_phase(adapter):
    """Warmups and capture of one size: SOT/Dynamo translate here, on the capture branch of is_capturing().
    One size at a time in the process (guards.state_lock): the flags it sets are process-wide."""
    with guards.state_lock, guards.sot_warmup_guard(True), guards.capture_custom_allreduce(), adapter.no_grad(), \
            adapter.capture_stream(), guards.this_thread_captures():
        yield


class Capturer:
    """A runner's captures: a size on demand (at a call) or for capture_model, in named steps, and the
    state only captures keep (the memory pool, what they took and found)."""

    def __init__(self, runner):
        self.runner = runner  # what fails with a capture (disable), and what it reads of the dispatch
        self.adapter = runner.adapter
        self.config = runner.config
        self.name = runner.name
        self.signatures = runner.signatures
        self.model_state = runner.model_state
        self.counters = runner.counters
        self.host_outputs = runner.host_outputs  # HostOutputs whose copies captured sizes make in their graphs
        self.pool = None
        self.capture_notes: List[str] = []  # what capture_checks found, for the capture report
        self.capture_seconds = 0.0
        self.memory_bytes: Optional[int] = None
        self.python_stores_seen = False  # a check's run set a Python value otherwise than the capture's
        self._mapping_warned = False  # a non-dict mapping among make_inputs' arguments was reported once

    @property
    def strategy(self):
        return self.runner.strategy

    @property
    def eager(self):
        return self.runner.eager

    @property
    def table(self):
        return self.runner.table

    def release(self) -> None:
        self.pool = None
        self.memory_bytes = None

    def capture(self, args, kwargs, size: int) -> CapturedSize:
        """Capture `size` for the call structure of (args, kwargs); inputs must have `size` rows."""
        sig, leaves = self.check_capture_inputs(args, kwargs, size)
        entry = self.capture_checked(sig, leaves, size)
        self.finish_captures()
        return entry

    def check_capture_inputs(self, args, kwargs, size: int):
        """(signature, tensor leaves) for capturing `size` from these inputs; GraphOptInputError (or
        GraphOptConfigError for dynamic_arg_dims) when they cannot be captured. Changes nothing then."""
        args, kwargs = self.signatures.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), self.adapter.is_tensor)
        sig = self.signatures.get(spec)
        new = sig is None
        if new:
            opaque = self.signatures.opaque_arguments(spec) if self.config.graph_opt_level == 0 else []
            if opaque:  # level >= 1: capture_model captures with them, under the framework's guards
                raise GraphOptInputError(f"{self.name}: make_inputs({size}) returned {_opaque_message(opaque)}")
            sig = self.signatures.make(spec, leaves, args, kwargs)
            hint = _mapping_hint(args, kwargs) if sig is not None else ""
            if hint and not self._mapping_warned:
                # It is captured (the framework's guards see what the forward reads from it), but a call
                # replays only with this very object: another one is another call structure.
                self._mapping_warned = True
                logger.warning("%s: make_inputs(%d): %s; as it is, a call replays only when given the very "
                               "object make_inputs returned", self.name, size, hint[2:])
        if sig is None:
            raise GraphOptInputError(
                f"{self.name}: make_inputs({size}) returned no tensor with a batch dimension; it must return the "
                f"forward's tensors with {size} rows (dim 0 of every tensor argument, or the dims named by "
                "dynamic_arg_dims={'arg': dim} on @support_graph_optimization)" + _mapping_hint(args, kwargs)
            )
        reason = None
        misfit = self.signatures.misfit(sig, leaves, f"make_inputs({size}): argument", size)
        if misfit is not None:
            reason = misfit[1]
            if misfit[0] in ("device", "rank", "dtype", "shape") and sig.entries:
                reason += ", as make_inputs gave it for the sizes captured before (every size must agree)"
        elif sig.batch_size(self.adapter, leaves) != size:
            reason = f"make_inputs({size}) returned inputs where {self.signatures.disagreement(sig, leaves)}"
        if reason is not None:
            if new:
                del self.signatures[spec]
            raise GraphOptInputError(f"{self.name}: {reason}")
        return sig, leaves

    def capture_checked(self, sig: Signature, leaves, size: int) -> CapturedSize:
        return sig.entries.get(size) or self.capture_size(sig, size, leaves)

    def replays_graphs_alone(self) -> bool:
        """Level 0: a replay is the graphs alone, so a binding the forward makes is not made again. At
        level >= 1 the translated code around the graphs makes it (Dynamo's, SOT's stores)."""
        return self.strategy.traits.records_the_plain_forward

    def capture_failed(self, exc: Optional[BaseException], size: int, across_ranks: Optional[str] = None) -> None:
        """Drop every graph and run without them. across_ranks: why, when the ranks agreed on it
        (graph_opt.capture.ranks); exc is then this rank's own error, or None where only a peer failed."""
        self.counters.capture_failures += 1
        self.adapter.after_failed_capture()
        takeover = self.runner.on_capture_failure
        if takeover is not None and exc is not None and across_ranks is None and takeover(self.runner, exc, size):
            return  # the model runs at another level now, with a runner of its own
        self.runner.disable(across_ranks or f"capture of size {size} failed: {describe(exc, traced=self.config.graph_opt_level >= 1)}")
        logger.warning("%s: %s; running without graphs", self.name, self.runner.disabled_reason)

    def capture_size(self, sig: Signature, padded: int, leaves) -> CapturedSize:
        adapter = self.adapter
        static = static_inputs.prepare(self, sig, padded, leaves)
        # The warmups, the capture and its check run the forward on a marked argument itself. Each run
        # starts from its contents before the capture (_copy_in puts them back, as it copies the other
        # inputs in), and they are put back after the capture and after its check (finish_captures), as
        # if the capture had not run. Every marked one is saved: a write the version counters do not see
        # (a kernel of its own, .data) or one at some sizes only must not reach the caller either.
        kept = static_address.saved(adapter, static, sig.in_place)
        sig.restore_point = kept
        try:
            entry = self._capture_static(sig, padded, leaves, static)
        finally:
            sig.restore_point = []
            static_address.restore(adapter, kept)
        entry.restore = kept
        return entry

    def _capture_static(self, sig: Signature, padded: int, leaves, static) -> CapturedSize:
        """One size, in order: checks before, the warmups, the capture, the checks of what the captured
        run did, and the entry a replay uses."""
        self._check_capturable(sig, padded, static)
        args, kwargs = unflatten(sig.spec, static, template=sig.template)
        recorder = graphs_for(self.adapter)
        if self.pool is None and self.config.use_unique_memory_pool:
            self.pool = recorder.new_pool()
        first = not self.model_state.captured
        if first:
            self.model_state.snapshot()  # training flags and autocast, as every replay must find them
        mem_before = recorder.memory_in_use()
        start = time.perf_counter()
        self.model_state.paused = True
        hooks_before = self.model_state.hook_count()
        try:
            with _capture_phase(self.adapter):
                warm, mutated, expected, window = self._warm_up(sig, padded, leaves, static, args, kwargs)
                captured, copies, written = self._record(sig, padded, leaves, static, args, kwargs, warm, window,
                                                         recorder)
                mutated |= written
        finally:
            self.model_state.paused = False
        # no graph was captured without them
        if first and self.model_state.hook_count() != hooks_before and self.model_state.settle_hooks():
            logger.info("%s: the forward registered or removed hooks while size %d was captured; the graphs ran "
                        "them, and replays expect them as they are now", self.name, padded)
        if mutated:
            sig.mutated = sorted(set(sig.mutated) | mutated)
        self._check_writes_kept(sig)
        if sig.padding is not None:
            sig.padding.touched(padded)
        capture_ms = (time.perf_counter() - start) * 1e3
        mem_after = None if mem_before is None else self.adapter.memory_in_use()
        memory = None if mem_before is None or mem_after is None else max(0, mem_after - mem_before)
        return self._new_entry(sig, padded, leaves, static, captured, copies, expected, capture_ms, memory)

    def _check_capturable(self, sig: Signature, padded: int, static) -> None:
        if self.config.graph_opt_level >= 1:
            self._check_no_decorated_submodule()
        if not self.config.cudagraph_copy_inputs:
            for t, d in zip(static, sig.dims):
                if d is not None and self.adapter.shape(t)[d] != padded:
                    raise CaptureError(
                        f"{self.name}: with cudagraph_copy_inputs=false the inputs used to capture size {padded} "
                        f"must have {padded} rows, got {self.adapter.shape(t)[d]}"
                    )

    def _warm_up(self, sig: Signature, padded: int, leaves, static, args, kwargs):
        """The warmups (SOT and Dynamo translate in the first): (the last one's outputs, the arguments they
        wrote in place, the outputs eager gives for the check after capture, the held state to compare
        over this size's whole window, or None)."""
        adapter = self.adapter
        state = self.model_state
        versions = [adapter.version(t) for t in static]
        values = writes.snapshot(adapter, static, sig.in_place)
        buffers = state.buffer_versions()
        buffer_values = writes.buffer_snapshot(self)
        # What a replay would not make: checked over the captured run (_record), and over this size's
        # whole window once the forward ran with these arguments before (a first run's flag is its
        # own; a value set to another at every size, `self.rows = x.shape[0]`, would be stale)
        # per call structure: a flag set once at the first call of another (output_hidden_states=True
        # installs transformers' output hooks) is no value that depends on the call
        window = state.held_state() if self._checks_state() and sig.capture_windows else None
        sig.capture_windows += 1
        warm = None
        for _ in range(self.config.cudagraph_num_of_warmups):
            warm = self.strategy.warmup(args, kwargs, padded, sig)
        mutated = {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
        mutated |= writes.changed(adapter, static, values)
        sig.static_buffer_writes |= writes.written(buffers, state.buffer_versions())
        sig.static_buffer_writes |= writes.buffers_changed(self, buffer_values)
        # Before the capture, so that the first size already knows its outputs' batch dims
        # (output sharing and host_outputs rings use them), and on the capture's branch.
        expected = capture_checks.expect(self, sig, static, leaves, padded, warm)
        static_inputs.copy_in(self.adapter, sig, static, leaves, padded)
        return warm, mutated, expected, window

    def _checks_state(self) -> bool:
        """Whether a replay would not make the Python stores the forward makes: level 0 (the graphs alone),
        and a level-1 replay through Paddle's SOT (found so: its capture's check then failed, blaming the
        numbers)."""
        return self.replays_graphs_alone() or not self.adapter.static_makes_python_stores

    def _record(self, sig: Signature, padded: int, leaves, static, args, kwargs, warm, window, recorder):
        """The capture: (what the strategy handed back, the size's host copies or None, the arguments the
        captured run wrote in place). Fails where the captured run bound or set what a replay would not."""
        adapter = self.adapter
        state = self.model_state
        host = self.host_outputs
        copies = None
        versions = [adapter.version(t) for t in static]
        buffers = state.buffer_versions()
        bindings = state.held_state() if self._checks_state() else None
        if self.strategy.traits.folds_tail:
            # The output copies into a larger size's storage and the host copies become the last
            # nodes of the forward's own graph: one launch per step.
            if host is not None and warm is not None:
                copies = host.copies_for_size(adapter, warm, padded, self._batch_dims(sig, warm, padded))
            captured = self.strategy.capture(args, kwargs, padded, sig, self.pool,
                                             tail=copies.tail if copies is not None else None,
                                             share=output_sharing.for_size(adapter, sig, padded, static))
        else:
            captured = self.strategy.capture(args, kwargs, padded, sig, self.pool)
            if host is not None and captured.stable_outputs:
                copies = host.copies_for_size(adapter, captured.outputs, padded,
                                              self._batch_dims(sig, captured.outputs, padded))
                if copies is not None:
                    self._capture_tail(captured, copies, recorder)
        written = {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
        sig.static_buffer_writes |= writes.written(buffers, state.buffer_versions())
        if bindings is not None:
            rebound = bindings.rebound()
            if rebound:
                raise CaptureError(failures.rebinds_message(rebound))
            advanced = bindings.advanced()
            if advanced:
                raise CaptureError(failures.advances_message(advanced))
            per_size = window.advanced() if window is not None else None
            if per_size:
                raise CaptureError(failures.per_size_message(per_size, padded))
        adapter.synchronize()
        held = objects_holding_tensors(captured.outputs, adapter.is_tensor)
        if held:
            raise CaptureError(holding_tensors_message(held, "call"))
        sig.observe(output_layout.observe(adapter, captured.outputs, padded))
        sig.watch_feedback(adapter, captured.outputs)
        return captured, copies, written

    def _new_entry(self, sig: Signature, padded: int, leaves, static, captured: Captured, copies, expected,
                   capture_ms: float, memory: Optional[int]) -> CapturedSize:
        """What a replay of the size uses, kept in its signature; its check waits for finish_captures()."""
        adapter = self.adapter
        entry = CapturedSize(
            padded_size=padded,
            sig=sig,
            inputs=static,
            dims=sig.dims,
            copy_inputs=self.config.cudagraph_copy_inputs,
            input_ptrs=[adapter.data_ptr(t) for t in static],
            captured=captured,
            capture_ms=capture_ms,
            memory_bytes=memory,
            copies=copies,
            handed=self.runner.handed,
        )
        if entry.copy_inputs and copies is None:
            entry.returned_inputs = returned_inputs(adapter, captured.outputs, static)
        if self.config.graph_opt_level == 0:
            entry.host_values = entry_host_values(adapter, leaves, static, captured.split_reads)
        sig.entries[padded] = entry
        sig.plans.clear()  # a new size may have changed what the plans resolved (mutated inputs)
        # Checked by finish_captures(), once the ranks agreed that every one captured this size: the
        # check replays, and with several ranks a replay's collectives need every rank.
        entry.pending_check = (leaves, expected)
        self.counters.captures += 1
        self.capture_seconds += capture_ms / 1e3
        if memory is not None:
            self.memory_bytes = (self.memory_bytes or 0) + memory
        return entry

    def _check_no_decorated_submodule(self) -> None:
        """Level >= 1 traces forward as the framework's graph, which cannot trace into another decorated
        model's call (its lock, its replays): say so, not the tracer's message from inside graph_opt."""
        nested = self.model_state.decorated_submodules()
        if nested:
            raise CaptureError(
                f"{self.name}.{nested[0]} is itself a model decorated with @support_graph_optimization: at "
                f"graph_opt_level={self.config.graph_opt_level} the outer forward is traced by the framework's "
                "translator, which cannot trace into another decorated model's call. Decorate only one of them "
                "(the outer one captures the inner one's work too), or use graph_opt_level=0 for the outer one")

    def finish_captures(self) -> None:
        """Check each size captured since the last call against eager (capture_checks.validate), one check at
        a time in the process: another thread's capture must not run meanwhile (CUDA refuses a check's
        synchronizations while a stream captures)."""
        with guards.state_lock:
            self._finish_captures()

    def _finish_captures(self) -> None:
        for sig in list(self.signatures.values()):
            for entry in list(sig.entries.values()):
                pending, entry.pending_check = entry.pending_check, None
                kept, entry.restore = entry.restore, []
                try:
                    if pending is not None and self.runner.disabled_reason is None:  # a check may fail the capture
                        capture_checks.validate(self, sig, entry, *pending)
                finally:
                    static_address.restore(self.adapter, kept)

    def _batch_dims(self, sig: Signature, outputs, padded: int) -> list:
        """Each output leaf's batch dimension: learned (output_layout), or before that, dim 0 where it
        has the padded size (the first size of a forward the probes could not run)."""
        if sig.layout.known:
            return sig.layout.dims
        leaves = flatten(outputs, self.adapter.is_tensor)[0]
        return [0 if len(self.adapter.shape(t)) and self.adapter.shape(t)[0] == padded else None for t in leaves]

    def _check_writes_kept(self, sig: Signature) -> None:
        """CaptureError where the plain forward writes an argument or a buffer in place and the captured
        path does not (Paddle's SOT drops writes into its programs' inputs): replays would differ."""
        dropped = sig.eager_writes - set(sig.mutated)
        # A level-0 graph records the plain forward, which writes the buffers in place itself (a write the
        # eager run at another row count made, in a branch on the batch size, is that size's own).
        dropped_buffers = set() if self.replays_graphs_alone() else sig.eager_buffer_writes - sig.static_buffer_writes
        if not dropped and not dropped_buffers:
            return
        what = [f"its argument {self.signatures.leaf_names(sig.spec)[i]}" for i in sorted(dropped)]
        what += [f"the model's buffer {name!r}" for name in sorted(dropped_buffers)]
        path = self.strategy.traits.describe
        # A write the version counters do not show (Paddle's copy_ and set_value, torch's .data) is found in
        # the captured path by the values a warmup changed: without warmups only the plain forward's is seen.
        unseen = ("; with cudagraph_num_of_warmups=0 a write its version counter does not show (Paddle's copy_ "
                  "and set_value, torch's .data) is not seen in the captured path: if the forward writes that "
                  "way, set cudagraph_num_of_warmups to 1 or more") if self.config.cudagraph_num_of_warmups == 0 else ""
        raise CaptureError(
            f"forward writes {' and '.join(what)} in place, and at graph_opt_level={self.config.graph_opt_level} "
            f"{path} does not write it back: a replay (and this level without graphs) would differ from eager. "
            f"Use graph_opt_level=0 for this model, or return the new value instead of writing in place{unseen}")

    def _capture_tail(self, captured: Captured, copies: SizeCopies, recorder) -> None:
        """A strategy that cannot end its graph with the host copies: a small graph of them after it."""
        outputs = captured.outputs
        main = captured.replay
        diverged = captured.diverged
        tail, graphs = recorder.record(lambda: copies.tail(outputs), self.pool)
        captured.keepalive += graphs
        captured.graphs += len(graphs)

        def replay():
            fresh = main()
            if diverged is None or not diverged(fresh):
                tail()
            return fresh
        captured.replay = replay


def _mapping_hint(args, kwargs) -> str:
    """Where an argument is a mapping that is not a dict (a tokenizer's BatchEncoding is a UserDict):
    graph_opt does not look inside it, so its tensors are not seen."""
    for value in list(args) + list(kwargs.values()):
        note = mapping_note(value)
        if note:
            return f"; an argument is a {type(value).__name__}{note}"
    return ""
