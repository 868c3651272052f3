"""What a replay checks of the frames SOT hands back instead of running SOT's own guard pass: each
frame's non-tensor arguments (FrameArguments: by identity, else by content), and SOT's guard function
of the translation, with graph_opt's capture flags as at capture (the first failing term names what
changed).
"""
from __future__ import annotations

import enum
import types
from typing import Any, Dict, List

import paddle
from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache

from ...errors import ReplayDivergence
from ...guards import as_captured
from ...pytree import value_key


class _FrameView:
    """What SOT's guard functions read of a frame (f_locals, f_globals), for a check before a replay."""

    __slots__ = ("f_locals", "f_globals", "f_code", "f_builtins")

    def __init__(self, f_locals, f_globals, f_code):
        self.f_locals = f_locals
        self.f_globals = f_globals
        self.f_code = f_code
        self.f_builtins = f_globals.get("__builtins__", {})


def _guard_of(code, custom):
    """SOT's guard function of the translation it handed back for `code` (None if not found)."""
    entry = OpcodeExecutorCache().cache.get(code)
    if entry is None:
        return None
    return next((guard for translated, guard in entry[0] if translated is custom), None)


def _failed_guard(guard, frame) -> str:
    """The first failing term of a SOT guard, as SOT's own cache miss analysis finds it."""
    text = getattr(guard, "inlined_expr", None) or getattr(guard, "expr", "")
    head = "lambda frame: "
    failing = "a guard of SOT's translation"
    for term in text.replace(head, "", 1).split(" and "):
        try:
            ok = as_captured(eval(head + term, guard.__globals__), frame)
        except Exception:  # noqa: BLE001 - a term that needs an earlier one: keep looking
            continue
        if ok is False:
            failing = f"`{term.strip()}`"
            break
    why = f"Python state the forward read changed since capture: SOT's guard {failing} fails"
    name = failing.rstrip("`").rpartition(" == ")[2]
    captured = guard.__globals__.get(name) if name.startswith("__object") else None
    if getattr(captured, "__dict__", None) is not None and not isinstance(captured, _BY_IDENTITY):
        why += (f": the frame got another {type(captured).__name__} object than at capture, and found none to compare "
                f"by content (an object the forward builds at every call is compared by content where it is a "
                f"frame's argument, or within {_CONTENT_DEPTH} levels of one). Build it outside forward and keep "
                "it, or pass its tensors")
    return why


_VALUE_TYPES = (bool, int, float, str, bytes, type(None))
# Made afresh at every call, and wholly described by their value: by identity they never match a
# capture (paddle.finfo(dtype).min and outputs[1:] on the stack at a graph break, in PaddleFormers).
_INFO_TYPES = (type(paddle.finfo(paddle.float32)), type(paddle.iinfo(paddle.int32)))
# Kept by identity even where the arguments are compared by content: a model's layers (large, and
# alive across calls), and what code is made of.
_BY_IDENTITY = (paddle.nn.Layer, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                types.CodeType)
_CONTENT_DEPTH, _CONTENT_OBJECTS = 6, 64


_NO_VALUE = ("slot not set",)


def _slot_values(value):
    """name -> value of the __slots__ of value's Python classes (an unset slot: _NO_VALUE); None where
    none of them declares any (a type of C code: a Place, a dtype)."""
    names = []
    for klass in type(value).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):  # `__x` is stored as `_Class__x`
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    names = [name for name in dict.fromkeys(names) if name not in ("__dict__", "__weakref__")]
    if not names:
        return None
    return {name: getattr(value, name, _NO_VALUE) for name in names}


def _argument_values(frame):
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    local_values = frame.f_locals
    return code.co_varnames[:count], [local_values.get(name) for name in code.co_varnames[:count]]


