"""The replay of the common call, precompiled per size: m(x) or m(x, lens), every argument a tensor.

GraphRunner._dispatch (runner.py) answers any call: it canonicalises the arguments, finds their
signature, the padded size and the captured entry, then CapturedSize.run checks and copies. For the
common call most of that is the same every time. Once a size has replayed through that path, the
runner keeps a ReplayPlan for it: the entry's views, shapes and dtypes, resolved. A later call whose
arguments are those same positional tensors, at that real size, runs the plan: the checks a replay
needs (every argument a tensor of the captured shape, dtype and device, no autograd, the model's state, the
framework's guards) and nothing else. A call the plan does not answer, before anything was written,
takes the full path, which finds the reason and says it.

A plan exists only for an entry whose replay is just copies in and the graph (no arguments written
back, no host tensor arguments, no host output copies, copied inputs, a single rank). An argument
marked with mark_static_address is read in place: the plan takes it only as the very tensor captured. The signature
drops its plans when its output layout, its blocked sizes or its entries change (Signature.observe,
Signature.block, a new capture), and the runner drops them with its graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from .captured_size import CapturedSize
from ..guards import capture_phase_in_this_thread
from .host_outputs import pending_copies as _pending_host_copies, land_pending_copies

MISS = object()  # the plan does not answer this call: take the full path


@dataclass(frozen=True)
class ReplayPlan:
    """One (signature, real size): what its replay reads, resolved once."""

    entry: CapturedSize
    dsts: Sequence[Any]  # the static buffers' views at the real size
    shapes: Sequence[Any]
    dtypes: Sequence[Any]
    devices: Sequence[Any]
    output: Any  # the outputs' views, when the replay writes them in place (stable)
    copier: Optional[Callable[[], Any]]  # a copy of output's dicts and lists per call (pytree.shallow_copier)
    stable: bool
    diverged: Optional[Callable[[Any], bool]]  # Captured.diverged
    replay: Callable[[], Any]
    check: Optional[Callable[[], Any]]  # the framework's guards (level >= 1)
    padding: Any
    real: int
    # The memory of the marked arguments the forward writes, (start, end) bytes: no copied argument may
    # overlap it (the graph would read the copy, not what the forward writes there).
    written: Sequence[Any]
    copied: Sequence[int]  # the arguments copied in: every one not marked
    marked: Sequence[Any]  # (i, the very tensor captured) of the marked arguments
    checks: Sequence[Any]  # (i, static view, shape, dtype, device) of the copied ones


def plan_for(runner, sig, entry: CapturedSize, real: int) -> Optional[ReplayPlan]:
    """A plan for calls of `real` rows replaying `entry`, or None where its replay needs more than copies."""
    if (entry.copies is not None or set(sig.mutated) - sig.in_place or entry.host_values or not entry.copy_inputs
            or runner.group is not None or sig.padding is None or sig.fed_back is not None or entry.returned_inputs
            or (real != entry.padded_size and sig.layout.exact_only)):
        return None
    views = entry.views.get(real)
    if views is None:
        return None
    dsts, shapes, dtypes, _, output, copier, devices = views
    if sig.in_place:  # a marked argument must be the very tensor (the full path also takes a view of it)
        shapes = [None if i in sig.in_place else shape for i, shape in enumerate(shapes)]
    captured = entry.captured
    adapter = runner.adapter
    written = tuple(adapter.extent(sig.buffers[i]) for i in sig.mutated)  # marked: the caller's very tensors
    copied = tuple(i for i in range(len(dsts)) if i not in sig.in_place)
    marked = tuple((i, dsts[i]) for i in sorted(sig.in_place))
    checks = tuple((i, dsts[i], shapes[i], dtypes[i], devices[i]) for i in copied)
    return ReplayPlan(entry, dsts, shapes, dtypes, devices, output, copier, captured.stable_outputs, captured.diverged,
                      captured.replay, captured.check, sig.padding, real, written, copied, marked, checks)


class FastReplay:
    """The runner's shortcut for calls of its positional-tensor signature (see the module doc).

    `call(args)` answers a call or returns MISS. It is one closure over everything it reads, lock
    included: the decorated class's __call__ runs it directly, so the common call costs two Python
    frames (that __call__ and this one) besides the graph's replay."""

    __slots__ = ("sig", "plans", "call")

    def __init__(self, runner, sig):
        self.sig = sig
        self.plans = sig.plans
        self.call = _shortcut(runner, sig)


