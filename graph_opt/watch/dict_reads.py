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
        self.owners = list(owners)
        # vars() (a C call) where the class reads attributes generically; object.__getattribute__ (a slot
        # wrapper, twice the time) where its own __getattribute__ would run Python
        plain = [type(o).__getattribute__ is object.__getattribute__ for _, o, _ in owners]
        self.vars_objs = [o for (_, o, _), p in zip(owners, plain) if p]
        self.vars_dicts = [d for (_, _, d), p in zip(owners, plain) if p]
        self.owner_objs = [o for (_, o, _), p in zip(owners, plain) if not p]
        self.owner_dicts = [d for (_, _, d), p in zip(owners, plain) if not p]
        self.sizes = list(sizes)  # (where, dict, its keys in order or None, its length): dicts written only
        self._compile = None
        self._misses = 0  # compiles in a row that did not hold (another thread wrote meanwhile)
        self._set_pins(list(pinned))
        self._version: Optional[Any] = None
        self._versioned: List[dict] = []
        self._seen: Any = None  # the versions when the reads last held, or the watch's moved()

    def _set_pins(self, pinned: list) -> None:
        """Functions' code compared through gc.get_referents; a __defaults__ through a view of its pointer where
        an audit hook makes reads slow (function_fields.py); the rest read by identity."""
        self.pinned = pinned
        self.ref_pins = [r for r in pinned if _by_referents(r)]
        self.ref_objs = [r[1] for r in self.ref_pins]
        self.ref_seen = gc.get_referents(*self.ref_objs) if self.ref_objs else None
        rest = [r for r in pinned if not _by_referents(r)]
        view = function_fields.viewer()
        viewed = [view is not None and type(r[1]) is types.FunctionType and r[2] in _FUNCTION_FIELDS for r in rest]
        views = [view(r[1], r[2]) for r, v in zip(rest, viewed) if v]
        self.views, self.view_ids = [w for w, _ in views], [i for _, i in views]
        self.view_objs = [r[1] for r, v in zip(rest, viewed) if v]
        self.view_names = [r[2] for r, v in zip(rest, viewed) if v]
        read = [r for r, v in zip(rest, viewed) if not v]
        self.pin_objs, self.pin_names, self.pin_values = ([r[i] for r in read] for i in (1, 2, 3))
        self._fast = None  # compiled again from the pins as they are (_held)

    def compile_with(self, compile) -> None:
        """A backend's compiler of the identity checks no dict write shows (contracts.IdentityCompiler): while
        none moved, one call of compiled code answers for all (backends/torch/compiled_reads.py)."""
        self._compile, self._fast = compile, None

    def _identities(self) -> list:
        """(object, kind, name, value now) of each check _same_classes and _same_dicts make."""
        items = [(o, "class", None, type(o)) for o in self.class_objs]
        items += [(o, "dict", None, vars(o)) for o in self.vars_objs]
        items += [(o, "dict", None, object.__getattribute__(o, "__dict__")) for o in self.owner_objs]
        items += [(o, "attr", n, _pinned_now(o, n)) for o, n in zip(self.view_objs, self.view_names)]
        items += [(o, "attr", "__code__", o.__code__) for o in self.ref_objs]
        items += [(o, "attr", n, _pinned_now(o, n)) for o, n in zip(self.pin_objs, self.pin_names)]
        return items

    def _held(self) -> bool:
        """_same_classes() and _same_dicts(): by the compiled check while nothing it reads moved; else in
        Python, which accepts a move to an alike value (an equal code object, a __mro__ of the same
        classes, a cell's plain value made anew), and the compiled check is made anew from the values read
        just before it."""
        fast = self._fast
        if fast is not None and fast():
            return True
        # the values read before the Python check: a write between the two fails the compiled check (and the
        # Python one runs again), where values read after it could pass a state no check accepted
        items = self._read_identities() if self._compile is not None else None
        if not (self._same_classes() and self._same_dicts()):
            return False
        if items is not None:
            self._fast = self._compile(items)
            self._misses = 0 if self._fast is not None else self._misses + 1
            if self._misses >= 3:
                self._compile = None  # not compilable here: Python from now on
        return True

    def _read_identities(self) -> Optional[list]:
        try:
            return self._identities()
        except Exception:  # noqa: BLE001 - an object that no longer reads as it did: the Python check says
            return None

    def __len__(self) -> int:
        return len(self.hop_objs) + len(self.values) + len(self.absent) + len(self.present) + len(self.classes) + \
            len(self.owners) + len(self.pinned) + len(self.sizes)

    def _same_classes(self) -> bool:
        # by identity, not a list compare: a class assigned since may have a metaclass whose __eq__ says equal
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
            if all(map(operator.is_, map(object.__getattribute__, self.pin_objs, self.pin_names), self.pin_values)):
                return True
        except (AttributeError, ValueError):  # deleted, or a cell emptied
            return False
        return self._same_alike()

    def _same_alike(self) -> bool:
        """Pins moved to an alike object, held from then on (in the pins a message or a rebound function's
        follow reads too): a class's __bases__ set back makes a new __mro__ tuple of the same classes; a
        cell set back to a plain value equal by type and value (a float computed anew)."""
        renewed = {}
        for obj, name, was in zip(self.pin_objs, self.pin_names, self.pin_values):
            now = _pinned_now(obj, name)
            if now is not was:
                if name == "__mro__":
                    if type(now) is not tuple or len(now) != len(was) or not all(map(operator.is_, now, was)):
                        return False
                elif name != "cell_contents" or not _plain_alike(now, was):
                    return False
                renewed[(id(obj), name)] = now
        self.pinned = [(w, o, n, renewed.get((id(o), n), v)) for w, o, n, v in self.pinned]
        self.pin_values = [renewed.get((id(o), n), v) for o, n, v in zip(self.pin_objs, self.pin_names, self.pin_values)]
        return True

    def _same_referents(self) -> bool:
        """Functions' __code__, all in one C call: gc.get_referents lists a function's code (with its globals,
        defaults, name...), compared with the list at the last check, each element by identity first, then by
        ==: an equal code object runs as the one it replaces. Reading each __code__ instead raises an audit
        event, ~0.25 µs a read where a library installed an audit hook (filelock 4 does). Any other difference
        (a function's __dict__ made on first use, a default rebound) is looked at pin by pin, and the list
        taken again where all still hold."""
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
        if seen is not None and self._held():
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
        if not all(map(operator.is_, map(dict.get, self.hop_dicts, self.hop_keys, _GONE_ITER), self.hop_objs)) \
                and not self._follow_rebound_functions():
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

    def _follow_rebound_functions(self) -> bool:
        """Where each hop that no longer holds names a function rebound to another of the same code, globals,
        closure contents, defaults and attributes (a factory called again, a decorator applied again to the
        same function), the new one computes what the one read at capture did, as Dynamo's guard on the
        code finds: that hop holds the new function, the new function (its cells too) is pinned as the old
        one was, and the old one stays pinned while another hop still holds it (one function under two
        names). True; anything else: False, a change."""
        moved = []
        for i, (d, key, was) in enumerate(zip(self.hop_dicts, self.hop_keys, self.hop_objs)):
            now = d.get(key, GONE)
            if now is not was:
                if not _same_function(now, was):
                    return False
                moved.append((i, was, now))
        held = {id(o) for o in self.view_objs + self.owner_objs + self.vars_objs + self.class_objs}
        if any(id(was) in held for _, was, _ in moved):
            return False  # read otherwise than by identity: not followed
        hop_objs = list(self.hop_objs)
        for i, _, now in moved:
            hop_objs[i] = now
        kept = set(map(id, hop_objs))
        pinned = list(self.pinned)
        for _, was, now in moved:
            cells = dict(zip(map(id, was.__closure__ or ()), now.__closure__ or ()))
            for where, obj, name, _ in self.pinned:
                new = now if obj is was else cells.get(id(obj))
                if new is not None:
                    pinned.append((where, new, name, _pinned_now(new, name)))
        gone = {id(was) for _, was, _ in moved if id(was) not in kept}
        gone |= {id(c) for _, was, _ in moved if id(was) in gone for c in was.__closure__ or ()}
        unique = {}
        for pin in pinned:
            if id(pin[1]) not in gone:
                unique.setdefault((id(pin[1]), pin[2]), pin)
        self.hop_objs = hop_objs
        self._set_pins(list(unique.values()))
        return True

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


