"""Which of Dynamo's guards a guarded replay evaluates (the graph path's guard_filter_fn), and the reads
taken out of Dynamo's guard tree to be checked as dict reads instead (dict_reads.Reads).

Left out, as before: the parameters' and buffers' tensor metadata. Replays run under no_grad, so
requires_grad_ does not matter, and a conversion (to(), half()) is seen by the model-state check
(replay_guards), as are hooks added to submodules (Dynamo skips guards on those: skip_nnmodule_hook_guards).

Taken out: the guards on what the forward read through an object under the model whose class runs
Python on every attribute read (a Hugging Face config: its __getattribute__ is Python, so each of
Dynamo's guards on `config.x` calls it: ~0.7 µs, over 1 µs for `not hasattr(config, 'y')`, about half
of a GPT-2's guard time). Such a guard is kept unless all of it is a dict read: the object's place
(every step from the model a key of a __dict__ or a dict), a value in the object's own __dict__ that no
class descriptor overrides, a name absent from its __dict__ (NOT_PRESENT_IN_GENERIC_DICT), or a
hasattr answered by the __dict__ and the classes (without a class __getattr__). What Dynamo guarded of
the class itself (its __getattribute__, its attribute_map) stays with Dynamo; what its guard's Python
call went by is read too (_Steps._pin): the object's class, each class's __getattribute__, __getattr__
(their code, defaults and closure cells too) and the name read, and every __dict__ on the way (one
replaced writes none of the dicts read).

Taken out too: a guard on an object that the forward found by dict reads alone from its module's
globals or through a class's or an object's own dict (guard_paths.py): its identity, class, plain value,
a key present or absent, a dict's size or keys. Dynamo's C++ walks those paths at every check; here they
are compared again only after one of their dicts was written (a dict watcher from Python 3.12: one
compare per call). The model's own tree stays with Dynamo, which skips it by its dict tags.
"""
from __future__ import annotations

import collections
import re
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

try:  # a dict's version: moves at every write (CPython's version tag, or a dict watcher from 3.12)
    from torch._C._dynamo.guards import dict_version
except ImportError:  # pragma: no cover - every torch graph_opt supports has it; the full check runs without
    dict_version = None

from ...watch.dict_reads import Reads
from . import guard_paths
from .compiled_reads import compile_identities
from .guard_paths import data_descriptor as _class_descriptor, own_dict as _own_dict, real_dict as _as_dict
from ...watch.replay_guards import show

_STEP = re.compile(r"\.(\w+)|\['([^'\\]*)'\]")
_PATH = re.compile(r"self(?:\.\w+|\['[^'\\]*'\])*")
_MRO = re.compile(r"dict\(type\((self[^()]*|G\[[^()]*)\)\.__mro__\[(\d+)\]\.__dict__\)\['(\w+)'\].*")
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "TYPE_MATCH", "ID_MATCH"})
# Guards answered by the object a walk reaches (guard_paths.py) and the dicts it read.
_WALKED_KINDS = frozenset({"ID_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "TYPE_MATCH",
                           "CONSTANT_MATCH", "EQUALS_MATCH", "DICT_CONTAINS", "NOT_PRESENT_IN_GENERIC_DICT",
                           "DUPLICATE_INPUT", "DICT_KEYS_MATCH", "SEQUENCE_LENGTH", "CLOSURE_MATCH"})
_ID_GUARDS = frozenset({"ID_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH"})
_FROZEN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_MISSING = object()


def _tensor_metadata(entry) -> bool:
    return entry.guard_type == "TENSOR_MATCH" and ("._parameters[" in entry.name or "._buffers[" in entry.name)


def tag_skipping_guards():
    """The dict-tag settings Dynamo builds this trace's guards with: a check skips each module subtree
    whose dicts kept their version tags (torch's recursive dict tags): an attribute set, a submodule or
    parameter added, replaced or removed changes a tag and the subtree is checked as before. Functions'
    dunders (a method's __defaults__ rebound) are not assumed constant, as torch's default would; a
    tensor's metadata changed in place (`p.data = other`) is the model-state check's (replay_guards). A
    12-layer GPT-2's guard check on a CPU, 1,000 checks back to back: torch 2.13 / Python 3.11 36 -> 15
    µs, torch 2.11 / Python 3.12 (the H200 hosts' versions) 61 -> 22 µs."""
    return torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True,
                                      assume_dunder_attributes_remain_unchanged=False)


