"""Reads taken out of a framework's guards, checked as dict reads.

What a traced forward read through objects the framework's guards would read slowly or that graph_opt
can find again by dict reads alone (a Hugging Face config, the forward's globals, a class's dict):
each object on the way, each value, each name absent or present, compared at every replay as C-level
dict reads, and only after a dict watcher (dict_watch.py) or a version saw a write. The backends fill
it (backends/torch/guard_reads.py); a change names what was read and where.
"""
from __future__ import annotations

import gc
import math
import operator
import types
from typing import Any, List, Optional, Tuple

from . import dict_watch, function_fields
from .held_state import state_key
from .module_watch import _DICT_ITER, _GONE_ITER, GONE, _Said, _value_changed, _values_changed

_FUNCTION_FIELDS = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
_POINTER = operator.attrgetter("value")
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


class Reads:
    """What a traced forward read through objects whose attribute reads run Python code (a Hugging Face
    config's __getattribute__: ~0.7 µs a read in the framework's guards, over 1 µs for a missing name),
    compared at every replay as C-level dict reads: each object on the way from the model, the one at
    capture (`hops`: (where, dict, key, object)); each value read, as at capture (`values`: (where, dict,
    name, value); plain values by type and value, the rest by identity); each name that was absent, absent
    still from the instance and its classes (`absent`: (where, dict or class mapping, name)); each name
    found on a class, there still (`present`: the same); each object whose class was compared, of that
    class still (`classes`: (where, object, class)); each object whose __dict__ was read, holding that
    dict still (`owners`: (where, object, dict): a `__dict__` replaced writes no read dict); each
    attribute that no dict holds, the same object still (`pinned`: (where, object, name, value): the
    `__code__` of a class's `__getattribute__`); each dict whose size or keys a guard read, of that size
    and keys still (`sizes`). No counter: a config's attribute set is not counted."""

    def __init__(self, hops: list, values: list, absent: list, present: list, classes: list = (),
                 owners: list = (), pinned: list = (), sizes: list = ()):
        self.hop_where = [w for w, _, _, _ in hops]
        self.hop_dicts = [d for _, d, _, _ in hops]
        self.hop_keys = [k for _, _, k, _ in hops]
        self.hop_objs = [o for _, _, _, o in hops]
        self.where = [w for w, _, _, _ in values]
        self.dicts = [d for _, d, _, _ in values]
        self.names = [n for _, _, n, _ in values]
        self.values = [v for _, _, _, v in values]
        self.types = list(map(type, self.values))
        self.keys = list(map(state_key, self.values))
        self.zeros = [i for i, v in enumerate(self.values) if type(v) is float and v == 0.0]  # 0.0 == -0.0
        self.signs = [math.copysign(1.0, self.values[i]) for i in self.zeros]
        self.absent = absent
        self.absent_in = [d for _, d, _ in absent]
        self.absent_names = [n for _, _, n in absent]
        self.present = present
        self.present_in = [d for _, d, _ in present]
        self.present_names = [n for _, _, n in present]
        self.classes = list(classes)
        self.class_objs = [o for _, o, _ in classes]
        self.class_types = [c for _, _, c in classes]
        # one list compare where the classes compare by identity (no metaclass's __eq__): ~30% less
        self._by_list = all(type(c).__eq__ is object.__eq__ for c in self.class_types)
        self.owners = list(owners)
        # vars() (a C call) where the class reads attributes generically; object.__getattribute__ (a slot
        # wrapper, twice the time) where its own __getattribute__ would run Python
        plain = [type(o).__getattribute__ is object.__getattribute__ for _, o, _ in owners]
        self.vars_objs = [o for (_, o, _), p in zip(owners, plain) if p]
        self.vars_dicts = [d for (_, _, d), p in zip(owners, plain) if p]
        self.owner_objs = [o for (_, o, _), p in zip(owners, plain) if not p]
        self.owner_dicts = [d for (_, _, d), p in zip(owners, plain) if not p]
        self.pinned = list(pinned)
        self.sizes = list(sizes)  # (where, dict, its keys in order or None, its length): dicts written only
        self.ref_pins = [r for r in pinned if _by_referents(r)]
        self.ref_objs = [r[1] for r in self.ref_pins]
        self.ref_seen = gc.get_referents(*self.ref_objs) if self.ref_objs else None
        rest = [r for r in pinned if not _by_referents(r)]
        view = function_fields.viewer()
        viewed = [view is not None and type(r[1]) is types.FunctionType and r[2] in _FUNCTION_FIELDS for r in rest]
        views = [view(r[1], r[2]) for r, v in zip(rest, viewed) if v]
        self.views, self.view_ids = [w for w, _ in views], [i for _, i in views]
        read = [r for r, v in zip(rest, viewed) if not v]
        self.pin_objs, self.pin_names, self.pin_values = ([r[i] for r in read] for i in (1, 2, 3))
        self._version: Optional[Any] = None
        self._versioned: List[dict] = []
        self._seen: Any = None  # the versions when the reads last held, or the watch's moved()

    def __len__(self) -> int:
        return len(self.hop_objs) + len(self.values) + len(self.absent) + len(self.present) + len(self.classes) + \
            len(self.owners) + len(self.pinned) + len(self.sizes)

    def _same_classes(self) -> bool:
        if self._by_list:
            return list(map(type, self.class_objs)) == self.class_types
        return all(map(operator.is_, map(type, self.class_objs), self.class_types))

    def _same_dicts(self) -> bool:
        """The owners' __dict__s and the pinned attributes, which no dict write shows. (Each kind only where
        there is one: a map over nothing still costs ~0.1 µs.)"""
        if self.owner_objs and not all(map(operator.is_, map(object.__getattribute__, self.owner_objs, _DICT_ITER),
                                           self.owner_dicts)):
            return False
        if not all(map(operator.is_, map(vars, self.vars_objs), self.vars_dicts)):
            return False
        if self.views and not all(map(operator.eq, map(_POINTER, self.views), self.view_ids)):
            return False
        if self.ref_objs and not self._same_referents():
            return False
        if not self.pin_objs:
            return True
        try:
            return all(map(operator.is_, map(object.__getattribute__, self.pin_objs, self.pin_names), self.pin_values))
        except (AttributeError, ValueError):  # deleted, or a cell emptied
            return False

    def _same_referents(self) -> bool:
        """Functions' __code__, classes' __mro__ and cells' contents, all in one C call: gc.get_referents lists
        a function's code (with its globals, defaults, name...), a class's __mro__ and a cell's contents,
        compared with the list at the last check, each element by identity first, then by ==: an equal code
        object runs as the one it replaces, an equal __mro__ holds the same classes, and a cell is batched
        only where its contents compare by identity. Reading each __code__ instead raises an
        audit event, ~0.25 µs a read where a library installed an audit hook (filelock 4 does). Any other
        difference (a function's __dict__ made on first use) is looked at pin by pin, and the list taken
        again where all still hold."""
        try:
            if gc.get_referents(*self.ref_objs) == self.ref_seen:
                return True
        except Exception:  # noqa: BLE001 - a rebound default's __eq__ raised: looked at one by one
            pass
        if any(_pinned_now(obj, name) is not was for _, obj, name, was in self.ref_pins):
            return False
        self.ref_seen = gc.get_referents(*self.ref_objs)
        return True

    def versioned(self, version, dicts: List[dict]) -> None:
        """A fast path: `version(d)` moves at every write to d (the interpreter's dict version), and dicts
        are all the dicts read; while none moved since the reads last held, nothing read changed. From
        Python 3.12 a dict watcher answers for all of them in one compare (dict_watch.py)."""
        self._version, self._versioned = version, dicts

    def differs(self) -> bool:
        if self._version is None:
            return self._differs()
        seen = self._seen
        if seen is not None and self._same_classes() and \
                self._same_dicts():
            if seen.__class__ is list:
                if list(map(self._version, self._versioned)) == seen:
                    return False
            elif not seen():
                return False
        # watched (or their versions taken) before the reads: a write during them shows at the next call
        now = dict_watch.watch(self._versioned) or list(map(self._version, self._versioned))
        changed = self._differs()
        self._seen = None if changed else now
        return changed

    def _differs(self) -> bool:
        if not self._same_dicts():
            return True
        if not all(map(operator.is_, map(dict.get, self.hop_dicts, self.hop_keys, _GONE_ITER), self.hop_objs)):
            return True
        if _values_changed(self):
            return True
        if any(map(operator.contains, self.absent_in, self.absent_names)):
            return True
        if not self._same_classes():
            return True
        if any(len(d) != n or keys is not None and tuple(d) != keys for _, d, keys, n in self.sizes):
            return True
        return not all(map(operator.contains, self.present_in, self.present_names))

    def first_change(self) -> Optional[Tuple[str, Any, Any]]:
        """(where, value now, value at capture) of the first read that no longer holds; GONE for a name
        not set."""
        for where, obj, d in self.owners:
            if object.__getattribute__(obj, "__dict__") is not d:
                return where, _Said("another dict"), _Said("the dict it held")
        for where, obj, name, was in self.pinned:
            now = _pinned_now(obj, name)
            if now is not was:
                return where, now, was
        for where, d, key, was in zip(self.hop_where, self.hop_dicts, self.hop_keys, self.hop_objs):
            now = d.get(key, GONE)
            if now is not was:
                return where, now, was
        for where, d, name, key, was in zip(self.where, self.dicts, self.names, self.keys, self.values):
            now = d.get(name, GONE)
            if _value_changed(now, key, was):
                return where, now, was
        for where, d, name in self.absent:
            if name in d:
                return where, d[name], GONE
        for where, d, name in self.present:
            if name not in d:
                return where, GONE, "(set)"
        for where, obj, cls in self.classes:
            if type(obj) is not cls:
                return where, type(obj), cls
        for where, d, keys, n in self.sizes:
            if len(d) != n or keys is not None and tuple(d) != keys:
                return where, _Said(f"{len(d)} keys"), _Said(f"{n} keys" if keys is None else f"keys {list(keys)}")
        return None


def _by_referents(pin) -> bool:
    """A pin compared through gc.get_referents (Reads._same_referents): a function's code, a Python class's
    __mro__, or a cell whose contents' class compares by identity (a class, a function, a module)."""
    _, obj, name, value = pin
    if type(obj) is types.FunctionType:
        return name == "__code__"
    if isinstance(obj, type):  # a Python class's: its dict, __mro__ and __bases__ (a built-in one has none)
        return name == "__mro__" and bool(obj.__flags__ & _HEAP_TYPE)
    return type(obj) is types.CellType and name == "cell_contents" and type(value).__eq__ is object.__eq__


def _pinned_now(obj, name: str):
    return getattr(obj, name, GONE) if name != "cell_contents" else _cell(obj)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return GONE
