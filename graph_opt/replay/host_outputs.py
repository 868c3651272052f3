"""Device-to-host copies the host does not wait for: to_host_async() and host_outputs=.

    fut = graph_opt.to_host_async({"tokens": next_tokens, "stop": stop})
    ...launch the next step...
    host = fut.result()          # waits on this copy's event only; numpy arrays, the tree's shape

Each leaf is copied into a pinned host buffer taken from a ring (one ring per shape and dtype, `depth`
buffers, allocated once). The copy runs on a copy stream after an event on the producing stream, and
the producing stream then waits for the copy's event: later work there (the next replay, an in-place
op) cannot overwrite a source before its copy ends, and the allocator cannot recycle it early. The
host waits only in result(), on that copy's event.

Ring rule: a buffer is reused only when the future that holds it has been read or dropped. Taking a
buffer whose future is unread is an error that says so: never stale data. A reader with one step of
lag needs depth 2 per producer (the default); two producers sharing shapes need their own rings
(`host_outputs=` gives each model its own) or more depth.

Without a device (CPU tensors) the copy is done at once and the future is complete: same API.

host_outputs= on a captured size goes further (GraphCopies): the copies are the last nodes of the
replayed graph, so a step is one launch and one event. One graph must serve every ring slot, so the
slot is chosen on the device: a slot counter the graph reads (index_copy_) and advances, mirrored on
the host, which advances it once per replay. The graph writes the pinned ring through its device
address (unified addressing: a pinned buffer has one address for host and device; checked once).
Where that cannot be done (Paddle on a GPU: no device view of pinned memory; outputs that are not the
same tensors at every replay) the copies go the stream way above, after the replay.
"""
from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

from ..errors import GraphOptError, GraphOptInputError
from ..pytree import TENSOR, flatten, unflatten


class HostRingFull(GraphOptError):
    """The ring buffer a copy would write holds a result nobody has read yet."""


class HostFuture:
    """The host copy of a tree of tensors, under way. ready() never blocks; result() waits for this
    copy only and returns numpy arrays (copies of the pinned buffers: they stay valid)."""

    __slots__ = ("_adapter", "_spec", "_buffers", "_event", "_sources", "_values", "_deferred", "__weakref__")

    def __init__(self, adapter, spec, buffers, event, sources, deferred=None):
        self._adapter = adapter
        self._spec = spec
        self._buffers = buffers
        self._event = event
        self._sources = sources  # kept alive until the copy is known done
        self._values = None
        self._deferred = deferred  # a simulated slow copy (graph_opt.testing.slow_host_copies)

    def ready(self) -> bool:
        if self._values is not None:
            return True
        if self._deferred is not None:
            if not self._deferred.poll():
                return False
            self._deferred = None
        if self._event is not None and not self._adapter.event_done(self._event):
            return False
        self._sources = None
        return True

    def result(self):
        if self._values is None:
            if self._deferred is not None:
                self._deferred.finish()
                self._deferred = None
            if self._event is not None:
                self._adapter.event_wait(self._event)
            to_numpy = self._adapter.host_numpy
            self._values = [to_numpy(b) if v is None else v.copy() for b, v in self._buffers]
            self._sources = None
            self._buffers = None  # read: the ring may hand these buffers out again
        return unflatten(self._spec, list(self._values))

    @property
    def read(self) -> bool:
        return self._values is not None

    def __repr__(self) -> str:
        return f"<HostFuture {'read' if self._values is not None else 'pending'}>"


class _Ring:
    __slots__ = ("buffers", "holders", "next")

    def __init__(self):
        self.buffers: List[Tuple[Any, Any]] = []  # (pinned tensor, numpy view of it or None)
        self.holders: List[Optional[weakref.ref]] = []
        self.next = 0


