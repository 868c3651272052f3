"""What a graphed block binds to and watches of its module (ModuleWatch, mixed into GraphedBlock).

At its first call a block binds to the framework of its tensors. After capture its graphs read the
module's parameters and buffers by address and bake its training flags and plain attributes: a
parameter, buffer or submodule replaced or added, a parameter frozen or unfrozen, or a plain attribute
set to another value is found at the next call, and the graphs are dropped and captured again.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import sys
from typing import Any, Callable, Dict, Tuple

from . import backends
from .errors import GraphOptInputError
from .pytree import flatten
from .held_state import state_key

logger = logging.getLogger("graph_opt")


class ModuleWatch:
    """Mixed into GraphedBlock: binding to a framework, and the module as its graphs read it."""

    def _bind(self, args, kwargs) -> None:
        framework = self.framework or _framework_of_call(args, kwargs, self.name)
        backend = backends.load(framework)
        self.framework = framework
        self.adapter = backend.ADAPTER
        self.bridge = backend.autograd_bridge()
        if self.level:
            self.traced = self.bridge.traced(self.call, self.level, self.name)
        if self.module is not None:
            self.modes = self.adapter.mode_counter()
            self._watch_modes()
            self.lazy = self.bridge.uninitialized(self.module)
            self.params = self.bridge.trainable_parameters(self.module)
            if not self.lazy:
                self._watch()

    def _watch_modes(self) -> None:
        """The training flags of the module and every submodule it holds now (one added since is in
        the key from its next capture on)."""
        self.mode_dicts = [d for _, d in self.adapter.module_dicts(self.module)]
        self.mode_root = self.mode_dicts[0]
        self.modes_seen = -1
        self.mode_flags = (None,)

    def _watch(self) -> None:
        self._watch_modes()
        bound = self.tensors_bound
        owned = [o for o in self.bridge.owned_tensors(self.module) if (id(o[0]), o[1]) not in bound]
        self.watched_owners = [owner for owner, _, _ in owned]
        self.watched_names = [name for _, name, _ in owned]
        self.watched_tensors = [t for _, _, t in owned]
        self.watched_ptrs = self.bridge.addresses(self.watched_tensors)
        self.all_params = self.bridge.all_parameters(self.module)
        self.trainable = self.bridge.trainable_flags(self.all_params)
        self.registered = self.adapter.registration_counter()
        self.registrations = self.registered[0]
        self.tensor_ids = self.adapter.module_tensor_ids(self.module)
        # Hooks of submodules run inside the forward, so a graph replays those there were at capture
        # (the module's own run around the block at every call)
        self.hooked = self.adapter.hook_counter()
        self.hook_changes = self.hooked[0]
        self.hooks = self.adapter.hooks_fingerprint(self.mode_dicts)
        self._arm_attributes()

    def _plain_attributes(self, private: bool = False) -> Dict[Tuple[int, str], Any]:
        """(id of a module's __dict__, name) -> key of each plain value (number, string, bool, None) the
        module holds (`self.temperature`) and of the public ones its submodules hold (a dropout's `p`;
        not the framework's own, nor private bookkeeping such as transformers' `_is_hf_initialized`,
        unless `private`: what a run writes is looked for there too); and of the other objects the
        module holds itself (an enum, a list), by identity."""
        out = {}
        framework = self.adapter.framework_attributes
        is_tensor = self.adapter.is_tensor
        root = self.mode_root
        for d in self.mode_dicts:
            where, own = id(d), d is root
            for k, v in d.items():
                if k != "training" and (own or (private or k[:1] != "_") and k not in framework):
                    key = state_key(v)
                    if key[0] != "id" or own and k not in framework and k != "forward" \
                            and not k.startswith("_graph_opt") and not is_tensor(v):
                        out[(where, k)] = key
        return out

    def _class_defaults(self) -> list:
        """(id of a submodule's __dict__, name) of the public plain class attributes of submodules' own
        classes (not the framework's) that the instance does not set: one set on a submodule later
        (`sub.scale = 7.0` over `scale = 1.0`) is seen. The module's own are its __dict__'s length."""
        out = []
        framework = self.adapter.name
        root = self.mode_root
        for d, cls in zip(self.mode_dicts, self.adapter.module_classes(self.module)):
            if d is not root:
                out += [(id(d), k) for k in _class_plain_names(cls, framework) if k not in d]
        return out

    def _note_writes(self, before: Dict[Tuple[int, str], Any]) -> None:
        """Attributes changed since `before` by a run of the forward are its own: no longer watched."""
        written = {k for k, v in self._plain_attributes(private=True).items() if before.get(k, _UNSET) != v}
        if written - self.attr_written:
            self.attr_written |= written
            self._arm_attributes()

    def _arm_attributes(self) -> None:
        """Watch the plain attributes of the module and its submodules (a dropout schedule sets `p`) as
        they are now, but those its forward writes itself at its first calls: a replay runs no Python,
        so they are not inputs a user sets (one written at every call fails the capture)."""
        by_id = {id(d): d for d in self.mode_dicts}
        now = self._plain_attributes()
        kept = [k for k in now if k not in self.attr_written]
        plain = [k for k in kept if now[k][0] != "id"] + [k for k in self._class_defaults() if k not in self.attr_written]
        objects = [k for k in kept if now[k][0] == "id"]
        self.attr_dicts = [by_id[where] for where, _ in plain]
        self.attr_names = [name for _, name in plain]
        self.attr_values = list(map(dict.get, self.attr_dicts, self.attr_names, _GONE_ITER))
        # Python's == takes 1 for 1.0 or True, and -0.0 for 0.0: the types and the zeros' signs are compared too
        self.attr_types = list(map(type, self.attr_values))
        self.attr_zeros = [i for i, v in enumerate(self.attr_values) if type(v) is float and v == 0.0]
        self.attr_signs = [math.copysign(1.0, self.attr_values[i]) for i in self.attr_zeros]
        self.attr_keys = list(map(state_key, self.attr_values))
        self.obj_dicts = [by_id[where] for where, _ in objects]
        self.obj_names = [name for _, name in objects]
        self.obj_values = list(map(dict.get, self.obj_dicts, self.obj_names))
        self.attr_root = sum(1 for where, _ in kept if where == id(self.mode_root))
        self.attr_count = len(self.mode_root)
        # What the forward writes itself, checked against each key's capture before a replay
        self.own_at = [(k, by_id[k[0]], k[1]) for k in self.attr_written if k[0] in by_id]

    def _own_now(self, entry) -> Any:
        value = entry[1].get(entry[2], _GONE)
        return None if value is _GONE else state_key(value)

    def _own_as_captured(self, state) -> bool:
        """The attributes the forward writes itself hold what they held when `state`'s graphs were
        captured: the capture found that a run from there leaves them so (else it failed), so a replay
        is what the forward would do. A value that depends on the call (`self.rows = x.shape[0]` with
        shapes alternating) or one written after this key's capture runs the call eagerly instead."""
        attrs = state.attrs or {}
        return all(self._own_now(e) == attrs.get(e[0]) for e in self.own_at)

    def _own_changed(self, state) -> list:
        attrs = state.attrs or {}
        return [f"{e[2]!r}" for e in self.own_at if self._own_now(e) != attrs.get(e[0])]

    def _eager(self, run: Callable, args, kwargs):
        """An eager (or traced, not replayed) call of the block: attributes it writes are the forward's
        own, and stop being watched."""
        if self.module is None or self.bridge is None:
            return run(*args, **kwargs)
        before = self._plain_attributes(private=True)
        version = self.adapter.version
        versions = [(p, version(p)) for p in self.bridge.all_parameters(self.module)]
        bound = self._tensor_attributes()
        try:
            return run(*args, **kwargs)
        finally:
            self._note_writes(before)
            self._note_rebinding(bound)
            self.ran_eagerly = True
            for p, v in versions:
                if version(p) != v and not any(p is q for q in self.params_written):
                    self.params_written.append(p)

    def _tensor_attributes(self) -> Dict[Any, Any]:
        """(id of a module's __dict__, name) -> the tensor it holds there as a plain attribute."""
        return {(id(owner), name): t for owner, name, t in self.bridge.tensor_attributes(self.module)}

    def _note_rebinding(self, before: Dict[Any, Any]) -> None:
        """Tensor attributes a run of the forward bound anew (legacy weight_norm's `weight`, a tensor kept
        for a dashboard, a cache grown at a longer sequence) are its own, as the plain attributes it
        writes: no longer watched, so their next binding is not taken for a replacement."""
        now = self._tensor_attributes()
        bound = {k for k, t in now.items() if before.get(k) is not t}
        if bound - self.tensors_bound:
            self.tensors_bound |= bound
            if self.watched_tensors:
                self._watch()

    def _written_parameters(self) -> list:
        """(parameter, copy) of those the forward may write in place, for a capture to put back: every
        frozen one (a write through .data moves no version counter) and the trainable ones an eager run
        was seen writing; before any eager run (warmup_steps=0), every one."""
        bridge = self.bridge
        everything = bridge.all_parameters(self.module)
        if self.ran_eagerly:
            chosen = [p for p in everything if not bridge.requires_grad(p) or any(p is q for q in self.params_written)]
        else:
            chosen = everything
        with self.adapter.no_grad():
            return [(p, self.adapter.clone(p)) for p in chosen]

    def _attributes_changed(self) -> bool:
        """A plain value (number, string, bool, None) of the module's or a submodule's attributes set to
        another since capture (`self.temperature = 2.0`, `drop.p = 0.2`, 1 to 1.0), one set over a class
        default, or another object bound to an attribute of the module (an enum member, a new list): the
        graphs bake what the forward read. Same objects: C-level passes over them (a few µs for a
        BERT-base)."""
        root = self.mode_root
        if len(root) != self.attr_count:  # added (over a class default) or deleted
            now = sum(1 for (where, k) in self._plain_attributes()
                      if where == id(root) and (where, k) not in self.attr_written)
            if now != self.attr_root:
                return True
            self.attr_count = len(root)
        values = list(map(dict.get, self.attr_dicts, self.attr_names, _GONE_ITER))
        if values != self.attr_values or list(map(type, values)) != self.attr_types:  # == is identity first, in C
            if list(map(state_key, values)) != self.attr_keys:
                return True
            self.attr_values = values  # equal values in new objects
        zeros = self.attr_zeros
        if zeros and [math.copysign(1.0, values[i]) for i in zeros] != self.attr_signs:
            return True
        return not all(map(operator.is_, map(dict.get, self.obj_dicts, self.obj_names, _GONE_ITER), self.obj_values))

    def _params_moved(self) -> bool:
        """A parameter or buffer replaced (a new object, or its data swapped), one added or a submodule
        replaced (a new head, a LoRA adapter), or the trainable set changed (a parameter frozen or
        unfrozen): the graphs read and compute gradients for the tensors captured."""
        tensors = self.watched_tensors
        if (any(map(operator.is_not, map(dict.get, self.watched_owners, self.watched_names), tensors))
                or self.bridge.addresses(tensors) != self.watched_ptrs
                or self.bridge.trainable_flags(self.all_params) != self.trainable
                or self._attributes_changed()):
            return True
        if self.registered[0] != self.registrations:  # a registration somewhere: is it in this module?
            if self.adapter.module_tensor_ids(self.module) != self.tensor_ids:
                return True
            self.registrations = self.registered[0]
        if self.hooked[0] != self.hook_changes:  # a hook made or removed somewhere: one of this module's?
            if self.adapter.hooks_fingerprint(self.mode_dicts) != self.hooks:
                return True
            self.hook_changes = self.hooked[0]
        return False

    def _recapture(self, quiet: bool = False) -> None:
        """quiet: nothing was captured yet, so only what is watched changes (no warning, no count)."""
        if not quiet:
            self.counters.recaptures += 1
            if "recapture" not in self._warned:
                self._warned.add("recapture")
                logger.warning("%s: a parameter, buffer or submodule was replaced or added after capture (a new "
                               "tensor, its data swapped, a new submodule), a parameter frozen or unfrozen, a plain "
                               "attribute of the module or a submodule set to another value (a dropout's p), or a "
                               "hook of a submodule registered or removed; its graphs are dropped and captured again",
                               self.name)
        self.release(keep_warmups=True)
        self.params = self.bridge.trainable_parameters(self.module)
        self._watch()


_UNSET = object()
_GONE = object()  # what a deleted attribute reads as
_GONE_ITER = itertools.repeat(_GONE)


@functools.lru_cache(maxsize=None)
def _class_plain_names(cls, framework: str) -> tuple:
    """Names of the public class attributes with plain values that `cls` and its bases outside the framework
    define (a value set on the class later is read by the forward as a global is: not watched)."""
    names = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] not in (framework, "builtins"):
            names.update((k, v) for k, v in vars(klass).items() if k[:1] != "_")
    return tuple(k for k, v in names.items() if state_key(v)[0] != "id")


def _framework_of_call(args, kwargs, name: str) -> str:
    """The framework of a function's tensors, judged from the first tensor found."""
    candidates = [fw for fw in ("torch", "paddle") if fw in sys.modules]
    for fw in candidates:
        tensor_type = sys.modules[fw].Tensor
        leaves, _ = flatten((args, kwargs), lambda x, t=tensor_type: isinstance(x, t))
        if leaves:
            return fw
    raise GraphOptInputError(
        f"autocudagraph: {name} was called without a tensor argument; a graphed function takes paddle or "
        "torch tensors (nested in dicts, lists or tuples is fine)")