def _same_function(now, was) -> bool:
    """Two plain functions that compute alike: one code and globals; closure contents, defaults and
    attributes the same objects or the same plain values (by type and value: 1 and 1.0 are not alike)."""
    if type(now) is not types.FunctionType or type(was) is not types.FunctionType:
        return False
    if now.__code__ is not was.__code__ or now.__globals__ is not was.__globals__:
        return False
    cells = now.__closure__ or (), was.__closure__ or ()
    if len(cells[0]) != len(cells[1]) or not _alike(list(map(_cell, cells[0])), list(map(_cell, cells[1]))):
        return False
    return _alike(now.__defaults__ or (), was.__defaults__ or ()) and \
        _alike(now.__kwdefaults__ or {}, was.__kwdefaults__ or {}) and _alike(vars(now), vars(was))


def _alike(a, b) -> bool:
    """Each value the same object, or the same plain value (a factory's `1.0` argument made anew)."""
    if type(a) is dict:
        return a.keys() == b.keys() and _alike([a[k] for k in a], [b[k] for k in a])
    return len(a) == len(b) and all(map(_same_value, a, b))


def _same_value(x, y) -> bool:
    return x is y or type(x) is type(y) and state_key(x) == state_key(y)


_PLAIN = frozenset({bool, int, float, str, bytes, complex, type(None)})


def _plain_alike(now, was) -> bool:
    """A cell's contents made anew: a plain value of the same type and value (not a tuple or an object)."""
    return type(was) in _PLAIN and _same_value(now, was)


def _by_referents(pin) -> bool:
    """A pin compared through gc.get_referents (Reads._same_referents): a function's code. A code object
    compares equal only to one that runs alike; a cell's contents or a class's __mro__ might hold an object
    whose __eq__ says equal to anything, so those are read one by one, by identity."""
    _, obj, name, _ = pin
    return type(obj) is types.FunctionType and name == "__code__"


def _pinned_now(obj, name: str):
    return getattr(obj, name, GONE) if name != "cell_contents" else _cell(obj)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return GONE