def _value_key(value, depth=0):
    """A non-tensor argument of a frame: plain values by value, other objects by identity, containers
    walked, tensors skipped (their shapes are checked where the graph reads them)."""
    if isinstance(value, paddle.Tensor):
        return None
    if isinstance(value, _VALUE_TYPES):
        return value_key(value)  # 1, 1.0 and True differ; so do 0.0 and -0.0
    if depth < 4 and isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_value_key(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return ("dict",) + tuple((k, _value_key(v, depth + 1)) for k, v in value.items())
    if isinstance(value, slice):
        return ("slice", _value_key(value.start, depth + 1), _value_key(value.stop, depth + 1),
                _value_key(value.step, depth + 1))
    if isinstance(value, _INFO_TYPES):
        return (type(value).__name__, str(value))  # dtype, bits, min, max...
    return ("id", id(value))


class _Content:
    """The content key of a frame's arguments: as _value_key, but an object other than a layer, a class
    or a function is its type and its attributes' keys, walked (a KV-cache object the forward builds at
    every call holds the same values in the same structure, and other tensors). Each such object is
    numbered as first met, so that two arguments that were one object at capture must be one object
    again; `objects` are they, in that order."""

    __slots__ = ("objects", "numbers", "budget")

    def __init__(self):
        self.objects: List[Any] = []
        self.numbers: Dict[int, int] = {}
        self.budget = _CONTENT_OBJECTS

    def key(self, value, depth=0):
        if isinstance(value, paddle.Tensor):
            return None
        if isinstance(value, _VALUE_TYPES):
            return value_key(value)
        if depth >= _CONTENT_DEPTH or isinstance(value, _BY_IDENTITY):
            return ("id", id(value))
        if isinstance(value, (tuple, list)):
            return (type(value).__name__,) + tuple(self.key(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return ("dict",) + tuple((k, self.key(v, depth + 1)) for k, v in value.items())
        if isinstance(value, types.MethodType):  # a new object at every attribute read
            return ("method", id(value.__func__), self.key(value.__self__, depth + 1))
        if isinstance(value, (slice,) + _INFO_TYPES):
            return _value_key(value)
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            # An object of a class with __slots__ (a dataclass(slots=True)) is walked as one with a
            # __dict__: its own __eq__ would compare the tensors it holds, by value, and raise.
            attributes = _slot_values(value)
        if attributes is None or isinstance(value, enum.Enum):
            return ("eq", value_key(value))  # a Place, a dtype: equal by their own __eq__ (else identity)
        if self.budget <= 0:
            return ("id", id(value))
        number = self.numbers.get(id(value))
        if number is not None:
            return ("same as", number)
        self.numbers[id(value)] = len(self.objects)
        self.objects.append(value)
        self.budget -= 1
        return (type(value), tuple((name, self.key(v, depth + 1)) for name, v in attributes.items()))


class FrameArguments:
    """What a replay checks of a frame's non-tensor arguments before running SOT's translation of it,
    taken as SOT was asked for the frame at capture. By identity first (_value_key), as cheap as
    that is; where an object is not the one captured, by content (_Content): an object the forward
    makes at every call (a KV cache built from the cache tensors) is never the captured one, and its
    translation holds for another object of the same type and content. SOT's guard of the translation
    compares such an object by identity too (`x == __object_7`): it is evaluated with the objects of
    this call in place of the captured ones, met at the same place of the arguments; its other terms
    (attributes read, shapes) are checked as they are."""

    __slots__ = ("names", "key", "content", "held", "guard", "slots")

    def __init__(self, frame, guard):
        self.names, values = _argument_values(frame)
        self.key = tuple(_value_key(v) for v in values)
        walk = _Content()
        self.content = tuple(walk.key(v) for v in values)
        # the ids in `key` stay these objects' while the capture lives (a per-call object freed at once
        # could leave its id to the next call's)
        self.held = [v for v in values if not isinstance(v, paddle.Tensor)]
        self.guard = guard
        numbers = {id(o): i for i, o in enumerate(walk.objects)}
        globals_ = getattr(guard, "__globals__", {})
        self.slots = [(name, numbers[id(v)]) for name, v in globals_.items() if id(v) in numbers]

    def guard_for(self, frame):
        """SOT's guard to evaluate for this frame, with this call's objects where the captured ones were;
        raises ReplayDivergence naming the argument where the arguments differ."""
        names, values = _argument_values(frame)
        if tuple(_value_key(v) for v in values) == self.key:
            return self.guard
        walk = _Content()
        content = tuple(walk.key(v) for v in values)
        if content != self.content:
            raise ReplayDivergence(self._difference(frame.f_code, values, content))
        if self.guard is None or not self.slots:
            return self.guard
        return _rebound(self.guard, {name: walk.objects[i] for name, i in self.slots})

    def _difference(self, code, values, content) -> str:
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        for name, value, now, then in zip(self.names, values, content, self.content):
            if now == then:
                continue
            held = _object_in(value)
            if held is None:
                return (f"{where} got another non-tensor argument than at capture: {name}={value!r:.80} "
                        "(computed otherwise than at capture: from a model attribute, or by a branch on a tensor's "
                        "value)")
            what = type(value).__name__ if held is value else f"{type(value).__name__} holding a {type(held).__name__}"
            return (f"{where} got another `{name}` than at capture: a {what} whose "
                    "non-tensor contents or structure differ (an object the forward builds at every call is "
                    f"compared by content, within {_CONTENT_DEPTH} levels and {_CONTENT_OBJECTS} objects: "
                    "build it from the same Python values, or pass its tensors)")
        return f"{where} got other non-tensor arguments than at capture"


def _object_in(value, depth=0):
    """value, or the first object within its tuples, lists and dicts, that is neither a tensor nor a plain
    value (what _Content walks by its attributes); None where there is none."""
    if isinstance(value, (paddle.Tensor, slice) + _VALUE_TYPES + _INFO_TYPES + _BY_IDENTITY):
        return None
    if isinstance(value, (tuple, list, dict)):
        if depth >= _CONTENT_DEPTH:
            return None
        items = value.values() if isinstance(value, dict) else value
        return next((o for o in (_object_in(v, depth + 1) for v in items) if o is not None), None)
    return value


def _rebound(guard, objects):
    """`guard` reading `objects` in place of the free variables of the same names."""
    globals_ = dict(guard.__globals__)
    globals_.update(objects)
    fn = types.FunctionType(guard.__code__, globals_, guard.__name__, guard.__defaults__, guard.__closure__)
    for name in ("inlined_expr", "expr"):
        if hasattr(guard, name):
            setattr(fn, name, getattr(guard, name))
    return fn


class KnownTranslations:
    """The capture phase's translations of frames, found again by content: SOT compares an object the
    forward makes at every call by identity and would translate its frames again at every warmup and
    capture (each translation keeping that call's object alive in its cache, up to its limit of 20 per
    code, past which SOT leaves the frame to plain Python)."""

    def __init__(self):
        self.by_code: Dict[Any, List[Any]] = {}

    def find(self, frame):
        """(an earlier translation of this frame whose guard holds for it, with this call's objects; that
        guard, reading them), or (None, None)."""
        for arguments, custom in self.by_code.get(frame.f_code, ()):
            try:
                guard = arguments.guard_for(frame)
                if guard is not None and guard(frame):
                    return custom, guard
            except Exception:  # noqa: BLE001 - other arguments, or a guard that cannot read them: not this one
                continue
        return None, None

    def add(self, frame, custom, arguments) -> None:
        if arguments.slots:  # its guard compares an object by identity: SOT's own lookup would miss it
            self.by_code.setdefault(frame.f_code, []).append((arguments, custom))

    def clear(self) -> None:
        self.by_code.clear()
