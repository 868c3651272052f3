"""The check before a guarded replay at level >= 1 on torch: Dynamo's guards of the captured trace.

The reads taken out of Dynamo's tree (guard_reads.py) are compared first; then Dynamo's guard tree,
evaluated as a call with the capture's own arguments would. A failing guard is named as Dynamo words
it, with the model code it came from.
"""
from __future__ import annotations

import functools
import inspect

import torch

from ...capture import split
from ...errors import CaptureError
from ...guards import as_captured, as_outside_capture
from ...watch.fallbacks import Fallback, Reason
from .. import frame_locals as frame_of
from . import guard_paths
from .guard_reads import changed_read


def guard_check(original_code, code, graph_fn, model, args, kwargs, trace_hook, reads):
    """Dynamo's guards of the cache entry whose transformed code the replays call, evaluated as a call
    with the capture's own arguments would, with graph_opt's own state as it was when Dynamo traced:
    the capture flags (guards.as_captured) and the hook that routes splitting ops to one FX node; first
    the reads taken out of them (guard_reads.py), as dict reads. None when all hold; else a GUARD
    Fallback naming the failing guard or read."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entry = next((e for e in _debug_get_cache_entry_list(original_code) if e.code is code), None)
    manager = getattr(entry, "guard_manager", None)
    if manager is None:
        raise CaptureError("Dynamo's cache holds no guards for the captured code; replays could not check that the "
                           "Python state the forward read is unchanged (set guarded_replays: false to replay "
                           "without that check)")
    bound = inspect.signature(graph_fn).bind(model, *args, **kwargs)
    bound.apply_defaults()
    # The static buffers and values the capture ran with, and the closure's variables as they are now.
    frame_locals, refresh = frame_of(graph_fn, bound.arguments)
    is_inference = torch.is_inference_mode_enabled
    inference_mode_off = functools.partial(torch._C._InferenceMode, False)
    set_grad_enabled = torch._C._set_grad_enabled
    set_hook = split.set_hook

    def holds(f_locals):
        if refresh is not None:
            refresh()
        saved = set_hook(trace_hook)
        try:
            return manager.check(f_locals)
        finally:
            set_hook(saved)

    differs = reads.differs if reads is not None else None
    plain = _flags_unread(holds, frame_locals)

    def check():
        if differs is not None and differs():
            return Fallback(Reason.GUARD, changed_read(reads, model))
        if is_inference():
            # The captured graph computes the same in inference mode; only the tensors' dispatch keys
            # differ there, which Dynamo's tensor guards would read as a change. The C-level guard, not
            # torch.inference_mode(False) and no_grad(): those two cost ~4.5 us a call; the guard's exit
            # puts back grad mode too.
            with inference_mode_off():
                set_grad_enabled(False)
                ok = holds(frame_locals) if plain else as_captured(holds, frame_locals)
        else:
            ok = holds(frame_locals) if plain else as_captured(holds, frame_locals)
        if ok:
            return None
        return Fallback(Reason.GUARD, _failed_guard(manager, frame_locals, trace_hook, graph_fn.__globals__))

    return check


def _flags_unread(holds, frame_locals) -> bool:
    """Whether the guards hold with graph_opt's capture flags off as well as on, as the capture left the
    state: then none reads them (a forward that branched on is_capturing() has its guard on the flag,
    which holds only on), and a replay's check need not set them (~0.4 µs a call). Where the guards do
    not hold now at all, the flags are set at every check, as before."""
    with torch.inference_mode(False), torch.no_grad():
        try:
            return bool(as_captured(holds, frame_locals)) and bool(as_outside_capture(holds, frame_locals))
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated here: the flags set, as before
            return False


def _failed_guard(manager, frame_locals, trace_hook, f_globals) -> str:
    """The first failing guard, as Dynamo words it, with the model code it came from."""
    def verbose():
        with split.active_hook(trace_hook):
            return manager.check_verbose(frame_locals).verbose_code_parts

    with torch.inference_mode(False), torch.no_grad():  # as the guards ran
        parts = as_captured(verbose)
        if not parts:
            return "a guard of the captured graph failed (Dynamo gave no detail)"
        guard, _, where = as_captured(_false_part, parts, frame_locals, f_globals).partition("#")
    guard = " ".join(guard.split())
    where = " ".join(where.split())
    return (f"Python state the forward read changed since capture: Dynamo's guard `{guard}` fails"
            + (f" (from: {where})" if where else "")
            + ". Replays resume when it holds again; to keep the change, clear_graphs() and capture_model() again")


def _false_part(parts, frame_locals, f_globals) -> str:
    """Of a failing guard's parts, the first that evaluates false: one guard may check many things (every
    pair of objects that were one object at capture, each a part); else the first part."""
    if len(parts) > 1:
        for part in parts:
            try:
                if not guard_paths.evaluate(part.partition("#")[0].strip(), L=frame_locals, G=f_globals):
                    return part
            except Exception:  # a part that needs more than L and G: not the one to name
                continue
    return parts[0]
