"""What every replay checks about the model and the ambient mode before it may run.

A graph replays the kernels its capture recorded; it does not run Python. So a replay is right only
while the Python state the forward read at capture is unchanged. What is checked, at every level:

- the training flag of the model and of every submodule: no level replays a graph captured in the
  other mode (dropout, batch norm). Every submodule's flag is read again only after a call of
  train() / eval() anywhere (the adapter counts them; a replay compares one integer) or when the
  model's own flag changed: set submodule flags with train() / eval(), not by assigning `training`;
- the ambient mode the framework computes in: autocast (torch) / auto_cast (Paddle) and its dtype;
- parameters and buffers converted in place (to(), half(), cpu(): the same objects, other data) or a
  parameter's `.data` assigned: the framework's _apply and the parameters' `.data` setter bump a
  counter, and after a bump the tensors' addresses, dtypes and devices are compared with those at
  capture;
- parameters, buffers and submodules replaced by new objects: a counter that torch's registration hooks
  and its functional_call helpers (Paddle: Layer.__setattr__ and friends) bump; at level 0, and on Paddle
  at every level (torch's level >= 1: direct_replay._ModuleTensors). Replays resume once the captured
  objects are back;
- hooks of submodules and global module hooks registered or removed (a counter that making or removing
  a hook handle bumps; after a bump the hooks are compared with those at capture). The model's own
  hooks run around the plugin at every call;
- level 0 only: an attribute of the decorated model set after capture that its forward read in a
  capture phase (recorded then: _record_reads), compared with its value at capture (type and value for
  plain values, identity for objects); on Paddle also the public plain values of its submodules
  (`model.head.drop.p = 0.2`), compared after any layer attribute was set (a counter that
  Layer.__setattr__ bumps; torch's Module.__setattr__ is not counted: docs/patches.md). At level >= 1
  the framework's own guards (Dynamo's guard manager, SOT's guard functions) check what the forward
  read, anywhere (on torch, what it read through an object whose attribute reads run Python, a Hugging
  Face config, as dict reads: backends/torch/guard_reads.py).
Each of these is a part of module_watch.py, which a training block's watch is made of too.

A failed check is not an error: the call runs without graphs, with one warning naming what changed,
and replays resume when the state is back (model.eval() again). What level 0 cannot see (a global,
an object a submodule holds, a closure) is the user's contract; see the README, "What a replay assumes".
"""
from __future__ import annotations

import operator
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..backends import patches
from ..capture.failures import model_code
from .fallbacks import Fallback, Reason
from .held_state import NOTHING_HELD, HeldState, state_key
from .module_watch import GONE, Attributes, Classes, Conversions, Hooks, Registrations, TrainingFlags

STATE_ATTR = "_graph_opt_state"  # the instance attribute where the decorator keeps a model's state

_MISSING = object()


