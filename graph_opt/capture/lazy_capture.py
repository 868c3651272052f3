"""Sizes captured at a call (lazily), not by capture_model: when one may be, and the capture made so
that the call sees the model as if only its own forward had run (state put back, arguments kept)."""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

from . import capture_checks, failures, ranks
from ..replay import static_address
from .capture_phase import paused_gc
from ..replay.captured_size import CapturedSize
from ..replay.static_address import overlaps
from ..errors import CaptureError
from ..watch.fallbacks import Fallback, Reason
from ..replay.signature import Signature

logger = logging.getLogger("graph_opt")


class CallCaptures:
    """A capturer's captures at calls, and what it found about them (kept until release)."""

    def __init__(self, capturer):
        self.capturer = capturer
        self._refusal: Optional[Fallback] = None  # refusal()'s verdict, once found
        self._rebinding = 0  # captures at calls dropped because the forward bound new state

    def release(self) -> None:
        self._refusal = None
        self._rebinding = 0

    def capture(self, sig: Signature, padded: int, real: int, leaves) -> Optional[CapturedSize]:
        if not self.capturer.config.cudagraph_copy_inputs and real != padded:
            return None  # the caller's buffers must hold the padded rows; nothing can be captured from them
        logger.info("%s: capturing padded size %d lazily (first seen at call time)", self.capturer.name, padded)
        # The check after the capture replays the new size, which writes the outputs every size shares
        # (output_sharing): an argument that is a view of an earlier call's output (x = m(x)[:n]) would
        # be overwritten before this call copies it in. Such arguments are kept and put back.
        kept = self._arguments_in_outputs(sig, leaves)
        # The capture runs the forward several times (warmups, the capture, its check): state it advances
        # (a step counter, a cache object's tensors) is put back, so that the call advances it once.
        adapter = self.capturer.adapter
        held = self.capturer.model_state.held_state()
        copies = [(t, adapter.clone(t)) for _, t in held.tensors]
        entry = None
        try:
            entry = self._capture_kept(sig, padded, leaves, kept)
        finally:
            rebound = held.rebound()
            for t, saved in copies:
                if not adapter.same_values(t, saved):
                    adapter.copy_(t, saved)
            # The Python values the runs set are put back where the call runs Python once after them
            # (the plain forward, or the translated code around the graphs); a level-0 replay runs none,
            # and a capture that set one per run failed (failures.advances_message).
            if entry is None or not self.capturer.replays_graphs_alone():
                held.put_back_values()
        if rebound and entry is not None and self.capturer.replays_graphs_alone():
            self._rebinding += 1
            if self._rebinding > 1:  # again: the forward binds anew at every call
                self.capturer.capture_failed(CaptureError(failures.rebinds_message(rebound)), padded)
                return None
            # Once: state made at the first call (transformers' StaticCache makes its tensors then). The
            # size is dropped; the plain forward answers and makes it, and a later call captures.
            logger.info("%s: size %d is captured at a later call: %s", self.capturer.name, padded, failures.rebinds_message(rebound))
            self._drop_size(sig, padded)
            self.capturer.counters.captures -= 1
            self.capturer.counters.lazy_captures -= 1
            return None
        return entry

    def _drop_size(self, sig: Signature, padded: int) -> None:
        entry = sig.entries.pop(padded, None)
        if entry is not None:
            static_address.restore(self.capturer.adapter, entry.restore)
            entry.release()
        sig.plans.clear()
        if not any(other.entries for other in self.capturer.signatures.values()):
            self.capturer.model_state.release()  # the next capture takes the model's state afresh, as the first did
            # No graph holds the pool now, but tensors allocated in it may live on: CUDA's allocator refuses
            # a capture into a pool whose graphs are all gone while it still has blocks.
            self.capturer.pool = None

    def _capture_kept(self, sig: Signature, padded: int, leaves, kept) -> Optional[CapturedSize]:
        error = None
        try:
            with paused_gc():
                entry = self.capturer.capture_size(sig, padded, leaves)
        except Exception as exc:  # the model must keep working: run without graphs from now on
            error = exc
        self.capturer.runner.group = ranks.group_for(self.capturer.adapter)
        across_ranks = ranks.agree_on_capture(self.capturer.runner.group, padded, error)
        if error is not None or across_ranks is not None:
            self.capturer.capture_failed(error, padded, across_ranks)
            return None
        pending = entry.pending_check
        if pending is not None and pending[1] is not None and sig.mutated:
            # The check replays on the call's own arguments: the ones the forward writes in place it
            # writes on copies, or the call's own replay would apply the write a second time.
            written = set(sig.mutated) - sig.in_place  # a marked one is read in place, and put back after
            entry.pending_check = ([self.capturer.adapter.clone(t) if i in written else t for i, t in enumerate(pending[0])],
                                   pending[1])
        try:
            self.capturer.finish_captures()
        finally:
            for leaf, saved in kept:
                self.capturer.adapter.copy_(leaf, saved)
        if self.capturer.runner.disabled_reason is not None:  # its check failed the capture: the plain forward answers
            return None
        self.capturer.counters.lazy_captures += 1
        return entry

    def refusal(self) -> Optional[Fallback]:
        """Why a size may not be captured at a call, or None: the model's state is too large to copy aside
        and put back after the capture's runs of the forward (capture). Found again until it
        refuses (a cache may make its tensors at its first call), then kept."""
        if self._refusal is not None:
            return self._refusal
        held = self.capturer.model_state.held_state().tensors
        size = sum(self.capturer.adapter.nbytes(t) for _, t in held)
        if size <= capture_checks.STATE_BYTES:
            return None
        largest = max(held, key=lambda h: self.capturer.adapter.nbytes(h[1]))[0]
        self._refusal = Fallback(
            Reason.LAZY_STATE,
            f"a size that capture_model() did not capture is captured at a call only where the model's state "
            f"(its buffers and the tensors its modules hold: {size / 2**20:.0f} MiB here, the largest {largest}) "
            f"can be copied aside and put back ({capture_checks.STATE_BYTES >> 20} MiB at most): each of the "
            "capture's runs of the forward may advance it. Capture the sizes with capture_model(), and reset "
            "that state after it; this call runs without graphs")
        return self._refusal

    def _arguments_in_outputs(self, sig: Signature, leaves) -> List[Tuple[Any, Any]]:
        """(argument, a copy of it) for each tensor argument whose memory overlaps an output of the
        signature's captured sizes."""
        adapter = self.capturer.adapter
        spans = [span for entry in sig.entries.values() for span in entry.output_extents(adapter)]
        return [(leaf, adapter.clone(leaf)) for leaf in leaves if overlaps(spans, adapter.extent(leaf))]