class HostRings:
    """Pinned host buffers, one ring per (shape, dtype, device), each `depth` deep."""

    def __init__(self, depth: int = 2, name: str = "to_host_async", arg: str = "depth"):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise GraphOptInputError(f"{name}: {arg}={depth!r}: expected an int >= 1 (ring buffers per shape)")
        self.depth = depth
        self.name = name
        self.rings: Dict[Any, _Ring] = {}
        self.pinned_bytes = 0

    def take(self, adapter, t) -> Tuple[_Ring, int, Any]:
        key = (tuple(adapter.shape(t)), adapter.layout(t))
        ring = self.rings.get(key)
        if ring is None:
            ring = self.rings[key] = _Ring()
        i = ring.next
        if i == len(ring.buffers):  # the ring fills in order, up to depth buffers
            pinned = adapter.pinned_like(t)
            ring.buffers.append((pinned, adapter.host_view(pinned)))
            ring.holders.append(None)
            self.pinned_bytes += adapter.nbytes(t)
        holder = ring.holders[i]
        owner = holder() if holder is not None else None
        if owner is not None and not owner.read:
            raise HostRingFull(
                f"{self.name}: the ring for shape {list(key[0])} {key[1][0]} is {self.depth} deep and all its "
                f"buffers hold results not yet read; read an earlier future (result()) before copying again, "
                f"or use a deeper ring (depth={self.depth + 1} or more)")
        ring.next = (i + 1) % self.depth
        return ring, i, ring.buffers[i]

    def copy(self, adapter, tree):
        """Start the copy of every tensor leaf of `tree`; returns its HostFuture."""
        leaves, spec = flatten(tree, adapter.is_tensor)
        return self.copy_groups(adapter, [(spec, leaves)])[0]

    def copy_groups(self, adapter, groups):
        """One copy (one stream hop, one event) for several trees: [(spec, leaves)] -> their futures."""
        taken = [[self.take(adapter, t) for t in leaves] for _, leaves in groups]
        buffers = [b for group in taken for _, _, (b, _) in group]
        sources = [t for _, leaves in groups for t in leaves]
        deferred = _slow_copy(adapter, buffers, sources)
        event = None if deferred is not None else adapter.copy_to_host_async(buffers, sources)
        futures = []
        for (spec, leaves), group in zip(groups, taken):
            future = HostFuture(adapter, spec, [b for _, _, b in group], event, leaves, deferred)
            ref = weakref.ref(future)
            for ring, i, _ in group:
                ring.holders[i] = ref
            futures.append(future)
        return futures


_default_rings: Dict[int, HostRings] = {}


def to_host_async(tree, depth: int = 2) -> HostFuture:
    """Copy the tensor leaves of `tree` (nested dict/list/tuple) to pinned host memory without blocking
    the host; returns a HostFuture. `depth`: buffers per shape and dtype in the process-wide rings."""
    from .. import backends

    leaves, _ = flatten(tree, _is_any_tensor)
    if not leaves:
        raise GraphOptInputError(
            "to_host_async(tree): found no paddle or torch tensor in it; pass a tensor or a dict/list/tuple of them")
    framework = "torch" if "torch" in sys.modules and isinstance(leaves[0], sys.modules["torch"].Tensor) else "paddle"
    adapter = backends.load(framework).ADAPTER
    rings = _default_rings.get(depth)
    if rings is None:
        rings = _default_rings[depth] = HostRings(depth)
    return rings.copy(adapter, tree)


def _is_any_tensor(x) -> bool:
    for name in ("torch", "paddle"):
        module = sys.modules.get(name)
        if module is not None and isinstance(x, module.Tensor):
            return True
    return False


# -- host_outputs= on the decorator -----------------------------------------------------------------
class HostOutputs:
    """The output leaves a model hands back as HostFutures, named by paths ("next_tokens", "out.tokens",
    "aux.0"); its own rings, so two models never take each other's buffers."""

    def __init__(self, paths, depth: int, model_name: str):
        if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or not paths:
            raise GraphOptInputError(
                f"host_outputs={paths!r}: expected a non-empty list of output paths such as "
                "['next_tokens', 'out.tokens', 'aux.0']")
        for p in paths:
            if not isinstance(p, str) or not p or any(not part for part in p.split(".")):
                raise GraphOptInputError(
                    f"host_outputs: {p!r} is not an output path; write keys and indices joined by dots, "
                    "e.g. 'stop', 'out.tokens', 'aux.0'")
        self.paths = [tuple(p.split(".")) for p in paths]
        self.names = list(paths)
        self.rings = HostRings(depth, name=f"{model_name} host_outputs", arg="host_ring_depth")
        self.model_name = model_name
        self.streamed = 0  # calls whose copies went the stream way (no graph, or no in-graph copies)
        self.in_graph: Optional[GraphCopies] = None  # made at the first capture that copies in the graph

    def leaves(self, adapter, out) -> list:
        """The named leaves of `out`, in the order of the paths; errors name a path that matches nothing."""
        leaves = []
        for path, name in zip(self.paths, self.names):
            leaf = _leaf(out, path, name, self)
            if not adapter.is_tensor(leaf):
                raise GraphOptInputError(
                    f"{self.model_name}: host_outputs path {name!r} names a {type(leaf).__name__}, not a tensor")
            leaves.append(leaf)
        return leaves

    def replace(self, out, futures):
        for path, name, future in zip(self.paths, self.names, futures):
            out = _replace(out, path, name, self, future)
        return out

    def apply(self, adapter, out):
        """`out` with the named leaves replaced by HostFutures; all their copies share one event.
        A replay that copied inside its graph has replaced them already."""
        first = _leaf(out, self.paths[0], self.names[0], self)
        if isinstance(first, HostFuture):
            return out
        leaves = self.leaves(adapter, out)
        futures = self.rings.copy_groups(adapter, [(TENSOR, [t]) for t in leaves])
        self.streamed += 1
        return self.replace(out, futures)

    def copies_for_size(self, adapter, outputs, padded: int, batch_dims) -> Optional["SizeCopies"]:
        """The in-graph copies of one captured size, or None where they cannot be made (see GraphCopies).
        batch_dims: the batch dimension of each tensor leaf of `outputs` (output_layout), None for none."""
        leaves = self.leaves(adapter, outputs)
        if self.in_graph is None:
            self.in_graph = GraphCopies(self, adapter, leaves[0])
        index = {id(t): i for i, t in enumerate(flatten(outputs, adapter.is_tensor)[0])}
        dims = [batch_dims[index[id(t)]] if index.get(id(t), len(batch_dims)) < len(batch_dims) else None
                for t in leaves]
        return self.in_graph.for_size(leaves, padded, dims)

    @property
    def copies_in_graph(self) -> int:
        return self.in_graph.replays if self.in_graph is not None else 0