class ModelState:
    """The model's state at capture, and the check a replay makes against it (see the module doc). The
    module's parts are module_watch.py's, as a training block's watch has them."""

    def __init__(self, adapter, model, name: str, watch_attributes: bool, watch_replacements: bool,
                 reads_recorded: bool = False):
        self.adapter = adapter
        self.model = model
        self.name = name
        self.watch_attributes = watch_attributes
        # A parameter, buffer or submodule replaced by a new object: level 0, and Paddle's level >= 1 (its
        # replays run the captured program on the captured parameters); torch's level >= 1 checks the
        # tensors itself (direct_replay._ModuleTensors) and here only that none is gone.
        self.watch_replacements = watch_replacements
        self.captured = False
        self._paused = False
        # level 0: the model's own attributes its forward read in the capture phases since the first capture;
        # one set after capture stops replays only if it is among them (a step counter, a name set on the
        # model, torch.compile's marker are not). None: every attribute counts (a translator traces the
        # forward in the capture phase, and must not trace the recording wrapper)
        self.read: Optional[set] = set() if reads_recorded else None
        self._read_before: frozenset = frozenset()
        self._stop_reading = None
        self.flags = TrainingFlags(adapter)
        self.classes = Classes(adapter)
        self.registrations = Registrations(adapter)
        self.conversions = Conversions(adapter)
        self.hooks = Hooks(adapter)
        # the submodules' attributes (the model's own are watched as they are set: before_set)
        self.attributes = Attributes(adapter, own_root=False)
        self.math_changed: Any = b""  # appended to at every change: its length is the count
        self.math_changes = 0
        self.math: Any = None
        self.ambient: Any = None
        self.stale: Optional[Tuple[str, str]] = None  # the parameters converted: sticky until clear_graphs
        # (registration count, refusal) of the last look that found a tensor or submodule replaced: the
        # model is walked again only after another registration, and replays resume once the captured
        # objects are back (torch.func.functional_call swaps them in and out around one call)
        self.replaced: Tuple[int, Any] = (-1, None)
        # ((conversion count, registration count), refusal) of the last look that found parameters or
        # buffers other than the captured objects after a conversion: looked at again after either bumps
        self.remade: Tuple[Any, Any] = (None, None)
        # level 0, attributes of the decorated model set since capture: name -> (key at capture, value then)
        self.original: Dict[str, Tuple[Any, Any]] = {}
        self.changed: Dict[str, Any] = {}

    def snapshot(self) -> None:
        """Record the state the graphs are captured in (at the first capture after a release)."""
        adapter, model = self.adapter, self.model
        self.flags.snapshot(adapter.module_dicts(model))
        self.classes.snapshot(model)
        self.ambient = adapter.ambient()
        self.ambient_now = adapter.ambient
        self.math_changed = adapter.math_mode_counter()
        self.math_changes = len(self.math_changed)
        self.math = adapter.math_mode()
        self.registrations.snapshot(model)
        self.conversions.snapshot(model)
        self.hooks.snapshot(self.flags.dicts)
        self._watch_attributes()
        self.stale = None
        self.replaced = (-1, None)
        self.remade = (None, None)
        self.original.clear()
        self.changed.clear()
        self.captured = True
        patches.depend(self)

    def _watch_attributes(self) -> None:
        if self.watch_attributes:
            self.attributes.snapshot(self.flags.modules, self.adapter.module_classes(self.model), counted=True)

    @property
    def paused(self) -> bool:
        """A capture phase: attributes set now are what the graphs bake (the submodules' are taken again
        when it ends)."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value and not self._paused and self.watch_attributes and self.read is not None:
            self._read_before = frozenset(self.read)
            self._stop_reading = _record_reads(self.model, self.read)
        self._paused = value
        if not value:
            if self._stop_reading is not None:
                self._stop_reading()
                self._stop_reading = None
                self._rebase_newly_read()
            if self.captured:
                self._watch_attributes()

    def _rebase_newly_read(self) -> None:
        """An attribute set after an earlier capture that no graph read then, and that this capture phase
        read: this size's graphs bake its value now, and the earlier ones never read it, so now is its
        value at capture."""
        newly = self.read - self._read_before
        if not newly or not self.original:
            return
        every = "__dict__" in newly
        for name in [n for n in self.original if every or n in newly]:
            now = getattr(self.model, name, _MISSING)
            self.original[name] = (state_key(now), now)
            self.changed.pop(name, None)

    def release(self) -> None:
        self.captured = False
        if self.read is not None:
            self.read.clear()
        patches.release(self)
        self.flags = TrainingFlags(self.adapter)
        self.classes = Classes(self.adapter)
        self.hooks = Hooks(self.adapter)
        self.attributes = Attributes(self.adapter, own_root=False)
        self.original.clear()
        self.changed.clear()
        self.stale = None
        self.replaced = (-1, None)
        self.remade = (None, None)

    def buffer_versions(self) -> List[Tuple[str, int]]:
        """(name, version counter) of every buffer of the model: which ones a run writes in place."""
        version = self.adapter.version
        return [(name, version(t)) for name, t in self.adapter.named_buffers(self.model)]

    def buffers(self) -> list:
        """(name, tensor) of every buffer of the model."""
        return self.adapter.named_buffers(self.model)

    def held_state(self) -> HeldState:
        """What a forward may advance besides its arguments (held_state.py), as it is now."""
        # `forward`: the translators' own (Paddle's SOT binds its static forwards on sublayers)
        return HeldState(self.adapter, self.model, self.buffers(), self.adapter.framework_attributes | {"forward"})

    def decorated_submodules(self) -> List[str]:
        """Paths of the submodules that are models decorated on their own."""
        return [path for path, d in self.adapter.module_dicts(self.model) if path and d.get(STATE_ATTR) is not None]

    def hook_count(self) -> int:
        return self.hooks.count[0]

    def settle_hooks(self) -> bool:
        """Hooks the forward registered itself while it was captured (transformers installs its output
        capturing at the first call that asks for hidden states): the graphs ran them, so replays expect
        them. True when the model's hooks changed (the counter also counts hook handles the framework
        made elsewhere meanwhile: Dynamo's and Inductor's own)."""
        return self.hooks.settle()

    # -- the attribute watch (level 0): called by the decorated class's __setattr__ ----------------------
    @property
    def watching(self) -> bool:
        return self.captured and self.watch_attributes and not self._paused

    def before_set(self, name: str) -> None:
        if name not in self.original:
            old = getattr(self.model, name, _MISSING)
            self.original[name] = (state_key(old), old)

    def after_set(self, name: str) -> None:
        new = getattr(self.model, name, _MISSING)
        key, old = self.original[name]
        read = self.read
        if state_key(new) == key or read is not None and name not in read and "__dict__" not in read:
            self.changed.pop(name, None)
        else:
            self.changed[name] = (old, new)

    # -- the check (hot path) ---------------------------------------------------------------------------
    def check(self) -> Optional[Tuple[str, str]]:
        """None when a replay may run; else (kind, what changed since capture) for stats() and the one warning.
        Each part's counter is compared here, its look made only after it moved (module_watch.py)."""
        if self.stale is not None:
            return self.stale
        if self.changed:
            return self._changed_attributes()
        flags = self.flags
        if (flags.count[0] != flags.seen or flags.root["training"] is not flags.flags[0]) and flags.changed():
            return self._training_changed()
        ambient = self.ambient_now()
        if ambient != self.ambient:
            describe = self.adapter.describe_ambient
            return Fallback(Reason.AMBIENT, f"the call runs under {describe(ambient)}; the graphs were captured "
                                            f"under {describe(self.ambient)}")
        if len(self.math_changed) != self.math_changes:
            now = self.adapter.math_mode()
            if now != self.math:
                return Fallback(
                    Reason.AMBIENT, "the math mode changed since capture: "
                    f"{self.adapter.describe_math_mode(self.math, now)}; the graphs run the kernels "
                    "chosen then. Set it back, or clear_graphs() and capture_model() to capture in it")
            self.math_changes = len(self.math_changed)
        registrations = self.registrations
        if registrations.count[0] != registrations.seen:
            replaced = self._registrations_changed()
            if replaced is not None:
                return replaced
        if self.classes.changed():
            return self._class_changed()
        conversions = self.conversions
        if conversions.count[0] != conversions.seen:
            return self._conversions_changed()
        hooks = self.hooks
        if hooks.count[0] != hooks.seen and hooks.changed():
            return Fallback(
                Reason.HOOKS, "a hook of a submodule (or a global module hook) was registered or removed since "
                "capture; the graphs ran the hooks there were then. Restore them, or clear_graphs() "
                "and capture_model() to capture with them")
        attributes = self.attributes
        if attributes.count[0] != attributes.seen and attributes.changed():
            return self._submodule_attribute_changed()
        return None

    def _changed_attributes(self) -> Fallback:
        parts = [f"{self.name}.{k} = {show(new)} (was {show(old)} at capture)" for k, (old, new) in self.changed.items()]
        if all(self._held(old) or self._held(new) for old, new in self.changed.values()):
            return Fallback(  # a submodule, parameter or buffer of the model's own: as one of a submodule's
                Reason.REPLACED, f"{', '.join(f'{self.name}.{k}' for k in self.changed)} "
                f"{'was' if len(self.changed) == 1 else 'were'} replaced by a new object since capture (or added or "
                "removed); the graphs read the old one. Put the captured one back to replay again, or "
                "clear_graphs() and capture_model() to capture the new one", ("attribute", tuple(self.changed)))
        return Fallback(
            Reason.ATTRIBUTE, "attribute changed since capture: " + "; ".join(parts) + ". Level-0 graphs bake the "
            "Python values forward read; set it back, or clear_graphs() and capture_model() to capture with the "
            "new value", ("attribute", tuple(self.changed)))

    def _held(self, value) -> bool:
        """A tensor or a module (what the model registers as a parameter, buffer or submodule)."""
        return self.adapter.is_tensor(value) or self.adapter.framework_attributes <= getattr(value, "__dict__", {}).keys()

    def _class_changed(self) -> Fallback:
        path, now, was = self.classes.first_change()
        where = f"{self.name}.{path}".rstrip(".") + f" is a {now.__name__} (was a {was.__name__})"
        return Fallback(Reason.REPLACED, f"a module's class changed since capture: {where}; the graphs run the "
                        "code of the class they were captured with. Set it back, or clear_graphs() and "
                        "capture_model() to capture the new one")

    def _submodule_attribute_changed(self) -> Fallback:
        where, new, old = self.attributes.first_change() or ("a submodule's attribute", _MISSING, _MISSING)
        return Fallback(
            Reason.ATTRIBUTE, f"attribute changed since capture: {self.name}.{where} = {show(new)} (was "
            f"{show(old)} at capture). Level-0 graphs bake the Python values forward read; set it back, or "
            "clear_graphs() and capture_model() to capture with the new value", ("attribute", where))

    def _training_changed(self) -> Fallback:
        change = self.flags.first_change()
        if change is None:
            return Fallback(Reason.TRAINING, "a submodule's training flag changed since capture")
        path, now, was = change
        where = f"{self.name}{'.' + path if path else ''}"
        return Fallback(
            Reason.TRAINING, f"{where} is in {'training' if now else 'eval'} mode; the graphs were captured "
            f"in {'training' if was else 'eval'} mode")

    def _conversions_changed(self) -> Optional[Fallback]:
        conversions = self.conversions
        counts = (conversions.count[0], self.registrations.count[0])
        if self.remade[0] == counts:
            return self.remade[1]
        now = self.adapter.tensor_fingerprint(self.model)  # (id, where and how the graphs read it, ...)
        if now == conversions.fingerprint:
            conversions.seen = conversions.count[0]  # another module's .to(), or one that changed nothing
            self.remade = (None, None)
            return None
        captured = {entry[0]: entry for entry in conversions.fingerprint}
        if all(captured.get(entry[0], entry) == entry for entry in now):
            # Only other objects than the captured ones: replaced by the user (put back, they replay again),
            # or made anew by the conversion (torch's _apply writes new buffers into _buffers, no
            # registration): not replayed while they are there, without telling the two apart
            self.remade = (counts, Fallback(
                Reason.CONVERTED, "the model's parameters or buffers are not the objects captured: "
                "a conversion (to(), half() ...) made new ones, or they were "
                "replaced; the graphs read the captured ones. Put those back, or "
                "clear_graphs() and capture_model() to capture the model as it is"))
            return self.remade[1]
        moved = {entry[0] for entry in now if captured.get(entry[0], entry) != entry}
        names = [f"{self.name}.{n}" for n, i in self.adapter.module_tensor_ids(self.model) if i in moved][:3]
        what = f"{', '.join(names)} {'was' if len(names) == 1 else 'were'}" if names else \
            "the model's parameters or buffers were"
        self.stale = Fallback(
            Reason.CONVERTED, f"{what} converted since capture (to(), half(), cpu() ..., or a parameter's .data "
            "assigned: keep the parameter objects and their memory, and copy_() new values in); the graphs read "
            "the old data. clear_graphs() and capture_model() again capture the converted model")
        return self.stale

    def _registrations_changed(self) -> Optional[Fallback]:
        registrations = self.registrations
        count = registrations.count[0]
        if self.replaced[0] == count:
            return self.replaced[1]
        now = self.adapter.module_tensor_ids(self.model)
        if now == registrations.ids:
            if self.watch_replacements and not self._as_captured():
                self.stale = Fallback(
                    Reason.REPLACED, "the memory or submodules of the model changed since capture although the "
                    "names hold objects with the captured ids (a tensor's .data replaced or set_() while "
                    "swapped out, a parametrization removed, or a freed object's id reused); the graphs "
                    "read the old memory. clear_graphs() and capture_model() capture the model as it is")
                return self.stale
            registrations.seen = count  # a registration elsewhere, or the captured objects put back
            self.replaced = (-1, None)
            return None
        before = dict(registrations.ids)
        names = registrations.names_changed(now)
        if not self.watch_replacements:
            # The static path reads a replaced parameter anew (its guards were kept off the tensors' metadata
            # for speed): only a tensor now gone (set to None, deleted) must not replay
            after = dict(now)
            names = [n for n in names if before.get(n) and not after.get(n)]
            if not names:
                registrations.seen = count
                return None
        what = ", ".join(f"{self.name}.{n}" for n in names[:3]) or "a submodule"
        self.replaced = (count, Fallback(
            Reason.REPLACED, f"{what} was replaced by a new object since capture (or added or "
            "removed); the graphs read the old one. Put the captured one back to "
            "replay again, or clear_graphs() and capture_model() to capture the "
            "new one"))
        return self.replaced[1]

    def _as_captured(self) -> bool:
        """The tensors at the captured addresses, dtypes and devices, and every submodule the very object
        captured: ids alone do not say it (a freed object's id is reused; .data and set_() keep the id)."""
        if self.adapter.tensor_fingerprint(self.model) != self.conversions.fingerprint:
            return False
        dicts = [d for _, d in self.adapter.module_dicts(self.model)]
        return len(dicts) == len(self.flags.dicts) and all(map(operator.is_, dicts, self.flags.dicts))


