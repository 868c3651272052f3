"""Level 0: the eager forward, captured whole or in pieces (EagerStrategy).

Whole (full_cuda_graph): one graph per size. In pieces: the forward is cut at calls of functions
registered as splitting ops (split.splitting_op); those run eagerly between the replayed pieces, and
their results land where the next piece's graph reads them (LandingBuffers). That is how a device
records it (EagerStrategy.record_pieces); the host stand-in runs the whole forward again instead
(host_graphs.HostGraphs.capture_eager).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..replay import output_sharing
from . import split
from ..replay.captured_size import Captured
from ..contracts import StrategyTraits
from ..errors import ReplayDivergence
from ..recorders.host_graphs import graphs_for
from ..pytree import TENSOR, flatten, unflatten


class _SplitStep:
    """A splitting op re-run eagerly between replayed pieces, on the tensors recorded at capture.

    Its result is copied where the next piece's graph reads it: the landing buffers (LandingBuffers).
    An op marked with out= writes it there itself (split.splitting_op); an op that returns a tensor it
    was given needs no copy either.
    """

    def __init__(self, adapter, op, args, kwargs, landed: List[Any], spec):
        self.adapter = adapter
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.landed = landed
        self.spec = spec
        self.single = landed[0] if spec is TENSOR else None  # the common case: one tensor out
        self._with_out()

    def _with_out(self) -> None:
        """The keyword arguments of a replay: an op marked out= also gets the landing buffer."""
        out = self.op.out
        with_out = out is not None and self.single is not None
        self.call_kwargs = dict(self.kwargs, **{out: self.single}) if with_out else self.kwargs

    def weaken(self) -> None:
        """Hold the tensors read from earlier pieces without owning them (see LandingBuffers). A result
        that is one of them becomes the same alias, so that a replay sees it come back and copies nothing."""
        leaves, spec = flatten((self.args, self.kwargs), self.adapter.is_tensor)
        aliases: Dict[int, Any] = {}
        for t in leaves:
            if id(t) not in aliases:
                aliases[id(t)] = self.adapter.weak_alias(t)
        self.args, self.kwargs = unflatten(spec, [aliases[id(t)] for t in leaves], template=(self.args, self.kwargs))
        self.landed = [aliases.get(id(t), t) for t in self.landed]
        self.single = self.landed[0] if self.spec is TENSOR else None
        self._with_out()

    def __call__(self) -> None:
        fresh = self.op.fn(*self.args, **self.call_kwargs)
        dst = self.single
        if dst is not None:
            if fresh is not dst:
                if self.adapter.shape(fresh) != self.adapter.shape(dst):
                    raise self._divergence(fresh)
                self.adapter.copy_(dst, fresh)
            return
        leaves, spec = flatten(fresh, self.adapter.is_tensor)
        if spec != self.spec:
            raise self._divergence(fresh)
        for dst, src in zip(self.landed, leaves):
            if src is not dst:
                self.adapter.copy_(dst, src)

    def _divergence(self, fresh) -> ReplayDivergence:
        return ReplayDivergence(
            f"splitting op {self.op.name!r} returned another structure, shape or non-tensor value at replay "
            "than at capture; the pieces after it baked what it returned at capture"
        )


class LandingBuffers:
    """Where splitting ops' results land, one buffer per (call site, output), shared by every size.

    A piece's graph reads its inputs at fixed addresses, so a splitting op's fresh result is copied
    there at each replay. Sizes are captured largest first and never replay at the same time, so one
    buffer at the largest size serves every size through views. Likewise the tensors a splitting op
    reads from earlier pieces live in the graph pool; from the op's capture on they are held through
    non-owning aliases (adapter.weak_alias), so later pieces and smaller sizes can reuse their blocks.
    Without both, piecewise graph memory grows with every captured size.
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.buffers: Dict[Tuple[int, int], Any] = {}

    def land(self, site: int, index: int, t):
        adapter = self.adapter
        shape = adapter.shape(t)
        if len(shape) == 0:
            return t
        buf = self.buffers.get((site, index))
        if buf is None or adapter.layout(buf) != adapter.layout(t) or adapter.shape(buf)[0] < shape[0]:
            buf = adapter.zeros_like(t, None, 0)
            self.buffers[(site, index)] = buf
        view = adapter.narrow(buf, 0, shape[0])
        if adapter.shape(view) != shape:  # not batch-major: a buffer of its own for this size
            view = adapter.zeros_like(t, None, 0)
        adapter.copy_(view, t)
        return view

    def clear(self) -> None:
        self.buffers.clear()