class GraphCopies:
    """A model's host_outputs copied inside its replayed graphs: one pinned ring per output leaf (at the
    largest size; smaller sizes write its first rows), one device slot counter, one event per slot."""

    def __init__(self, host: HostOutputs, adapter, like):
        self.host = host
        self.adapter = adapter
        self.depth = host.rings.depth
        self.counter = adapter.slot_counter(like)  # the slot the next replay writes, on the device
        self.slot = 0  # its mirror on the host
        self.replays = 0
        self.holders: List[tuple] = [() for _ in range(self.depth)]  # weakrefs of each slot's futures
        self.events = [adapter.new_event(like) for _ in range(self.depth)]  # None without a device
        self.rings: Dict[Any, Tuple[Any, Any, int]] = {}  # leaf key -> (pinned ring, device view, rows)

    def for_size(self, leaves, padded: int, dims) -> Optional["SizeCopies"]:
        """dims: each leaf's batch dimension, None where it has none (returned whole)."""
        adapter = self.adapter
        targets, hosts = [], []
        for i, (leaf, dim) in enumerate(zip(leaves, dims)):
            shape = list(adapter.shape(leaf))
            other = tuple(n for d, n in enumerate(shape) if d != dim)
            key = (i, dim, other, adapter.layout(leaf))
            ring = self.rings.get(key)
            if ring is None or (dim is not None and ring[2] < padded):
                pinned = adapter.pinned_like_ring(leaf, self.depth)
                device = adapter.host_slots(pinned, leaf)
                if device is None:
                    return None
                ring = self.rings[key] = (pinned, device, shape[dim] if dim is not None else 0)
            pinned, device, _ = ring
            # the ring is [depth, *leaf's shape]: the leaf's dim is the ring's dim + 1
            targets.append(adapter.narrow(device, dim + 1, padded) if dim is not None else device)
            hosts.append([adapter.narrow(adapter.select(pinned, s), dim, padded) if dim is not None
                          else adapter.select(pinned, s) for s in range(self.depth)])
        return SizeCopies(self, targets, hosts, list(dims), [list(adapter.shape(t)) for t in leaves])

    def check_slot(self) -> None:
        for ref in self.holders[self.slot]:
            future = ref()
            if future is not None and not future.read:
                raise HostRingFull(
                    f"{self.host.model_name} host_outputs: the next replay would write ring slot {self.slot}, "
                    f"whose result has not been read; host_ring_depth={self.depth} allows {self.depth} unread "
                    f"steps. Read an earlier step's futures (result()) first, or raise host_ring_depth "
                    f"to {self.depth + 1} or more")