class ReplayGuards:
    """guard_filter_fn of the graph path: the guards a replay has Dynamo evaluate. `code` is the
    transformed code of the frame being compiled (the bytecode hook runs before the guards are built);
    taken(code) hands back the reads taken out of that code's guards."""

    def __init__(self, model, f_globals: Optional[dict] = None):
        self.model = weakref.ref(model)
        self.f_globals = f_globals  # the forward's globals: Dynamo's G
        self.code = None
        self._reads: Dict[int, Tuple[Any, Reads]] = {}

    def __call__(self, entries) -> List[bool]:
        identity = frozenset(e.name for e in entries if e.guard_type in _ID_GUARDS and e.name)
        steps = _Steps(self.model(), self.f_globals, identity)
        keep = []
        for entry in entries:
            keep.append(not _tensor_metadata(entry) and not steps.take(entry))
        if self.code is not None:
            self._reads[id(self.code)] = (self.code, steps.reads())
        return keep

    def stale(self) -> bool:
        """A read taken out of some trace's guards changed: Dynamo's cache, which no longer checks it,
        would run that trace for a capture (the path is traced anew then)."""
        return any(reads.differs() for _, reads in self._reads.values())

    def taken(self, code) -> Optional[Reads]:
        found = self._reads.get(id(code))
        return found[1] if found is not None and found[0] is code and len(found[1]) else None


