"""The state a model holds besides its parameters: its buffers, and the tensors its modules keep in other
attributes (a cache object's, a list's, a dict's, an unregistered helper module's).

A capture runs the forward several times (warmups, the capture, its check). A size captured at a call
must leave that state as one eager call would: HeldState copies the tensors aside (capture_phase puts
back the values a run changed) and remembers which object each container held, so that a forward that
binds a new tensor where an old one was (`self.cache = torch.zeros(...)` made lazily, `st.steps =
st.steps + 1`) is seen and put back. A level-0 replay cannot make that binding (capture_phase: such a
capture fails, or, for state made at the first call, waits for a later call). Nor can it set a Python
value (`self.t += 1`, a set or a numpy array changed in place): `advanced()` names those a run changed,
and `put_back_values()` undoes them.
"""
from __future__ import annotations

import array
import collections
import functools
import sys
import types
from typing import Any, List, Tuple

from ..pytree import holds_tensor, value_key

_DEPTH = 6  # containers followed below a module's attribute
_OPAQUE = (str, bytes, int, float, complex, bool, type, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.ModuleType, functools.partial)


def state_key(value) -> Any:
    """What a level-0 replay compares of an attribute value: plain values by type and value, the rest by identity."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, complex)):
        return value_key(value)
    if isinstance(value, tuple) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return (tuple, tuple(value_key(v) for v in value))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):  # np.float32(0.5): a plain value too
        return (type(value), value.tobytes())
    return ("id", id(value))


class HeldState:
    """The tensors a model holds (`tensors`: (name, tensor)) and a shallow record of every container on the
    way to them, taken now."""

    def __init__(self, adapter, model, buffers: List[Tuple[str, Any]], skip: frozenset):
        self.is_tensor = adapter.is_tensor
        self.tensors: List[Tuple[str, Any]] = []
        # (name, container, its shallow copy, for a module's __dict__ the keys that are not its state)
        self._bindings: List[Tuple[str, Any, Any, Any]] = []
        self._seen: set = set()
        modules = adapter.module_dicts(model)
        self._modules = {id(d) for _, d in modules}
        for _, d in modules:  # parameters: the forward's weights, not its state (a conversion is seen apart)
            self._seen.update(id(p) for p in (d.get("_parameters") or {}).values() if p is not None)
        for name, t in buffers:
            self._add(f"buffer {name!r}", t)
        for path, d in modules:
            where = path + "." if path else ""
            kept = {k: v for k, v in d.items() if _own(k, skip)}
            self._bindings.append((f"attribute of {path or 'the model'}", d, kept, skip))
            for key, value in kept.items():
                self._visit(value, f"attribute {where + key!r}", _DEPTH)
            buffers_dict = d.get("_buffers")
            if isinstance(buffers_dict, dict):
                self._bindings.append((f"buffers of {path or 'the model'}", buffers_dict, dict(buffers_dict), None))

    def _add(self, name: str, t) -> None:
        if id(t) not in self._seen:
            self._seen.add(id(t))
            self.tensors.append((name, t))

    def _visit(self, obj, name: str, depth: int) -> None:
        if obj is None or isinstance(obj, _OPAQUE) or depth < 0:
            return
        if self.is_tensor(obj):
            self._add(name, obj)
            return
        if id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if isinstance(obj, dict):
            self._bindings.append((name, obj, dict(obj), None))
            values = list(obj.values())
        elif isinstance(obj, (list, collections.deque)):
            self._bindings.append((name, obj, list(obj), None))
            values = list(obj)
        elif _is_value(obj):  # changed in place, not rebound: a copy of the whole value
            self._bindings.append((name, obj, _copy_value(obj), None))
            values = list(obj) if isinstance(obj, set) else []
        elif isinstance(obj, (tuple, frozenset)):
            values = list(obj)
        else:
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                if id(attributes) in self._modules:  # a registered module: walked as itself
                    return
                self._bindings.append((name, attributes, dict(attributes), None))
                values = list(attributes.values())
            else:
                values = []
            slots = [s for cls in type(obj).__mro__ for s in cls.__dict__.get("__slots__", ())
                     if isinstance(s, str) and s not in ("__dict__", "__weakref__") and hasattr(obj, s)]
            if slots:
                self._bindings.append((name, obj, {s: getattr(obj, s) for s in slots}, None))
                values += [getattr(obj, s) for s in slots]
        for value in values:
            self._visit(value, name, depth - 1)

    def rebound(self) -> List[str]:
        """The names of the containers whose entries holding tensors no longer hold the objects they held
        (a tensor bound anew, one made where there was none). Where there are any, every container
        recorded gets back every entry it held (the framework may have moved one: Paddle keeps a tensor
        attribute among its buffers), as if the runs had not been; else nothing is touched (a flag or a
        Python count the runs set stays as they left it)."""
        changes = [(name, container, saved, self._changes(container, saved, skip))
                   for name, container, saved, skip in self._bindings]
        names = [_named(name, container, keys) for name, container, saved, keys in changes
                 if keys and any(self._holds(v) for v in self._values(container, saved, keys))]
        if names:
            for _, container, saved, keys in changes:
                if keys:
                    _put_back(container, saved, keys)
        return names

    def advanced(self) -> List[str]:
        """The names of the entries holding no tensor that a run set to another value (`self.t += 1`, a
        list appended to, an object made anew): a level-0 replay runs no Python, so it would neither set
        them nor compute with the new value. Equal plain values in new objects are no change."""
        names = []
        for name, container, saved, skip in self._bindings:
            keys = [k for k in self._changes(container, saved, skip) if not self._same(container, saved, k)]
            if keys and not any(self._holds(v) for v in self._values(container, saved, keys)):
                names.append(_named(name, container, keys) + _transition(container, saved, keys[0]))
        return names

    def put_back_values(self) -> None:
        """Every entry holding no tensor as it was when this record was taken (the runs' Python stores
        undone); entries holding tensors are rebound()'s."""
        for _, container, saved, skip in self._bindings:
            keys = [k for k in self._changes(container, saved, skip) if not self._same(container, saved, k)]
            if keys and not any(self._holds(v) for v in self._values(container, saved, keys)):
                _put_back(container, saved, keys)

    @staticmethod
    def _same(container, saved, key) -> bool:
        if _is_value(container):
            return _same_value(container, saved)
        if isinstance(container, (list, collections.deque)):
            return len(container) == len(saved) and all(map(_equal, container, saved))
        now = getattr(container, key, _MISSING) if not isinstance(container, dict) else container.get(key, _MISSING)
        return _equal(now, saved.get(key, _MISSING))

    @staticmethod
    def _changes(container, saved, skip) -> list:
        """The keys (indices) whose entry is no longer the object it was; every index where a list or
        deque changed length; ["value"] where a set's, bytearray's or array's value changed."""
        if _is_value(container):
            return [] if _same_value(container, saved) else ["value"]
        if isinstance(container, (list, collections.deque)):
            same = len(container) == len(saved) and all(a is b for a, b in zip(container, saved))
            return [] if same else list(range(max(len(container), len(saved))))
        if not isinstance(container, dict):  # an object's __slots__
            return [k for k, v in saved.items() if getattr(container, k, _MISSING) is not v]
        keys = set(saved) | {k for k in container if skip is None or _own(k, skip)}
        return [k for k in keys if container.get(k, _MISSING) is not saved.get(k, _MISSING)]

    @staticmethod
    def _values(container, saved, keys) -> list:
        if isinstance(container, set):
            return list(container) + list(saved)
        if _is_value(container):
            return []
        if isinstance(container, (list, collections.deque)):
            return list(container) + list(saved)
        if not isinstance(container, dict):
            return [v for k in keys for v in (saved[k], getattr(container, k, None))]
        return [v for k in keys for v in (saved.get(k), container.get(k))]

    def _holds(self, obj) -> bool:
        return holds_tensor(obj, self.is_tensor, 3)


