"""The identity checks of dict_reads.Reads that no dict write shows, compiled into one call of torch's C++
guard tree (the GuardManager Dynamo's own guards run on).

Each check is `this object's class / own __dict__ / attribute is that object`: an object's class
(`__class__` assignment writes no dict), a module's `__dict__`, a function's `__code__` or defaults, a
closure cell's contents, a class's `__mro__`. In Python each costs a call through map() (~50 ns); here one
leaf each, ~15 ns: a 12-layer GPT-2's 84 objects 5.2 -> 1.8 µs on a CPU. The C++ accessors read the fields
directly: a function's `__code__` raises no audit event (reading it in Python does, ~0.25 µs a read where
a library installed an audit hook).

Compiled from the values read just before a Python check that held (Reads._held), and held by the
checker, so that an id compared stays that object's. Where a piece of the API is missing (an older torch)
or the compiled tree does not hold at once, compile_identities answers None: Reads asks again at its next
Python check, and after three such answers in a row keeps its Python check.
"""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional, Sequence


def compile_identities(items: Sequence[tuple]) -> Optional[Callable[[], bool]]:
    """items: (object, kind, name, expected) with kind "class" (type(object) is expected), "dict" (its
    own __dict__ is expected) or "attr" (its attribute `name` is expected). A callable that is True while
    all hold, or None where they cannot be compiled."""
    try:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType
    except ImportError:  # pragma: no cover - torch without Dynamo's C++ guards
        return None
    manager = GuardManagerType.GUARD_MANAGER
    root = RootGuardManager()
    objects, slots = [], {}
    try:
        for obj, kind, name, expected in items:
            slot = slots.get(id(obj))
            if slot is None:
                slot = slots[id(obj)] = root.tuple_getitem_manager(len(objects), f"[{len(objects)}]", obj, manager)
                objects.append(obj)
            what = [f"{type(obj).__name__}: {kind} {name or ''}"]
            if kind == "class":
                slot.add_type_match_guard(id(expected), what, None)
            elif kind == "dict":
                slot.get_generic_dict_manager("__dict__", expected, manager).add_id_match_guard(id(expected), what, None)
            elif kind == "attr":
                _attribute(slot, obj, name, expected, manager).add_id_match_guard(id(expected), what, None) \
                    if expected is not None or name not in ("__defaults__", "__kwdefaults__") else \
                    slot.add_lambda_guard(functools.partial(_is_none, name), what, None)
            else:
                return None
    except (AttributeError, TypeError, RuntimeError):  # an accessor this torch lacks
        return None
    # the objects, then the expected values: held, so that every id compared stays that object's
    held = tuple(objects) + tuple(expected for _, _, _, expected in items)
    if not root.check(held):
        return None
    return functools.partial(root.check, held)


def _attribute(slot, obj, name: str, expected, manager):
    if name == "__code__" and type(obj) is types.FunctionType:
        return slot.code_manager("__code__", expected, manager)
    if name == "__defaults__" and type(obj) is types.FunctionType:
        return slot.func_defaults_manager("__defaults__", expected, manager)
    if name == "__kwdefaults__" and type(obj) is types.FunctionType:
        return slot.func_kwdefaults_manager("__kwdefaults__", expected, manager)
    if name == "__mro__" and isinstance(obj, type):
        return slot.type_mro_manager("__mro__", expected, manager)
    if name == "cell_contents" and type(obj) is types.CellType:
        return slot.getattr_manager(name, name, expected, manager)
    return slot.generic_getattr_manager(name, name, expected, manager)  # object.__getattribute__, as Reads reads


def _is_none(name: str, fn) -> bool:
    return getattr(fn, name) is None