class _Steps:
    """The model's objects along guard sources (`self._modules['lm'].config`), resolved as dict reads."""

    def __init__(self, model, f_globals: Optional[dict] = None, identity=frozenset()):
        self.model = model
        self.f_globals = f_globals
        self.identity = identity  # the sources Dynamo guards by identity (guard_paths.walk)
        self.hops: Dict[Tuple[int, str], tuple] = {}  # (id of dict, key) -> (where, dict, key, object)
        self.values: Dict[Tuple[int, str], tuple] = {}
        self.absent: Dict[Tuple[int, str], tuple] = {}
        self.present: Dict[Tuple[int, str], tuple] = {}
        self.classes: Dict[int, tuple] = {}  # id(object) -> (where, object, its class)
        self.owners: Dict[int, tuple] = {}  # id(object) -> (where, object, its __dict__)
        self.pinned: Dict[tuple, tuple] = {}  # (id, name) -> (where, object, name, value)
        self.sizes: Dict[int, tuple] = {}  # id(dict) -> (where, dict, its keys in order or None, its length)

    def reads(self) -> Reads:
        reads = Reads(list(self.hops.values()), list(self.values.values()), list(self.absent.values()),
                      list(self.present.values()), list(self.classes.values()), list(self.owners.values()),
                      list(self.pinned.values()), list(self.sizes.values()))
        read = [d for _, d, _, _ in self.hops.values()] + [d for _, d, _, _ in self.values.values()] + \
            [d for _, d, _, _ in self.sizes.values()] + \
            [d for _, d, _ in self.absent.values()] + [d for _, d, _ in self.present.values()]
        dicts = {id(d): d for d in map(_as_dict, read)}
        if dict_version is not None and None not in dicts.values():
            reads.versioned(dict_version, list(dicts.values()))
        reads.compile_with(compile_identities)
        return reads

    def take(self, entry) -> bool:
        """Whether the guard is checked here instead (its reads recorded), not by Dynamo."""
        return self._take_python(entry) or self._take_walked(entry)

    def _take_python(self, entry) -> bool:
        """A guard on what the forward read through an object whose class runs Python on reads."""
        kind, name = entry.guard_type, entry.name
        self._shadows(name)
        if kind in _VALUE_GUARDS and entry.has_value:
            base, dot, member = name.rpartition(".")
            if not dot or not _PATH.fullmatch(base) or not member.isidentifier():
                return False
            owner = self._python_object(base)
            if owner is None:
                return False
            obj, d = owner[1], owner[3]
            if d.get(member, _MISSING) is not entry.value or _class_descriptor(type(obj), member):
                return False
            self._add(owner)
            self._pin(_shown(base), obj, d, member)
            self.values[(id(d), member)] = (_shown(name), d, member, entry.value)
            return True
        if kind == "DUPLICATE_INPUT":  # `a is b`: Dynamo evaluates it in Python, each path step by step
            other = _local_name(_keywords(entry).get("source_b"))
            if other is None:
                return False
            classes = name.endswith(".__class__") and other.endswith(".__class__")  # `type(a) is type(b)`
            if classes:
                name, other = name[:-len(".__class__")], other[:-len(".__class__")]
            if not _PATH.fullmatch(name) or not _PATH.fullmatch(other):
                return False
            one, two = self._walk(name), self._walk(other)
            if one is None or two is None:
                return False
            if classes:
                if type(one[1]) is not type(two[1]):
                    return False
                for where, obj in ((name, one[1]), (other, two[1])):
                    self.classes[id(obj)] = (f"{_shown(where)}.__class__", obj, type(obj))
            elif one[1] is not two[1] or not _runs_python(one[1]):
                return False
            self._add(one)  # both places hold the objects they held: the one object still
            self._add(two)
            return True
        if kind in ("NOT_PRESENT_IN_GENERIC_DICT", "HASATTR"):
            attr = _keywords(entry).get("attr")
            if attr is None and kind == "HASATTR":  # torch before 2.12 names the attribute's own source
                name, _, attr = name.rpartition(".")
            if not isinstance(attr, str) or not _PATH.fullmatch(name):
                return False
            owner = self._python_object(name)
            if owner is None:
                return False
            obj, d = owner[1], owner[3]
            where = f"{_shown(name)}.{attr}"
            if kind == "NOT_PRESENT_IN_GENERIC_DICT":
                if attr in d:
                    return False
                self.absent[(id(d), attr)] = (where, d, attr)
            else:
                classes = [vars(c) for c in type(obj).__mro__ if c is not object]
                if any("__getattr__" in c for c in classes):
                    return False  # a miss runs Python too
                if attr in d:
                    self.present[(id(d), attr)] = (where, d, attr)
                elif hasattr(obj, attr):
                    home = next((c for c in classes if attr in c), None)
                    if home is None:
                        return False
                    self.present[(id(home), attr)] = (where, home, attr)
                else:
                    for c in [d] + classes:
                        self.absent[(id(c), attr)] = (where, c, attr)
            self._add(owner)
            self._pin(_shown(name), obj, d, attr)
            return True
        return False

    def _take_walked(self, entry) -> bool:
        """A guard on an object found by dict reads alone (guard_paths.py), from the model or the forward's
        globals: its identity, class, plain value, or a key's presence in a dict it reads."""
        kind, name = entry.guard_type, entry.name
        if kind not in _WALKED_KINDS or not name or self.f_globals is None or \
                name.startswith("self") and kind not in ("DUPLICATE_INPUT", "CLOSURE_MATCH"):
            return False  # the model's own tree: Dynamo skips it by its dict tags while they hold, but not
            # a function's code (a method read through each layer's class: its own guard per layer)
        keywords = _keywords(entry)
        walked = guard_paths.walk(name, self.model, self.f_globals, self.identity)
        same = kind in _ID_GUARDS or kind in ("DUPLICATE_INPUT", "CLOSURE_MATCH")  # the very object Dynamo saw
        if walked is None or (same and entry.has_value and walked.obj is not entry.value):
            return False
        obj = walked.obj
        where = walked.hops[-1][0] if walked.hops else name
        if kind not in ("CONSTANT_MATCH", "EQUALS_MATCH") and name.startswith("G[") and name not in self.identity \
                and guard_paths.rebinds(obj):
            return False  # Dynamo holds that global (or another module's) to its class or contents, not to the object
        if kind == "DUPLICATE_INPUT":
            other = _local_name(keywords.get("source_b"))
            twin = guard_paths.walk(other, self.model, self.f_globals) if other else None
            if twin is None or twin.obj is not obj:
                return False
            self._add_walked(twin)
        elif kind == "CLOSURE_MATCH" and type(obj) is types.FunctionType:
            # Dynamo compares the function's __code__; the hop holds the function itself, and a function
            # rebound there to one that computes alike is followed (dict_reads.Reads._follow_rebound_functions)
            walked.pinned.append((f"{where}.__code__", obj, "__code__", obj.__code__))
        elif kind == "TYPE_MATCH":
            if entry.has_value and type(obj) is not type(entry.value):
                return False
            if guard_paths.class_can_change(obj) and not isinstance(obj, torch.nn.Module):
                walked.classes.append((f"{where}.__class__", obj, type(obj)))
        elif kind in ("DICT_KEYS_MATCH", "SEQUENCE_LENGTH"):
            # keys in order: only a write reorders a dict's (an OrderedDict's move_to_end writes none)
            if type(obj) is dict or type(obj) is collections.OrderedDict and kind == "SEQUENCE_LENGTH":
                self.sizes[id(obj)] = (where, obj, tuple(obj) if kind == "DICT_KEYS_MATCH" else None, len(obj))
            elif type(obj) is not tuple:  # a tuple: the object itself, held by its hop
                return False
        elif kind in ("CONSTANT_MATCH", "EQUALS_MATCH"):
            last = walked.hops.pop() if walked.hops and walked.hops[-1][3] is obj else None
            if last is None or not _frozen(obj) or obj != entry.value:
                return False
            _, d, key, _ = last
            self.values[(id(d), key)] = (where, d, key, entry.value)
        elif kind == "DICT_CONTAINS":
            key = keywords.get("key")
            if type(obj) not in (dict, collections.OrderedDict) or not isinstance(key, str) or \
                    (key in obj) == bool(keywords.get("invert")):
                return False
            (self.absent if keywords.get("invert") else self.present)[(id(obj), key)] = (f"{where}[{key!r}]", obj, key)
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            attr, own = keywords.get("attr"), _own_dict(obj)
            if not isinstance(attr, str) or own is None or attr in own:
                return False
            walked.owners.append((where, obj, own, attr))
            self.absent[(id(own), attr)] = (f"{where}.{attr}", own, attr)
        self._add_walked(walked)
        return True

    def _add_walked(self, walked) -> None:
        for hop in walked.hops:
            self.hops.setdefault((id(hop[1]), hop[2]), hop)
        for where, obj, d, attr in walked.owners:
            self._add_owner(where, obj, d, attr)
        for where, obj, cls in walked.classes:
            self.classes.setdefault(id(obj), (where, obj, cls))
        for where, obj, attr, value in walked.pinned:
            self.pinned.setdefault((id(obj), attr), (where, obj, attr, value))
        for where, d, name in walked.absent:
            self.absent.setdefault((id(d), name), (where, d, name))

    def _shadows(self, name: str) -> None:
        """A class attribute read through an instance (`self.eps`, `self.helper()`, a global's `knobs.k`):
        Dynamo guards its value in the class of the MRO that held it, not that the classes before it still
        lack it, so setting it on the instance's own class (a subclass) after capture would go unseen. Those
        absences are read here, and the class's __mro__ (its bases set anew)."""
        found = _MRO.fullmatch(name)
        if found is None or found.group(2) == "0":
            return
        path = found.group(1)
        # Only the object's class matters (Dynamo guards it), not its place: the path is evaluated as Dynamo
        # wrote it, through lists, registries and rebindable globals alike
        try:
            obj = guard_paths.evaluate(path, G=self.f_globals or {}, self=self.model)  # at capture
        except Exception:  # noqa: BLE001 - a source that needs more than the model and the globals
            return
        shown = "global " + path if path.startswith("G[") else _shown(path) if _PATH.fullmatch(path) else path
        attr, cls = found.group(3), type(obj)
        self.pinned.setdefault((id(cls), "__mro__"), (f"{shown}.__class__.__mro__".lstrip("."), cls, "__mro__",
                                                      cls.__mro__))
        for klass in cls.__mro__[:int(found.group(2))]:
            d = _as_dict(vars(klass))
            if d is not None and attr not in d:
                where = f"{shown}.{attr} (set on class {klass.__name__})".lstrip(".")
                self.absent[(id(d), attr)] = (where, d, attr)

    def _python_object(self, path: str):
        """_walk's answer and the object's own __dict__, for an object at path whose class runs Python on
        attribute reads and whose reads are all dict reads (its __dict__ and its classes' plain dicts); else None."""
        owner = self._walk(path)
        if owner is None or not _runs_python(owner[1]):
            return None
        d = _own_dict(owner[1])
        if d is None or _class_dicts(owner[1]) is None:
            return None
        return (*owner, d)

    def _walk(self, path: str):
        """(the dict reads from the model to the object at path, the object), or None where a step is not one."""
        obj, hops, where, owners = self.model, [], "self", []
        for attr, key in _STEP.findall(path[len("self"):]):
            if attr:
                d = _own_dict(obj)
                if d is None or attr not in d or _class_descriptor(type(obj), attr) or \
                        _runs_python(obj) and _class_dicts(obj) is None:
                    return None
                owners.append((where, obj, d, attr))
                step = attr
                where += "." + attr
            else:
                if type(obj) is not dict or key not in obj:
                    return None
                d, step = obj, key
                where += f"[{key!r}]"
            obj = d[step]
            hops.append((_shown(where), d, step, obj))
        return hops, obj, owners

    def _add(self, walked) -> None:
        for hop in walked[0]:
            self.hops.setdefault((id(hop[1]), hop[2]), hop)
        for where, obj, d, attr in walked[2]:
            self._add_owner(_shown(where), obj, d, attr)

    def _add_owner(self, shown: str, obj, d: dict, name: str) -> None:
        """An object whose own __dict__ a read went through (`name` in it): it holds that dict still, and
        where its class runs Python on reads, the class lookup is pinned too."""
        if _runs_python(obj):
            self._pin(shown, obj, d, name)
        else:
            self.owners.setdefault(id(obj), (f"{shown}.__dict__".lstrip("."), obj, d))

    def _pin(self, shown: str, obj, d: dict, name: str) -> None:
        """A read through an object whose class runs Python goes by its class too: the object holds its
        __dict__ and its class, and each class of its MRO the __getattribute__, __getattr__ and `name`
        it held at capture (a property or a __getattr__ set on the class later is seen). `shown`: the
        object's place as messages show it (`lm.config`, `global helpers.cfg`)."""
        self.owners.setdefault(id(obj), (f"{shown}.__dict__".lstrip("."), obj, d))
        self.classes.setdefault(id(obj), (f"{shown}.__class__".lstrip("."), obj, type(obj)))
        for klass, cd in zip(type(obj).__mro__, _class_dicts(obj)):
            for attr in ("__getattribute__", "__getattr__", name):
                at = f"{shown}.{attr} (on class {klass.__name__})".lstrip(".")
                if attr in cd:
                    self.values.setdefault((id(cd), attr), (at, cd, attr, cd[attr]))
                    if attr != name and type(cd[attr]) is types.FunctionType:
                        self._pin_function(f"{shown}.{attr}".lstrip("."), klass.__name__, cd[attr])
                else:
                    self.absent.setdefault((id(cd), attr), (at, cd, attr))

    def _pin_function(self, where: str, owner: str, fn) -> None:
        """A class's __getattribute__ or __getattr__ runs as its code, defaults and closure say: the same
        function object with its __code__ swapped (or a cell rebound) answers otherwise. Its defaults only
        where the code has parameters past (self, name), the two the interpreter passes: reading a
        function's __code__ or __defaults__ raises an audit event, ~0.25 µs where a library installed an
        audit hook (filelock 4 does)."""
        code = fn.__code__
        pins = ["__code__"] + (["__defaults__"] if code.co_argcount > 2 else []) + \
            (["__kwdefaults__"] if code.co_kwonlyargcount else [])
        for attr in pins:
            self.pinned.setdefault((id(fn), attr), (f"{where}.{attr} (on class {owner})", fn, attr, getattr(fn, attr)))
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                self.pinned.setdefault((id(cell), "cell_contents"), (
                    f"{where}.__closure__[{i}].cell_contents (on class {owner})", cell, "cell_contents",
                    cell.cell_contents))
            except ValueError:  # an empty cell: nothing the function reads now
                continue