def _shortcut(runner, sig):
    adapter = runner.adapter
    arity = len(runner.params)
    lead_at = sig.dynamic[0]  # the first argument with a batch dim: its size picks the plan
    dim = sig.dims[lead_at]
    plans_get = sig.plans.get
    is_tensor, shape, dtype, device, copy_ = adapter.is_tensor, adapter.shape, adapter.dtype, adapter.device, adapter.copy_
    grad_enabled, extent = adapter.grad_enabled, adapter.extent
    state = runner.model_state
    counters = runner.counters
    acquire, release = runner._acquire, runner._release
    pending = _pending_host_copies  # simulated slow copies (tests) still reading outputs land first
    keep = runner.handed.keep  # the outputs of earlier calls a caller still holds keep their values
    single = arity == 1  # the lead, a batch-dim argument: never the static buffer itself
    capturing = capture_phase_in_this_thread  # inside another model's capture: the full path runs the plain forward

    def call(args):
        if len(args) != arity or runner.disabled_reason is not None or capturing():
            return MISS
        # Held while the static buffers are used; a busy runner is the full path's error to raise.
        if not acquire(False):
            return MISS
        try:
            lead = args[lead_at]
            if not is_tensor(lead):
                return MISS
            lead_shape = shape(lead)
            try:
                plan = plans_get(lead_shape[dim])
            except IndexError:
                return MISS
            if plan is None or grad_enabled() or runner.group is not None:
                return MISS
            if state.captured and state.check() is not None:
                return MISS
            check = plan.check
            if check is not None and check() is not None:
                return MISS
            # Every argument checked before any is copied: a call the plan refuses has written nothing.
            dsts = plan.dsts
            if single:
                if lead_shape != plan.shapes[0] or dtype(lead) != plan.dtypes[0] or device(lead) != plan.devices[0]:
                    return MISS
            else:
                for i, dst in plan.marked:
                    if args[i] is not dst:
                        return MISS
                for i, dst, want, kind, place in plan.checks:
                    src = args[i]
                    if src is not dst and (not is_tensor(src) or shape(src) != want or dtype(src) != kind
                                           or device(src) != place):
                        return MISS
                written = plan.written
                if written:
                    for i in plan.copied:
                        start, end = extent(args[i])
                        for a, b in written:
                            if a < end and start < b:
                                return MISS
            real = plan.real
            padding = plan.padding
            if padding.dirty > real:  # padding.wrote(real), the call saved where no row needs a fill
                padding.wrote(real)
            else:
                padding.dirty = real
            try:
                if pending:
                    land_pending_copies()
                keep()
                if single:
                    copy_(dsts[0], lead)
                else:
                    for i, dst, _, _, _ in plan.checks:
                        src = args[i]
                        if src is not dst:
                            copy_(dst, src)
                fresh = plan.replay()
            except Exception as exc:  # as the full path: the eager forward answers; the graphs go if it works
                return runner.replay_raised(exc, plan.entry.padded_size, args, {}, sig)
            counters.replays += 1
            entry = plan.entry
            diverged = plan.diverged
            if diverged is not None and diverged(fresh):  # as the full path (CapturedSize.run)
                return entry.diverged_result(adapter, fresh, args, dsts, real)
            if plan.stable:
                copier = plan.copier
                return plan.output if copier is None else copier()
            return runner.handed.hand_out(entry.cut_outputs(adapter, fresh, real), entry.written(adapter))
        finally:
            release()

    return call