_MISSING = object()


def _equal(a, b) -> bool:
    if a is b:
        return True
    key = state_key(a)
    return key[0] != "id" and key == state_key(b)


def _named(name: str, container, keys) -> str:
    """A rebound container's name with the keys that changed: "attribute of the model 'state'"."""
    if isinstance(container, (list, collections.deque)) or _is_value(container):
        return name
    return f"{name} {', '.join(repr(k) for k in sorted(keys, key=str)[:3])}"


def _transition(container, saved, key) -> str:
    """": 3 -> 4" for a plain value a run set; "" for anything else."""
    if isinstance(container, (list, collections.deque, set, bytearray, array.array)):
        return f": {len(saved)} -> {len(container)} items" if len(saved) != len(container) else ""
    if _is_value(container):
        return ""
    now = getattr(container, key, _MISSING) if not isinstance(container, dict) else container.get(key, _MISSING)
    was = saved.get(key, _MISSING)
    if state_key(now)[0] == "id" or state_key(was)[0] == "id":
        return ""
    return f": {was!r:.40} -> {now!r:.40}"


def _put_back(container, saved, keys) -> None:
    if isinstance(container, set):
        container.clear()
        container.update(saved)
    elif isinstance(container, (bytearray, array.array)):
        container[:] = saved
    elif _is_value(container):  # a numpy array
        if container.shape == saved.shape and container.dtype == saved.dtype:
            container[...] = saved
    elif isinstance(container, collections.deque):
        container.clear()
        container.extend(saved)
    elif isinstance(container, list):
        container[:] = saved
    elif not isinstance(container, dict):
        for k in keys:
            setattr(container, k, saved[k])
    else:
        for k in keys:
            if k in saved:
                container[k] = saved[k]
            else:
                del container[k]


VALUE_BYTES = 16 << 20  # a value larger than this is not copied at every capture (docs/calls-and-captures.md)


def _is_value(obj) -> bool:
    """A mutable value a forward may change in place that is not a container of entries (a set, a
    bytearray, an array.array, a writeable numpy array), up to VALUE_BYTES: recorded as a copy of the whole."""
    if isinstance(obj, set):
        return True
    if isinstance(obj, (bytearray, array.array)):
        return len(obj) * getattr(obj, "itemsize", 1) <= VALUE_BYTES
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray) and obj.flags.writeable and obj.nbytes <= VALUE_BYTES


def _copy_value(obj):
    return set(obj) if isinstance(obj, set) else obj[:] if isinstance(obj, (bytearray, array.array)) else obj.copy()


def _same_value(now, saved) -> bool:
    if isinstance(now, (set, bytearray)):
        return now == saved
    if isinstance(now, array.array):  # by bytes: NaN is itself, -0.0 is not 0.0
        return now.typecode == saved.typecode and now.tobytes() == saved.tobytes()
    return now.shape == saved.shape and now.dtype == saved.dtype and now.tobytes() == saved.tobytes()


def _own(key: str, skip: frozenset) -> bool:
    """Whether a module's attribute is the model's: not the framework's (parameters, hooks) or graph_opt's."""
    return key not in skip and not key.startswith("_graph_opt")


class _NothingHeld:
    """A model without the state checks (an object graph_opt does not watch)."""

    tensors: List[Tuple[str, Any]] = []

    @staticmethod
    def rebound() -> List[str]:
        return []

    advanced = rebound

    @staticmethod
    def put_back_values() -> None:
        pass


NOTHING_HELD = _NothingHeld()