def changed_read(reads: Reads, model) -> str:
    """What a replay's GUARD fallback says when a read taken out of Dynamo's guards no longer holds."""
    where, now, was = reads.first_change() or ("an attribute the forward read", None, None)
    where = where if where.startswith("global ") else f"{type(model).__name__}.{where}"
    return (f"Python state the forward read changed since capture: {where} is "
            f"{show(now)} (was {show(was)} at capture). Replays resume when it holds again; to keep the "
            "change, clear_graphs() and capture_model() again")


def _local_name(source) -> Optional[str]:
    """A source's name with the frame's locals as plain names (`L['self'].x` as `self.x`)."""
    if source is None:
        return None
    try:
        name = source.name() if callable(source.name) else source.name  # a method before torch 2.12
    except Exception:
        return None
    return re.sub(r"L\['(\w+)'\]", r"\1", name) if isinstance(name, str) else None


def _keywords(entry) -> dict:
    """The arguments Dynamo made the guard with (`attr`, `key`, `invert`, `source_b`)."""
    return getattr(getattr(entry.orig_guard, "create_fn", None), "keywords", None) or {}


def _frozen(value) -> bool:
    return type(value) in _FROZEN or type(value) is tuple and all(map(_frozen, value))


def _runs_python(obj) -> bool:
    """An object (not a module) whose class's __getattribute__ is Python code."""
    return not isinstance(obj, torch.nn.Module) and isinstance(getattr(type(obj), "__getattribute__", None),
                                                                 types.FunctionType)


def _class_dicts(obj) -> Optional[List[dict]]:
    """The dicts of the classes of obj's MRO but object's, or None where one is not a plain dict."""
    dicts = [_as_dict(vars(klass)) for klass in type(obj).__mro__[:-1]]
    return None if None in dicts else dicts


def _shown(path: str) -> str:
    """`self._modules['lm']._modules['h']._modules['0'].config` as `lm.h.0.config`."""
    return re.sub(r"\._modules\['([^']*)'\]", r".\1", path)[len("self."):] if path != "self" else ""
