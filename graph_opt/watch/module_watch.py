"""Has the module changed since its graphs were captured? One part per concern, each a snapshot and a
cheap `changed()`: a process-wide change counter first (the adapter's: a patched framework method bumps
it, backends/call_counters.py), the look at the module only after it moved.

- TrainingFlags: the training flag of the module and of every submodule (train() / eval());
- Registrations: parameters, buffers and submodules replaced, added or removed (their ids);
- Conversions: parameters and buffers converted in place (to(), half()) or their `.data` assigned:
  the same objects at other addresses, dtypes or devices;
- Classes: the class of the module and of every submodule (one assigned writes no dict);
- Hooks: hooks of submodules and global module hooks registered or removed;
- Attributes: plain values (numbers, strings, bool, None) of the module's and its submodules'
  attributes, class defaults set over on an instance, and the other objects the module holds itself,
  by identity;
- Reads: attributes a traced forward read on objects whose attribute reads run Python (a Hugging Face
  config), taken from the framework's guards and compared as dict reads at every replay.

Composed by the inference check (replay_guards.ModelState, every level) and by a training block's watch
(training_watch.TrainingWatch). Each part says whether something changed; what a change means (a call
without graphs, a recapture) is the composer's.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any, Dict, List, Optional, Tuple

from .held_state import state_key

_training = operator.itemgetter("training")  # every nn.Module / Layer keeps its flag in its __dict__
GONE = object()  # what a deleted attribute reads as
_GONE_ITER = itertools.repeat(GONE)
_DICT_ITER = itertools.repeat("__dict__")
NEVER = [0]  # the counter of a part that watches nothing: it never moves


class TrainingFlags:
    """The training flags of the module and every submodule it held at the snapshot (dropout, batch
    norm). Read again only after a train() / eval() anywhere (the adapter counts them) or when the
    module's own flag changed: set submodule flags with train() / eval(), not by assigning `training`."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.count: List[int] = NEVER
        self.seen = -1
        self.modules: List[Tuple[str, dict]] = []
        self.dicts: List[dict] = []
        self.root: dict = {"training": None}
        self.flags: tuple = (None,)

    def snapshot(self, modules: List[Tuple[str, dict]]) -> None:
        """modules: the adapter's module_dicts(model), the model's first."""
        self.modules = modules
        self.dicts = [d for _, d in modules]
        self.root = self.dicts[0]
        self.count = self.adapter.mode_counter()
        self.seen = self.count[0]
        self.flags = tuple(map(_training, self.dicts))

    def changed(self) -> bool:
        if self.count[0] != self.seen or self.root["training"] is not self.flags[0]:
            if tuple(map(_training, self.dicts)) != self.flags:  # one C-level pass: ~30 ns a module
                return True
            self.seen = self.count[0]
        return False

    def now(self) -> tuple:
        """The flags as they are (part of a training block's key), read again only after a change."""
        if self.count[0] != self.seen or self.root["training"] is not self.flags[0]:
            self.flags = tuple(map(_training, self.dicts))
            self.seen = self.count[0]
        return self.flags

    def first_change(self) -> Optional[Tuple[str, bool, bool]]:
        """(path, flag now, flag at the snapshot) of the first module whose flag changed."""
        for (path, d), was in zip(self.modules, self.flags):
            now = d.get("training")
            if now is not was:
                return path, now, was
        return None