class SizeCopies:
    """The copies one captured size's graph ends with, and the futures a replay of it hands out."""

    def __init__(self, owner: GraphCopies, targets, hosts, dims, shapes):
        self.owner = owner
        self.targets = targets  # device views of the rings, [depth, padded rows, ...] per leaf
        self.hosts = hosts  # per leaf, per slot: the pinned rows this size writes
        self.dims = dims  # per leaf: its batch dimension (cut to the real rows), or None
        self.shapes = shapes
        self.views: Dict[Tuple[int, int], list] = {}  # (slot, real rows) -> [(pinned rows, numpy view)]

    def tail(self, outputs) -> None:
        """Inside the capture, after the forward: copy the named outputs into the counter's slot, advance it."""
        owner = self.owner
        adapter = owner.adapter
        leaves = owner.host.leaves(adapter, outputs)
        for target, src, shape in zip(self.targets, leaves, self.shapes):
            if list(adapter.shape(src)) != shape:
                raise GraphOptError(
                    f"{owner.host.model_name}: host_outputs leaf of shape {list(adapter.shape(src))} at capture, "
                    f"{shape} at warmup; an output's shape must not change between runs of one size")
            adapter.copy_into_slot(target, owner.counter, src)
        adapter.advance_slot(owner.counter, owner.depth)

    def after_replay(self, out, real: int):
        """`out` with the named leaves replaced by futures over this replay's slot; advances the mirror."""
        owner = self.owner
        adapter = owner.adapter
        slot = owner.slot
        event = owner.events[slot]
        if event is not None:
            adapter.record_event(event)
        views = self.views.get((slot, real))
        if views is None:
            views = self.views[(slot, real)] = [
                (t, adapter.host_view(t)) for t in
                (adapter.narrow(rows[slot], dim, real) if dim is not None else rows[slot]
                 for rows, dim in zip(self.hosts, self.dims))]
        futures = [HostFuture(adapter, TENSOR, [pair], event, None) for pair in views]
        owner.holders[slot] = tuple(weakref.ref(f) for f in futures)
        owner.slot = (slot + 1) % owner.depth
        owner.replays += 1
        return owner.host.replace(out, futures)


def _leaf(node, path, name, host: HostOutputs):
    for key in path:
        node = _child(node, key, name, host)
    return node


def _child(node, key, name, host: HostOutputs):
    if isinstance(node, dict):
        if key not in node:
            raise _no_match(host, name, key, list(node))
        return node[key]
    if isinstance(node, (list, tuple)):
        if not key.lstrip("-").isdigit() or not -len(node) <= int(key) < len(node):
            raise _no_match(host, name, key, [str(i) for i in range(len(node))])
        return node[int(key)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = [f.name for f in dataclasses.fields(node)]
        if key not in fields:
            raise _no_match(host, name, key, fields)
        return getattr(node, key)
    raise _no_match(host, name, key, [])


def _replace(node, path, name, host: HostOutputs, value):
    """node with the leaf at path (known to exist) replaced by value."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(node, dict):
        new = dict(node)
        new[key] = _replace(node[key], rest, name, host, value)
        return new
    if isinstance(node, (list, tuple)):
        items = list(node)
        items[int(key)] = _replace(items[int(key)], rest, name, host, value)
        if isinstance(node, list):
            return items
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    return dataclasses.replace(node, **{key: _replace(getattr(node, key), rest, name, host, value)})


def _no_match(host: HostOutputs, name: str, key: str, available) -> GraphOptInputError:
    where = f"there are: {', '.join(map(str, available))}" if available else "the output has no parts there"
    return GraphOptInputError(f"{host.model_name}: host_outputs path {name!r} matches nothing: no {key!r}; {where}")


# -- a slow copy, for tests on a host (graph_opt.testing.slow_host_copies) ----------------------------
class _DeferredCopy:
    """A copy that has not happened yet: it lands after `polls` calls of ready(), at result(), or when
    graph_opt next replays (the producing stream waits for it, as on a device)."""

    def __init__(self, adapter, buffers, sources, polls):
        self.adapter, self.buffers, self.sources, self.polls = adapter, buffers, sources, polls
        pending_copies.append(self)

    def poll(self) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            self.finish()
            return True
        return False

    def finish(self) -> None:
        if self.sources is not None:
            self.adapter.copy_to_host_async(self.buffers, self.sources)
            self.sources = None
            if self in pending_copies:
                pending_copies.remove(self)


# Simulated slow copies (testing.slow_host_copies) still reading outputs: whoever writes outputs
# lands them first (land_pending_copies), and the hot paths test this list's truthiness
pending_copies: List[_DeferredCopy] = []
_slow_polls = 0


def _slow_copy(adapter, buffers, sources):
    return _DeferredCopy(adapter, buffers, sources, _slow_polls) if _slow_polls else None


def land_pending_copies() -> None:
    """Before graph_opt writes a replay's outputs: the copies still reading them land first."""
    while pending_copies:
        pending_copies[0].finish()
