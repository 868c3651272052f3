"""One captured padded size: what a strategy hands back (Captured) and what a replay needs (CapturedSize).

CapturedSize.run is the end of a call's full path (runner.py): copy the real rows into the static
buffers, replay, return views of the captured outputs. Nothing on that path logs or allocates device
memory. The common call's shortcut (fast_replay.py) does the same from a plan resolved once per size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ReplayDivergence
from .host_outputs import SizeCopies, pending_copies as _pending_host_copies, land_pending_copies
from ..pytree import flatten, shallow_copier, unflatten
from .static_address import overlaps, same_memory

if TYPE_CHECKING:
    from ..watch.fallbacks import Fallback
    from .handed_outputs import HandedOutputs
    from .signature import Signature

_MISMATCH = object()  # CapturedSize.run could not use its graph for these inputs
_ALIASED = object()  # an argument the forward writes shares memory with another, or with an output
_HOST_VALUE = object()  # a host tensor argument holds another value than the level-0 graph baked
_MOVED = object()  # a marked argument (mark_static_address) is not the tensor the graph reads in place


@dataclass
class Captured:
    """What a strategy hands back after capturing one size."""

    outputs: Any  # the forward's output at capture
    replay: Callable[[], Any]  # runs the captured work; returns the outputs when they are not stable
    stable_outputs: bool  # replay writes the captured output tensors in place
    pieces: int
    graphs: int
    keepalive: List[Any] = field(default_factory=list)  # graphs and tensors the replay reads
    # The framework's guards (level >= 1): None when a replay may run, else (key, what changed).
    check: Optional[Callable[[], Optional[Fallback]]] = None
    # Given what replay() returned, whether that is not the captured outputs: the replay took a path the
    # capture did not (Paddle's SOT runs a frame it did not record as plain Python, a branch or loop on a
    # tensor value), and what it returned is the call's result, not the stable outputs.
    diverged: Optional[Callable[[Any], bool]] = None
    # Level 0, piecewise: the addresses of the host tensors the splitting ops were given. Those ops run at
    # every replay and read them as they are (attention's CPU sequence lengths), so they are not baked.
    split_reads: frozenset = frozenset()


@dataclass
class CapturedSize:
    """Everything one padded size needs at replay."""

    padded_size: int
    sig: "Signature"  # its call structure: static buffers, padding, output layout, mutated inputs
    inputs: List[Any]  # the tensors the graph reads, one per tensor leaf, at the padded size
    dims: List[Optional[int]]  # dynamic dim of each leaf, None for static leaves
    copy_inputs: bool
    input_ptrs: List[int]
    captured: Captured
    capture_ms: float
    memory_bytes: Optional[int]
    copies: Optional[SizeCopies] = None  # host_outputs copied by the graph itself
    views: Dict[int, tuple] = field(default_factory=dict)
    pending_check: Optional[tuple] = None  # (capture inputs, eager's outputs) until finish_captures()
    # Level 0: (leaf, its bytes at capture) of each host tensor argument (arguments.py). A kernel takes a
    # host scalar (x / t, t a CPU tensor) by value when it is launched, so the graph holds the capture's.
    host_values: List[tuple] = field(default_factory=list)
    host_changed: int = -1  # the leaf whose host value a replay last found changed
    restore: List[tuple] = field(default_factory=list)  # (marked argument, its contents before the capture)
    output_spans: Optional[List[Tuple[int, int]]] = None  # the memory its replay writes outputs to, once asked
    # (output leaf, input leaf) where the forward returned that input itself: a replay returns the caller's
    # tensor there, as eager does (`h.add_(y); return h` called as `h = m(h)`), not the static copy.
    returned_inputs: List[Tuple[int, int]] = field(default_factory=list)
    # The model's outputs a caller may still hold: kept (copied) before this size replays, and this
    # size's outputs handed out as new aliases (handed_outputs.py). None: the stored outputs as they are.
    handed: Optional["HandedOutputs"] = None
    written_spans: Optional[List[Tuple[int, int]]] = None  # where its replay writes outputs, once asked

    def run(self, adapter, leaves: Sequence[Any], real: int):
        copies = self.copies
        if copies is not None:
            copies.owner.check_slot()  # before anything is written: the ring slot must be free
        views = self.views.get(real)
        if views is None:
            views = self._views_for(adapter, real)
        dsts, shapes, dtypes, strides, output, copier, devices = views
        if _pending_host_copies:  # simulated slow copies (tests) still reading outputs land first
            land_pending_copies()
        sig = self.sig
        if sig.in_place:
            leaves = in_place(adapter, sig.in_place, dsts, leaves)
            if leaves is None:
                return _MOVED
        if sig.fed_back is not None and sig.mutated:
            leaves = own_buffers(adapter, sig, dsts, leaves)
        # Every check before anything is written: a call refused here has written nothing.
        if self.copy_inputs:
            # The dtype and device checks matter: copy_ would cast or move silently (torch) or fail inside the
            # framework (Paddle), and the eager forward would refuse such a call.
            for dst, shape, dtype, device, src in zip(dsts, shapes, dtypes, devices, leaves):
                if src is not dst and (adapter.shape(src) != shape or adapter.dtype(src) != dtype
                                       or adapter.device(src) != device):
                    return _MISMATCH
        else:
            # The caller's own buffers: the very memory, shape and strides the graph read at capture
            # (buf.t() has buf's address and another meaning).
            for ptr, shape, dtype, stride, src in zip(self.input_ptrs, shapes, dtypes, strides, leaves):
                if adapter.data_ptr(src) != ptr or adapter.shape(src) != shape or adapter.dtype(src) != dtype \
                        or adapter.stride(src) != stride:
                    return _MISMATCH
        if sig.mutated and aliased(adapter, sig, leaves, self.output_extents(adapter), dsts):
            return _ALIASED
        if self.host_values:
            for i, value in self.host_values:
                if adapter.host_bytes(leaves[i]) != value:
                    self.host_changed = i
                    return _HOST_VALUE
        handed = self.handed
        if handed is not None:
            handed.keep()  # before the copies too: an output fed back as an argument is read as it is
        if self.copy_inputs:
            sources = leaves if sig.fed_back is None else staged(adapter, sig.fed_back, dsts, leaves)
            sig.padding.wrote(real)  # before the copies: one that raises leaves rows [0, real) counted as written
            for dst, src in zip(dsts, sources):
                if src is not dst:
                    adapter.copy_(dst, src)
        fresh = self.captured.replay()
        if sig.mutated:
            self._write_back(adapter, sig, dsts, leaves)
        diverged = self.captured.diverged
        if diverged is not None and diverged(fresh):
            return self.diverged_result(adapter, fresh, leaves, dsts, real)
        if self.captured.stable_outputs:
            out = output if copier is None else copier()
            if copies is not None:
                return copies.after_replay(out, real)
        else:
            out = self.cut_outputs(adapter, fresh, real)
            if handed is not None:
                out = handed.hand_out(out, self.written(adapter))
        if self.returned_inputs:
            # Not an argument in the outputs' memory (an earlier output fed back): the replay has just
            # written there, and the static copy holds what eager returns.
            outs, spec = flatten(out, adapter.is_tensor)
            spans = self.output_extents(adapter)
            for k, i in self.returned_inputs:
                if not overlaps(spans, adapter.extent(leaves[i])):
                    outs[k] = leaves[i]
            out = unflatten(spec, outs, template=out)
        return out

    def diverged_result(self, adapter, fresh, leaves, dsts, real: int):
        """The replay took a path the capture did not (Captured.diverged): what the forward returned is the
        call's result, on the static buffers. An argument the forward returned is the caller's tensor again,
        one it wrote on that path is written back (the capture saw no write of it), and every output but
        those is handed out as one the next replay may write (its memory is not known)."""
        if self.copies is not None:  # the host copies read the captured outputs, which this path did not make
            raise ReplayDivergence("the replay took a path the capture did not (a branch on a tensor value), "
                                   "so its host_outputs were not copied; this call runs without graphs")
        sig = self.sig
        for i, (dst, src) in enumerate(zip(dsts, leaves)):
            if i not in sig.mutated and src is not dst and not adapter.same_values(dst, src):
                adapter.copy_(src, dst)
        where = {id(t): i for i, t in enumerate(self.inputs)}
        returned = [(k, where[id(t)]) for k, t in enumerate(flatten(fresh, adapter.is_tensor)[0]) if id(t) in where]
        out = self.cut_outputs(adapter, fresh, real)
        if returned:
            outs, spec = flatten(out, adapter.is_tensor)
            for k, i in returned:
                outs[k] = leaves[i]
            out = unflatten(spec, outs, template=out)
        if self.handed is not None:
            out = self.handed.hand_out(out, None, as_is={id(leaves[i]) for _, i in returned})
        return out

    def _write_back(self, adapter, sig, dsts, leaves) -> None:
        """The forward writes some inputs in place: eager would have written the caller's tensors."""
        for i in sig.mutated:
            if leaves[i] is not dsts[i]:
                adapter.copy_(leaves[i], dsts[i])
        if sig.padding is not None:
            sig.padding.touched(self.padded_size)  # the forward wrote the padding rows too

    def output_extents(self, adapter) -> List[Tuple[int, int]]:
        """(start, end) bytes of each tensor output: the memory its replay writes."""
        spans = self.output_spans
        if spans is None:
            spans = self.output_spans = [adapter.extent(t) for t in flatten(self.captured.outputs, adapter.is_tensor)[0]]
        return spans

    def _views_for(self, adapter, real: int):
        dsts = [t if d is None else adapter.narrow(t, d, real) for t, d in zip(self.inputs, self.dims)]
        shapes = [adapter.shape(t) for t in dsts]
        dtypes = [adapter.dtype(t) for t in dsts]
        strides = [adapter.stride(t) for t in dsts]
        devices = [adapter.device(t) for t in dsts]
        output = self.cut_outputs(adapter, self.captured.outputs, real) if self.captured.stable_outputs else None
        # The stored outputs are never handed out themselves: each call gets its own dicts and lists, and
        # (handed_outputs.py) its own tensor objects over the memory the replay writes.
        handed = self.handed
        copier = shallow_copier(output) if handed is None else handed.copier(output, self.written(adapter))
        views = (dsts, shapes, dtypes, strides, output, copier, devices)
        self.views[real] = views
        return views

    def written(self, adapter) -> List[Tuple[int, int]]:
        """(start, end) bytes of the captured outputs a replay writes: those that are not the model's
        parameters or buffers, nor arguments read in place (mark_static_address), nor views of them: an
        output there is the caller's or the model's memory, as eager's view of it would be."""
        spans = self.written_spans
        if spans is None:
            own = self.handed.model_spans() if self.handed is not None else []
            own += [adapter.extent(self.inputs[i]) for i in self.sig.in_place]
            spans = self.written_spans = [s for s in self.output_extents(adapter) if not overlaps(own, s)]
        return spans

    def cut_outputs(self, adapter, outputs, real: int):
        if real == self.padded_size:
            return outputs
        return self.sig.layout.cut(adapter, outputs, real)

    def release(self) -> None:
        for obj in self.captured.keepalive:
            reset = getattr(obj, "reset", None)
            if callable(reset):
                reset()
        self.captured.keepalive.clear()
        self.views.clear()
        self.inputs = []
        self.copies = None