def _record_reads(model, names: set):
    """Until the returned function is called, the names of the attributes read on `model` through its
    class's __getattribute__ go into `names`. Dunder names are left out, but for `__dict__` read by model
    code (`vars(self)`, `self.__dict__[k]`): then every attribute counts (graph_opt's and the framework's
    own reads of it do not). Not seen: a read that skips the class's __getattribute__
    (`object.__getattribute__(self, k)`). Models of one class may capture in several threads at once:
    the class is wrapped once, while any of them records, and each model's reads go to its own set."""
    cls = type(model)
    with _recording_lock:
        recorders = _recording.get(cls)
        if recorders is None:
            recorders = _recording[cls] = ({}, cls.__dict__.get("__getattribute__"))
            cls.__getattribute__ = _reads_recorded(cls.__getattribute__, recorders[0], model_code())
        recorders[0][id(model)] = names

    def stop() -> None:
        with _recording_lock:
            recorders[0].pop(id(model), None)
            if not recorders[0]:
                del _recording[cls]
                if recorders[1] is None:
                    del cls.__getattribute__
                else:
                    cls.__getattribute__ = recorders[1]

    return stop


def _reads_recorded(base, by_model: dict, is_model_code):
    frame = sys._getframe

    def __getattribute__(self, name):
        names = by_model.get(id(self))
        if names is not None:
            if name[:2] != "__":
                names.add(name)
            elif name == "__dict__" and is_model_code(frame(1).f_code.co_filename):
                names.add(name)
        return base(self, name)

    return __getattribute__


_recording: Dict[type, tuple] = {}  # class -> ({id(model): its read names}, the class's own __getattribute__)
_recording_lock = threading.Lock()


def show(value) -> str:
    """One line: a short repr, else the start of a plain value's, else an object's type and identity
    (what level 0 compares it by; a config's repr is many lines, cut it said nothing)."""
    if value is _MISSING or value is GONE:
        return "(unset)"
    text = " ".join(repr(value).split())
    if len(text) <= 40:
        return text
    if isinstance(value, (str, bytes, int, float, tuple, list, dict, set)):
        return text[:37] + "..."
    return f"a {type(value).__name__} at 0x{id(value):x}"


class Unwatched:
    """The ModelState of a runner without a model to watch (a runner built directly, as tests do)."""

    captured = False
    paused = False
    watching = False

    def snapshot(self) -> None:
        pass

    def release(self) -> None:
        pass

    def check(self) -> None:
        return None

    def buffer_versions(self) -> list:
        return []

    def buffers(self) -> list:
        return []

    def held_state(self) -> "HeldState":
        return NOTHING_HELD

    def decorated_submodules(self) -> list:
        return []

    def hook_count(self) -> int:
        return 0

    def settle_hooks(self) -> bool:
        return False