class _PieceRecorder:
    """Captures the eager forward as device graphs, cut at the selected splitting ops."""

    def __init__(self, adapter, pool, selection: Optional[split.SplitSelection], landing: LandingBuffers):
        self.adapter = adapter
        self.pool = pool
        self.selection = selection
        self.landing = landing
        self.steps: List[Any] = []
        self.graphs: List[Any] = []
        self.splits: List[_SplitStep] = []
        self.host_reads: set = set()  # addresses of host tensors given to splitting ops (Captured.split_reads)
        self._open = None
        self.thread = threading.get_ident()  # the split hook is process-wide; other threads run plain

    def begin(self) -> None:
        graph = self.adapter.new_graph(self.pool)
        graph.capture_begin()
        self._open = graph

    def end(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            graph.capture_end()
            self.graphs.append(graph)
            self.steps.append(graph.replay)

    def abort(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.capture_end()
            with contextlib.suppress(Exception):
                graph.reset()
        for g in self.graphs:
            with contextlib.suppress(Exception):
                g.reset()

    def on_split(self, op, args, kwargs):
        selected = self.selection is not None and self.selection.matches_function(op)
        if not selected or threading.get_ident() != self.thread:
            return op.fn(*args, **kwargs)
        self.selection.mark_seen(op.name)
        self.end()
        self.host_reads.update(split.host_addresses(self.adapter, args, kwargs))
        result = op.fn(*args, **kwargs)
        leaves, spec = flatten(result, self.adapter.is_tensor)
        site = len(self.splits)
        # An op that writes into a tensor it was given and returns it (an attention kernel's output
        # argument) hands back memory the next pieces already read at a fixed address: no landing.
        given = {id(t) for t in flatten((args, kwargs), self.adapter.is_tensor)[0]}
        landed = [t if id(t) in given else self.landing.land(site, i, t) for i, t in enumerate(leaves)]
        returned = unflatten(spec, landed, template=result)
        step = _SplitStep(self.adapter, op, args, kwargs, landed, spec)
        # Held weakly from here on: the model's own references decide when a block read here may be
        # reused, as in eager. Later pieces that reuse it replay after this op; held strongly until the
        # size's capture ended, every such block of every layer would be live at once.
        step.weaken()
        self.splits.append(step)
        self.steps.append(step)
        self.begin()
        return returned


class EagerStrategy:
    """Level 0: capture the eager forward, whole (full_cuda_graph) or split at splitting ops."""

    traits = StrategyTraits(folds_tail=True, records_the_plain_forward=True)

    def __init__(self, call: Callable, adapter, selection: Optional[split.SplitSelection]):
        self.call = call
        self.adapter = adapter
        self.selection = selection  # None: one graph for the whole forward
        self.landing = LandingBuffers(adapter)
        self.translations = 0
        self.pass_counts: Dict[str, int] = {}
        self.value_branches: List[str] = []  # the eager forward's host reads fail its capture instead

    def run(self, args, kwargs):
        return self.call(*args, **kwargs)

    def warmup(self, args, kwargs, padded, sig):
        return self.call(*args, **kwargs)

    def capture(self, args, kwargs, padded, sig, pool, tail: Optional[Callable] = None,
                share: Optional[output_sharing.SharedOutputs] = None) -> Captured:
        return graphs_for(self.adapter).capture_eager(self, args, kwargs, pool, tail, share)

    def record_pieces(self, args, kwargs, pool, tail: Optional[Callable] = None,
                      share: Optional[output_sharing.SharedOutputs] = None) -> Captured:
        """The device's capture: graphs of the forward between the splitting ops it calls."""
        recording = _PieceRecorder(self.adapter, pool, self.selection, self.landing)
        with split.active_hook(recording.on_split if self.selection is not None else None):
            recording.begin()
            try:
                outputs = self.call(*args, **kwargs)
                if share is not None:
                    kept = share.redirect(outputs)
                    share.copy(outputs, kept)
                    outputs = kept  # this size's own output blocks are free once the capture ends
                if tail is not None:
                    tail(outputs)
                recording.end()
            except BaseException:
                recording.abort()
                raise
        steps = tuple(recording.steps)
        replay = steps[0] if len(steps) == 1 else _run_all(steps)
        pieces = len(recording.graphs)
        return Captured(outputs, replay, True, pieces, pieces, keepalive=list(recording.graphs) + recording.splits,
                        split_reads=frozenset(recording.host_reads))

    def release(self) -> None:
        self.landing.clear()


def _run_all(steps):
    def replay():
        for step in steps:
            step()

    return replay