def in_place(adapter, marked, dsts, leaves):
    """`leaves` where every marked one is the tensor its graph reads (a view of the very same memory counts
    as it, and is replaced by it: nothing is copied for it); None where one is not."""
    return _as_buffers(adapter, marked, (), dsts, leaves, required=True)


def own_buffers(adapter, sig, dsts, leaves):
    """`leaves` where an argument the forward writes is its static buffer's very memory (a view of it the
    last replay returned, fed back: `x.add_(v); return x[:, :]` called as `x, _ = m(x, v)`) replaced by
    that buffer: nothing is copied in for it and nothing written back, as the graph writes it in place."""
    return _as_buffers(adapter, sig.mutated, sig.in_place, dsts, leaves, required=False)


def _as_buffers(adapter, indices, skip, dsts, leaves, required: bool):
    """`leaves` with each one at `indices` (not in `skip`) that reads exactly what its static buffer does
    replaced by that buffer; None where `required` and one does not."""
    same = None
    for i in indices:
        if i not in skip and leaves[i] is not dsts[i]:
            if not same_memory(adapter, leaves[i], dsts[i]):
                if required:
                    return None
                continue
            if same is None:
                same = list(leaves)
            same[i] = dsts[i]
    return leaves if same is None else same


def aliased(adapter, sig, leaves, outputs: Sequence[Tuple[int, int]] = (), dsts: Sequence[Any] = ()) -> bool:
    """Whether an argument the forward writes (sig.mutated) overlaps another argument in memory, itself
    (an expanded tensor: eager's write raises, and copying it back after the replay would too, once the
    other arguments were written back), or, where it is copied back after the replay (it is not its static
    buffer, `dsts`, itself), an output
    (`outputs`: their (start, end) bytes). Either way the graph's separate buffers would not see what eager
    sees. Two marked arguments may overlap: the graph reads both in place, as eager does."""
    spans = [adapter.extent(t) for t in leaves]
    marked = sig.in_place
    for i in sig.mutated:
        if i not in marked and _broadcast(adapter, leaves[i]):
            return True
        start, end = spans[i]
        if start == end:
            continue
        for j, (a, b) in enumerate(spans):
            if j != i and a < end and start < b and not (i in marked and j in marked):
                return True
        if i not in marked and (not dsts or leaves[i] is not dsts[i]) and overlaps(outputs, spans[i]):
            return True
    return False