class Classes:
    """The class of the module and of every submodule, compared at every call: a class assigned
    (`layer.__class__ = Quantized`, as quantization libraries swap a layer) writes no dict and moves no
    counter. Holds the modules (a C-level pass over them: ~2 µs for 150 modules)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.paths: List[str] = []
        self.objs: list = []
        self.types: list = []

    def snapshot(self, model) -> None:
        named = self.adapter.named_modules(model)
        self.paths = [path for path, _ in named]
        self.objs = [m for _, m in named]
        self.types = list(map(type, self.objs))

    def changed(self) -> bool:
        return not all(map(operator.is_, map(type, self.objs), self.types))

    def first_change(self) -> Optional[Tuple[str, type, type]]:
        """(path, class now, class at the snapshot) of the first module whose class changed."""
        return next(((path, type(m), was) for path, m, was in zip(self.paths, self.objs, self.types)
                     if type(m) is not was), None)


class Registrations:
    """The ids of the module's submodules and of the tensors in its parameter and buffer slots, looked
    at again only after a registration anywhere (replaced, added, removed, functional_call's swaps)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.count: List[int] = NEVER
        self.seen = -1
        self.ids: tuple = ()

    def snapshot(self, model) -> None:
        self.count = self.adapter.registration_counter()
        self.seen = self.count[0]
        self.ids = self.adapter.module_tensor_ids(model)

    def changed(self, model) -> bool:
        if self.count[0] != self.seen:
            if self.adapter.module_tensor_ids(model) != self.ids:
                return True
            self.seen = self.count[0]
        return False

    def names_changed(self, now) -> List[str]:
        """The slots whose object is not the one at the snapshot, or is gone."""
        before, after = dict(self.ids), dict(now)
        return [n for n in after if before.get(n) != after[n]] + [n for n in before if n not in after]


class Conversions:
    """Where and how the graphs read each parameter and buffer (id, address, dtype, device, shape,
    strides), compared again only after a conversion (to(), half(), swap_tensors) or a parameter's
    `.data` assigned anywhere: the same objects with other data."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.count: List[int] = NEVER
        self.seen = -1
        self.fingerprint: tuple = ()

    def snapshot(self, model) -> None:
        self.count = self.adapter.conversion_counter()
        self.seen = self.count[0]
        self.fingerprint = self.adapter.tensor_fingerprint(model)

    def changed(self, model) -> bool:
        if self.count[0] != self.seen:
            if self.adapter.tensor_fingerprint(model) != self.fingerprint:
                return True
            self.seen = self.count[0]
        return False


class Hooks:
    """The hooks that run inside the forward (every submodule's, the global module hooks), compared
    again only after a hook handle was made or removed anywhere."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.count: List[int] = NEVER
        self.seen = -1
        self.dicts: List[dict] = []
        self.hooks: Any = None

    def snapshot(self, dicts: List[dict]) -> None:
        self.dicts = dicts
        self.count = self.adapter.hook_counter()
        self.seen = self.count[0]
        self.hooks = self.adapter.hooks_fingerprint(dicts)

    def changed(self) -> bool:
        if self.count[0] != self.seen:
            if self.adapter.hooks_fingerprint(self.dicts) != self.hooks:
                return True
            self.seen = self.count[0]
        return False

    def settle(self) -> bool:
        """Take the hooks as they are now; True when they differ from the snapshot's."""
        now = self.adapter.hooks_fingerprint(self.dicts)
        changed = now != self.hooks
        self.hooks = now
        self.seen = self.count[0]
        return changed


def plain_attributes(adapter, modules: List[Tuple[str, dict]], own_root: bool, private: bool = False
                     ) -> Dict[Tuple[int, str], Any]:
    """(id of a module's __dict__, name) -> key of each public plain value (number, string, bool, None)
    the submodules hold (a dropout's `p`; not the framework's own, nor private bookkeeping such as
    transformers' `_is_hf_initialized`, unless `private`). With `own_root`, also every plain value the
    model itself holds (`self.temperature`) and the other objects it holds (an enum, a list), by
    identity; without, the model's attributes are left out (the decorated model's are watched as they
    are set, replay_guards.ModelState.before_set)."""
    out = {}
    framework = adapter.framework_attributes
    is_tensor = adapter.is_tensor
    root = modules[0][1]
    for _, d in modules:
        where, own = id(d), d is root
        if own and not own_root:
            continue
        for k, v in d.items():
            if k != "training" and (own or (private or k[:1] != "_") and k not in framework):
                key = state_key(v)
                if key[0] != "id" or own and k not in framework and k != "forward" \
                        and not k.startswith("_graph_opt") and not is_tensor(v):
                    out[(where, k)] = key
    return out


class _Said(str):
    """Words in a change's message where a value would be (shown as they are, not quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _value_changed(now, key, was) -> bool:
    """One watched plain value against the one at the snapshot: by type and value, and a zero's sign."""
    return state_key(now) != key or type(now) is float and now == 0.0 and \
        math.copysign(1.0, now) != math.copysign(1.0, was)


def _values_changed(w) -> bool:
    """Whether the plain values a watch holds (w.dicts[i][w.names[i]]) changed since it took them: by type,
    value and the sign of a zero; equal values in new objects are taken as they are now."""
    values = list(map(dict.get, w.dicts, w.names, _GONE_ITER))
    if values != w.values or list(map(type, values)) != w.types:  # == is identity first, in C
        if list(map(state_key, values)) != w.keys:
            return True
        w.values = values  # equal values in new objects
    zeros = w.zeros
    return bool(zeros) and [math.copysign(1.0, values[i]) for i in zeros] != w.signs


class Attributes:
    """The plain attributes of the module and its submodules (a dropout schedule sets `p`), and the
    objects the module holds, as at the snapshot. Python's == takes 1 for 1.0 or True, and -0.0 for
    0.0: the types and the zeros' signs are compared too. Same objects: C-level passes over them.

    The counter (the adapter's attribute_counter: a module's __setattr__ / __delattr__) lets a replay
    look only after an attribute was set anywhere; a training block looks at every call (differs()),
    which also sees a value written into a __dict__ directly."""

    def __init__(self, adapter, own_root: bool = True):
        self.adapter = adapter
        self.own_root = own_root  # the model's own attributes too (training); else its submodules' alone
        self.count: List[int] = NEVER
        self.seen = -1
        self.paths: Dict[int, str] = {}
        self.root: dict = {}
        self.dicts: list = []
        self.names: list = []
        self.values: list = []
        self.types: list = []
        self.keys: list = []
        self.zeros: list = []  # indices of the values 0.0 or -0.0, and their signs
        self.signs: list = []
        self.obj_dicts: list = []
        self.obj_names: list = []
        self.obj_values: list = []
        self.root_watched = 0  # how many of them are the module's own
        self.root_size = 0  # len(the module's __dict__)
        self.left_out: frozenset = frozenset()

    def snapshot(self, modules: List[Tuple[str, dict]], classes: list, left_out=frozenset(),
                 counted: bool = False) -> None:
        """modules: the adapter's module_dicts(model); classes: module_classes(model); left_out: (id of a
        __dict__, name) of attributes not watched (those the forward writes itself); counted: look only
        after the attribute counter moved (changed())."""
        self.count = self.adapter.attribute_counter() if counted else NEVER
        self.seen = self.count[0]
        self.left_out = frozenset(left_out)
        by_id = {id(d): d for _, d in modules}
        self.paths = {id(d): path for path, d in modules}
        self.root = root = modules[0][1]
        now = plain_attributes(self.adapter, modules, self.own_root)
        kept = [k for k in now if k not in left_out]
        plain = [k for k in kept if now[k][0] != "id"] + \
            [k for k in _class_defaults(self.adapter, modules, classes) if k not in left_out]
        objects = [k for k in kept if now[k][0] == "id"]
        self.dicts = [by_id[where] for where, _ in plain]
        self.names = [name for _, name in plain]
        self.values = list(map(dict.get, self.dicts, self.names, _GONE_ITER))
        self.types = list(map(type, self.values))
        self.zeros = [i for i, v in enumerate(self.values) if type(v) is float and v == 0.0]
        self.signs = [math.copysign(1.0, self.values[i]) for i in self.zeros]
        self.keys = list(map(state_key, self.values))
        self.obj_dicts = [by_id[where] for where, _ in objects]
        self.obj_names = [name for _, name in objects]
        self.obj_values = list(map(dict.get, self.obj_dicts, self.obj_names))
        self.root_watched = sum(1 for where, _ in kept if where == id(root))
        self.root_size = len(root)
        self._modules = modules

    def changed(self) -> bool:
        """differs(), looked at only after an attribute was set anywhere (snapshot(counted=True))."""
        if self.count[0] != self.seen:
            if self.differs():
                return True
            self.seen = self.count[0]
        return False

    def differs(self) -> bool:
        """A plain value set to another since the snapshot (`self.temperature = 2.0`, `drop.p = 0.2`, 1 to
        1.0), one set over a class default, or another object bound to an attribute of the module."""
        root = self.root
        if self.own_root and len(root) != self.root_size:  # added (over a class default) or deleted
            now = sum(1 for (where, k) in plain_attributes(self.adapter, self._modules, True)
                      if where == id(root) and (where, k) not in self.left_out)
            if now != self.root_watched:
                return True
            self.root_size = len(root)
        if _values_changed(self):
            return True
        return not all(map(operator.is_, map(dict.get, self.obj_dicts, self.obj_names, _GONE_ITER), self.obj_values))

    def first_change(self) -> Optional[Tuple[str, Any, Any]]:
        """(where, value now, value at the snapshot) of the first watched attribute that changed; where
        is "path.name" ("layer.drop.p"). GONE for an attribute not set."""
        for d, name, key, was in zip(self.dicts, self.names, self.keys, self.values):
            now = d.get(name, GONE)
            if _value_changed(now, key, was):
                return self._where(d, name), now, was
        for d, name, was in zip(self.obj_dicts, self.obj_names, self.obj_values):
            now = d.get(name, GONE)
            if now is not was:
                return self._where(d, name), now, was
        return None

    def _where(self, d: dict, name: str) -> str:
        path = self.paths.get(id(d), "")
        return f"{path}.{name}" if path else name


def _class_defaults(adapter, modules: List[Tuple[str, dict]], classes: list) -> list:
    """(id of a submodule's __dict__, name) of the public plain class attributes of submodules' own
    classes (not the framework's) that the instance does not set: one set on a submodule later
    (`sub.scale = 7.0` over `scale = 1.0`) is seen. The module's own are its __dict__'s length."""
    out = []
    framework = adapter.name
    root = modules[0][1]
    for (_, d), cls in zip(modules, classes):
        if d is not root:
            out += [(id(d), k) for k in _class_plain_names(cls, framework) if k not in d]
    return out


@functools.lru_cache(maxsize=None)
def _class_plain_names(cls, framework: str) -> tuple:
    """Names of the public class attributes with plain values that `cls` and its bases outside the framework
    define (a value set on the class later is read by the forward as a global is: not watched)."""
    names = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] not in (framework, "builtins"):
            names.update((k, v) for k, v in vars(klass).items() if k[:1] != "_")
    return tuple(k for k, v in names.items() if state_key(v)[0] != "id")
