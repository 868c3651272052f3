"""The capture phase: warmups, capture and checks of one padded size, and what a failed capture does.

CapturePhase, mixed into GraphRunner (runner.py), copies a size's inputs into the static buffers, runs
the strategy's warmups and capture inside _capture_phase (SOT/Dynamo translate there, on the capture
branch of is_capturing()), records what the forward writes in place, and hands the size to
capture_checks. A capture that fails drops every graph: the model runs without them from then on.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any, List, Optional, Tuple

from . import capture_checks, guards, output_layout, output_sharing, ranks, static_address
from .arguments import entry_host_values
from .captured_size import Captured, CapturedSize, overlaps, returned_inputs
from .errors import CaptureError, GraphOptInputError
from .failures import describe
from .fallbacks import Fallback, Reason
from .host_graphs import graphs_for
from .host_outputs import SizeCopies
from .padding import Padding
from .pytree import flatten, holding_tensors_message, objects_holding_tensors, unflatten
from .signature import Signature, _opaque_message, mapping_note
from .static_address import same_memory

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


class CapturePhase:
    """Mixed into GraphRunner: capture a size, on demand (lazily) or for capture_model."""

    _mapping_warned = False  # a non-dict mapping among make_inputs' arguments was reported once

    def capture(self, args, kwargs, size: int) -> CapturedSize:
        """Capture `size` for the call structure of (args, kwargs); inputs must have `size` rows."""
        sig, leaves = self.check_capture_inputs(args, kwargs, size)
        entry = self.capture_checked(sig, leaves, size)
        self.finish_captures()
        return entry

    def check_capture_inputs(self, args, kwargs, size: int):
        """(signature, tensor leaves) for capturing `size` from these inputs; GraphOptInputError (or
        GraphOptConfigError for dynamic_arg_dims) when they cannot be captured. Changes nothing then."""
        args, kwargs = self.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), self._is_tensor)
        sig = self.signatures.get(spec)
        new = sig is None
        if new:
            opaque = self._opaque_arguments(spec) if self.config.graph_opt_level == 0 else []
            if opaque:  # level >= 1: capture_model captures with them, under the framework's guards
                raise GraphOptInputError(f"{self.name}: make_inputs({size}) returned {_opaque_message(opaque)}")
            sig = self._new_signature(spec, leaves, args, kwargs)
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
        misfit = self._misfit(sig, leaves, f"make_inputs({size}): argument", size)
        if misfit is not None:
            reason = misfit[1]
            if misfit[0] in ("rank", "dtype", "shape") and sig.entries:
                reason += ", as make_inputs gave it for the sizes captured before (every size must agree)"
        elif sig.batch_size(self.adapter, leaves) != size:
            reason = f"make_inputs({size}) returned inputs where {self._disagreement(sig, leaves)}"
        if reason is not None:
            if new:
                del self.signatures[spec]
            raise GraphOptInputError(f"{self.name}: {reason}")
        return sig, leaves

    def capture_checked(self, sig: Signature, leaves, size: int) -> CapturedSize:
        return sig.entries.get(size) or self._capture_size(sig, size, leaves)

    def _capture_lazily(self, sig: Signature, padded: int, real: int, leaves) -> Optional[CapturedSize]:
        if not self.config.cudagraph_copy_inputs and real != padded:
            return None  # the caller's buffers must hold the padded rows; nothing can be captured from them
        logger.info("%s: capturing padded size %d lazily (first seen at call time)", self.name, padded)
        # The check after the capture replays the new size, which writes the outputs every size shares
        # (output_sharing): an argument that is a view of an earlier call's output (x = m(x)[:n]) would
        # be overwritten before this call copies it in. Such arguments are kept and put back.
        kept = self._arguments_in_outputs(sig, leaves)
        # The capture runs the forward several times (warmups, the capture, its check): state it advances
        # (a step counter, a cache object's tensors) is put back, so that the call advances it once.
        adapter = self.adapter
        held = self.model_state.held_state()
        copies = [(t, adapter.clone(t)) for _, t in held.tensors]
        entry = None
        try:
            entry = self._capture_lazily_kept(sig, padded, leaves, kept)
        finally:
            rebound = held.rebound()
            for t, saved in copies:
                if not adapter.same_values(t, saved):
                    adapter.copy_(t, saved)
            # The Python values the runs set are put back where the call runs Python once after them
            # (the plain forward, or the translated code around the graphs); a level-0 replay runs none,
            # and a capture that set one per run failed (_advances_message).
            if entry is None or not self._replays_graphs_alone():
                held.put_back_values()
        if rebound and entry is not None and self._replays_graphs_alone():
            self._rebinding_captures += 1
            if self._rebinding_captures > 1:  # again: the forward binds anew at every call
                self.capture_failed(CaptureError(_rebinds_message(rebound)), padded)
                return None
            # Once: state made at the first call (transformers' StaticCache makes its tensors then). The
            # size is dropped; the plain forward answers and makes it, and a later call captures.
            logger.info("%s: size %d is captured at a later call: %s", self.name, padded, _rebinds_message(rebound))
            self._drop_size(sig, padded)
            self.counters.captures -= 1
            self.counters.lazy_captures -= 1
            return None
        return entry

    def _drop_size(self, sig: Signature, padded: int) -> None:
        entry = sig.entries.pop(padded, None)
        if entry is not None:
            static_address.restore(self.adapter, entry.restore)
            entry.release()
        sig.plans.clear()
        if not any(other.entries for other in self.signatures.values()):
            self.model_state.release()  # the next capture takes the model's state afresh, as the first did
            # No graph holds the pool now, but tensors allocated in it may live on: CUDA's allocator refuses
            # a capture into a pool whose graphs are all gone while it still has blocks.
            self.pool = None

    def _capture_lazily_kept(self, sig: Signature, padded: int, leaves, kept) -> Optional[CapturedSize]:
        error = None
        try:
            with paused_gc():
                entry = self._capture_size(sig, padded, leaves)
        except Exception as exc:  # the model must keep working: run without graphs from now on
            error = exc
        self.group = ranks.group_for(self.adapter)
        across_ranks = ranks.agree_on_capture(self.group, padded, error)
        if error is not None or across_ranks is not None:
            self.capture_failed(error, padded, across_ranks)
            return None
        pending = entry.pending_check
        if pending is not None and pending[1] is not None and sig.mutated:
            # The check replays on the call's own arguments: the ones the forward writes in place it
            # writes on copies, or the call's own replay would apply the write a second time.
            written = set(sig.mutated) - sig.in_place  # a marked one is read in place, and put back after
            entry.pending_check = ([self.adapter.clone(t) if i in written else t for i, t in enumerate(pending[0])],
                                   pending[1])
        try:
            self.finish_captures()
        finally:
            for leaf, saved in kept:
                self.adapter.copy_(leaf, saved)
        if self.disabled_reason is not None:  # its check failed the capture: the plain forward answers
            return None
        self.counters.lazy_captures += 1
        return entry

    def lazy_capture_refusal(self) -> Optional[Fallback]:
        """Why a size may not be captured at a call, or None: the model's state is too large to copy aside
        and put back after the capture's runs of the forward (_capture_lazily). Found again until it
        refuses (a cache may make its tensors at its first call), then kept."""
        if self._lazy_refusal is not None:
            return self._lazy_refusal
        held = self.model_state.held_state().tensors
        size = sum(self.adapter.nbytes(t) for _, t in held)
        if size <= capture_checks.STATE_BYTES:
            return None
        largest = max(held, key=lambda h: self.adapter.nbytes(h[1]))[0]
        self._lazy_refusal = Fallback(
            Reason.LAZY_STATE,
            f"a size that capture_model() did not capture is captured at a call only where the model's state "
            f"(its buffers and the tensors its modules hold: {size / 2**20:.0f} MiB here, the largest {largest}) "
            f"can be copied aside and put back ({capture_checks.STATE_BYTES >> 20} MiB at most): each of the "
            "capture's runs of the forward may advance it. Capture the sizes with capture_model(), and reset "
            "that state after it; this call runs without graphs")
        return self._lazy_refusal

    def _replays_graphs_alone(self) -> bool:
        """Level 0: a replay is the graphs alone, so a binding the forward makes is not made again. At
        level >= 1 the translated code around the graphs makes it (Dynamo's, SOT's stores)."""
        return self.strategy.traits.records_the_plain_forward

    def _arguments_in_outputs(self, sig: Signature, leaves) -> List[Tuple[Any, Any]]:
        """(argument, a copy of it) for each tensor argument whose memory overlaps an output of the
        signature's captured sizes."""
        adapter = self.adapter
        spans = [span for entry in sig.entries.values() for span in entry.output_extents(adapter)]
        return [(leaf, adapter.clone(leaf)) for leaf in leaves if overlaps(spans, adapter.extent(leaf))]

    def capture_failed(self, exc: Optional[BaseException], size: int, across_ranks: Optional[str] = None) -> None:
        """Drop every graph and run without them. across_ranks: why, when the ranks agreed on it
        (graph_opt.ranks); exc is then this rank's own error, or None where only a peer failed."""
        self.counters.capture_failures += 1
        self.adapter.after_failed_capture()
        self.disable(across_ranks or f"capture of size {size} failed: {describe(exc)}")
        logger.warning("%s: %s; running without graphs", self.name, self.disabled_reason)

    def _static_inputs(self, sig: Signature, padded: int, leaves) -> List[Any]:
        """The tensors a graph of size `padded` reads, holding `leaves` (their padding rows the pad values)."""
        adapter = self.adapter
        if not self.config.cudagraph_copy_inputs:
            return list(leaves)
        if sig.buffers is None:
            # Allocated once at the max size; every size reads a view of them, so the addresses a
            # graph captured stay valid for as long as the runner lives. A marked argument is its own.
            sig.buffers = [
                t if i in sig.in_place else
                adapter.zeros_like(t, d, self.max_size) if d is not None else adapter.zeros_like(t, None, 0)
                for i, (t, d) in enumerate(zip(leaves, sig.dims))
            ]
            values = [self.pad_values.get(name, 0) for name in self.owner_names(sig.spec)]
            sig.padding = Padding(adapter, sig.buffers, sig.dims, values)
        for i in sig.in_place:
            if leaves[i] is not sig.buffers[i] and not same_memory(adapter, leaves[i], sig.buffers[i]):
                raise GraphOptInputError(
                    f"{self.name}: the inputs for size {padded} pass another tensor as argument "
                    f"{self._leaf_names(sig.spec)[i]} than the sizes captured before, and it is marked with "
                    "mark_static_address: the graphs read the one tensor in place. Pass the same tensor for "
                    "every size")
        views = [b if d is None else adapter.narrow(b, d, padded) for b, d in zip(sig.buffers, sig.dims)]
        self._copy_in(sig, views, leaves, padded)
        return views

    def _copy_in(self, sig: Signature, views, leaves, padded: int) -> None:
        adapter = self.adapter
        real = padded
        for i, (dst, src, d) in enumerate(zip(views, leaves, sig.dims)):
            if d is None:
                if i not in sig.in_place:
                    adapter.copy_(dst, src)
            else:
                real = adapter.shape(src)[d]
                adapter.copy_(adapter.narrow(dst, d, real), src)
        static_address.restore(adapter, sig.restore_point)
        if sig.padding is not None:
            sig.padding.wrote(real)

    def _capture_size(self, sig: Signature, padded: int, leaves) -> CapturedSize:
        adapter = self.adapter
        static = self._static_inputs(sig, padded, leaves)
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
        adapter = self.adapter
        if self.config.graph_opt_level >= 1:
            self._check_no_decorated_submodule()
        if not self.config.cudagraph_copy_inputs:
            for t, d in zip(static, sig.dims):
                if d is not None and adapter.shape(t)[d] != padded:
                    raise CaptureError(
                        f"{self.name}: with cudagraph_copy_inputs=false the inputs used to capture size {padded} "
                        f"must have {padded} rows, got {adapter.shape(t)[d]}"
                    )
        args, kwargs = unflatten(sig.spec, static, template=sig.template)
        recorder = graphs_for(adapter)
        if self.pool is None and self.config.use_unique_memory_pool:
            self.pool = recorder.new_pool()
        first = not self.model_state.captured
        if first:
            self.model_state.snapshot()  # training flags and autocast, as every replay must find them
        mem_before = recorder.memory_in_use()
        start = time.perf_counter()
        host = self.host_outputs
        copies = None
        self.model_state.paused = True
        hooks_before = self.model_state.hook_count()
        try:
            with _capture_phase(adapter):
                versions = [adapter.version(t) for t in static]
                values = capture_checks.snapshot(adapter, static, sig.in_place)
                buffers = self.model_state.buffer_versions()
                buffer_values = capture_checks.buffer_snapshot(self)
                # What a replay would not make: checked over the captured run below, and over this size's
                # whole window once the forward ran with these arguments before (a first run's flag is its
                # own; a value set to another at every size, `self.rows = x.shape[0]`, would be stale)
                checks_state = self._replays_graphs_alone() or not adapter.static_makes_python_stores
                # per call structure: a flag set once at the first call of another (output_hidden_states=True
                # installs transformers' output hooks) is no value that depends on the call
                window = self.model_state.held_state() if checks_state and sig.capture_windows else None
                sig.capture_windows += 1
                warm = None
                for _ in range(self.config.cudagraph_num_of_warmups):
                    warm = self.strategy.warmup(args, kwargs, padded, sig)
                mutated = {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
                mutated |= capture_checks.changed(adapter, static, values)
                del values
                sig.static_buffer_writes |= capture_checks.written(buffers, self.model_state.buffer_versions())
                sig.static_buffer_writes |= capture_checks.buffers_changed(self, buffer_values)
                del buffer_values
                # Before the capture, so that the first size already knows its outputs' batch dims
                # (output sharing and host_outputs rings use them), and on the capture's branch.
                expected = capture_checks.expect(self, sig, static, leaves, padded, warm)
                self._copy_in(sig, static, leaves, padded)
                versions = [adapter.version(t) for t in static]
                buffers = self.model_state.buffer_versions()
                # What the captured run binds or sets, which a level-0 replay (the graphs alone) would not
                # make again, nor a level-1 replay through Paddle's SOT (found so: its capture's check
                # then failed, blaming the numbers)
                bindings = self.model_state.held_state() if checks_state else None
                folds = self.strategy.traits.folds_tail
                if folds:
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
                mutated |= {i for i, (t, v) in enumerate(zip(static, versions)) if adapter.version(t) != v}
                sig.static_buffer_writes |= capture_checks.written(buffers, self.model_state.buffer_versions())
                if bindings is not None:
                    rebound = bindings.rebound()
                    if rebound:
                        raise CaptureError(_rebinds_message(rebound))
                    advanced = bindings.advanced()
                    if advanced:
                        raise CaptureError(_advances_message(advanced))
                    per_size = window.advanced() if window is not None else None
                    if per_size:
                        raise CaptureError(_per_size_message(per_size, padded))
                adapter.synchronize()
                held = objects_holding_tensors(captured.outputs, adapter.is_tensor)
                if held:
                    raise CaptureError(holding_tensors_message(held, "call"))
                sig.observe(output_layout.observe(adapter, captured.outputs, padded))
                sig.watch_feedback(adapter, captured.outputs)
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
        mem_after = None if mem_before is None else adapter.memory_in_use()
        memory = None if mem_before is None or mem_after is None else max(0, mem_after - mem_before)
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
            handed=self.handed,
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
        """Check each size captured since the last call against eager (capture_checks.validate)."""
        for sig in list(self.signatures.values()):
            for entry in list(sig.entries.values()):
                pending, entry.pending_check = entry.pending_check, None
                kept, entry.restore = entry.restore, []
                try:
                    if pending is not None and self.disabled_reason is None:  # a check may fail the capture
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
        dropped_buffers = set() if self._replays_graphs_alone() else sig.eager_buffer_writes - sig.static_buffer_writes
        if not dropped and not dropped_buffers:
            return
        what = [f"its argument {self._leaf_names(sig.spec)[i]}" for i in sorted(dropped)]
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


def _advances_message(advanced: List[str]) -> str:
    return (f"forward sets Python state as it runs ({', '.join(advanced[:3])}), as `self.t += 1` or a "
            "list appended to do; a replay of the graphs would neither set it nor compute with the new value. "
            "Keep such a value in a tensor the forward updates in place (a buffer: self.t.add_(1)), or set it "
            "outside the forward (torch: graph_opt_level 1, whose translated code makes the store)")


def _per_size_message(changed: List[str], padded: int) -> str:
    return (f"forward sets Python state to a value that depends on the call ({', '.join(changed[:3])}, at size "
            f"{padded}), as `self.rows = x.shape[0]` does; a replay would leave the value of another call. Keep "
            "such a value in a tensor the forward updates in place, or compute it outside the forward")


def _rebinds_message(rebound: List[str]) -> str:
    return (f"forward binds new tensors where its state was ({', '.join(rebound[:3])}), as "
            "`self.cache = torch.zeros(...)` made at the first call or `st.steps = st.steps + 1` do; a replay "
            "cannot, so it would not leave that state as eager does. Write the state in place (copy_, add_, "
            "index_copy_), make it before the first call, or capture_model() once it exists")


def _mapping_hint(args, kwargs) -> str:
    """Where an argument is a mapping that is not a dict (a tokenizer's BatchEncoding is a UserDict):
    graph_opt does not look inside it, so its tensors are not seen."""
    for value in list(args) + list(kwargs.values()):
        note = mapping_note(value)
        if note:
            return f"; an argument is a {type(value).__name__}{note}"
    return ""