def returned_inputs(adapter, outputs, static) -> List[Tuple[int, int]]:
    """(output leaf, input leaf) for each output that is one of the static inputs the forward was given,
    and no other output shares that input's memory (`return x, x[:, :2]`: eager's two alias each other,
    and so do the static copy and its view; the caller's tensor and that view would not)."""
    where = {id(t): i for i, t in enumerate(static)}
    leaves = flatten(outputs, adapter.is_tensor)[0]
    pairs = [(k, where[id(t)]) for k, t in enumerate(leaves) if id(t) in where]
    spans = [adapter.extent(t) for t in leaves]
    return [(k, i) for k, i in pairs
            if not any(j != k and leaves[j] is not leaves[k] and overlaps([spans[k]], spans[j])
                       for j in range(len(leaves)))]


def _broadcast(adapter, t) -> bool:
    return any(n > 1 and step == 0 for n, step in zip(adapter.shape(t), adapter.stride(t)))


def staged(adapter, fed_back: Sequence[Tuple[int, int]], dsts, leaves) -> list:
    """`leaves`, each one that overlaps the static buffers (`fed_back`: their (start, end) bytes) replaced
    by a copy of it. The forward returns an input, so the caller may pass a view of a static buffer back
    (`x_next, x = m(x, x_prev)`, then `m(x_next, x)`): copying the other arguments in, or filling the
    padding rows, would overwrite it before it is read."""
    sources = list(leaves)
    for i, (dst, src) in enumerate(zip(dsts, leaves)):
        if src is not dst and overlaps(fed_back, adapter.extent(src)):
            sources[i] = adapter.clone(src)
    return sources
