"""A guard's source, walked as dict reads: where Dynamo's guard reads an object that graph_opt can find
again by dict reads alone, the guard can leave Dynamo's tree for dict_reads.Reads (guard_reads.py).

Sources are Dynamo's names with the frame's locals plain: `self._modules['lm'].config`,
`G['__import_torch'].fx.Proxy` (the forward's globals), `dict(type(X).__mro__[1].__dict__)['k']` (a
class's dict), `object.__getattribute__(X, '__dict__')` (an object's own dict). A step is taken when
the object it reaches is fixed by dicts (an instance's or a module's __dict__, a class's own dict, a
plain dict or OrderedDict) and by what is recorded besides (the walked objects' classes, the classes'
__mro__, the objects' __dict__s themselves): anything else (a property, a __getattr__, a function's
__code__ or closure, a list) leaves the guard with Dynamo. The forward's globals are not walked when
they are a script's (`__main__`: its own loop writes them at every step).
"""
from __future__ import annotations

import ast
import collections
import gc
import sys
import types
from typing import Any, List, NamedTuple, Optional

import torch

_OWN = __name__.partition(".")[0] + "."  # graph_opt's modules
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: instances of other classes cannot have __class__ assigned


class Walked(NamedTuple):
    hops: List[tuple]  # (where, dict, key, object read there)
    obj: Any
    owners: List[tuple]  # (where, object, its own __dict__, name read) of every instance read through
    classes: List[tuple]  # (where, object, its class) of every object whose class a step went by
    pinned: List[tuple]  # (where, class, "__mro__", mro)
    absent: List[tuple]  # (where, dict, name) of a name a class attribute's read went past


class _NotWalked(Exception):
    pass


def walk(name: str, model, f_globals: dict, identity=frozenset()) -> Optional[Walked]:
    """The dict reads that find the object at Dynamo's source `name`, or None where a step is not one.
    `identity`: the sources whose object Dynamo guards by identity. The hops compare each object on the
    way by identity; a global of the forward's module or of another module, rebound at every call to
    another object of its class (a request object) or to an equal tuple, passes Dynamo's guards, so no
    walk goes through one that Dynamo does not hold by identity (rebinds)."""
    try:
        tree = ast.parse(name, mode="eval").body
    except SyntaxError:
        return None
    out = Walked([], None, [], [], [], [])
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    try:
        obj, _ = _step(tree, model, f_globals if f_globals is not main else None, out, (identity, tree))
    except (_NotWalked, AttributeError, KeyError, IndexError, TypeError):
        return None
    return out._replace(obj=obj)


_TENSOR_SLOTS = frozenset({"_modules", "_parameters", "_buffers"})  # shown as `lm.head.weight`


def _step(node, model, f_globals, out, seen):
    """(object, where) at node."""
    if isinstance(node, ast.Name) and node.id == "self":
        return model, ""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key = node.slice.value
        if isinstance(node.value, ast.Name) and node.value.id == "G":
            if f_globals is None or key not in f_globals:
                raise _NotWalked
            value = f_globals[key]
            if rebindable(key, value, seen[0]) and node is not seen[1]:
                raise _NotWalked  # a step through it would hold the object, where Dynamo holds its class
            where = "global " + _global_name(key)
            out.hops.append((where, f_globals, key, value))
            return value, where
        base, where = _step(node.value, model, f_globals, out, seen)
        if type(base) is tuple:  # a class's __mro__ (pinned): immutable
            return base[key], f"{where}[{key!r}]"
        if type(base) not in (dict, collections.OrderedDict) or key not in base:
            raise _NotWalked
        value = base[key]
        slot = isinstance(node.value, ast.Attribute) and node.value.attr in _TENSOR_SLOTS
        where = f"{where}.{key}" if slot else f"{where}[{key!r}]"
        out.hops.append((where.lstrip("."), base, key, value))
        return value, where
    if isinstance(node, ast.Attribute):
        base, where = _step(node.value, model, f_globals, out, seen)
        if node.attr in _TENSOR_SLOTS:
            return _attribute(base, node.attr, f"{where}.{node.attr}".lstrip("."), out), where
        value = _attribute(base, node.attr, f"{where}.{node.attr}".lstrip("."), out)
        if isinstance(base, types.ModuleType) and node is not seen[1] and ast.unparse(node) not in seen[0] and \
                rebinds(value):
            raise _NotWalked  # another module's object, which it may rebind: only where Dynamo holds it by identity
        return value, f"{where}.{node.attr}"
    if isinstance(node, ast.Call) and not node.keywords:
        func = ast.unparse(node.func)
        if func == "type" and len(node.args) == 1:
            base, where = _step(node.args[0], model, f_globals, out, seen)
            _classed(base, where, out)
            return type(base), f"type({where})"
        if func == "dict" and len(node.args) == 1 and isinstance(node.args[0], ast.Attribute) \
                and node.args[0].attr == "__dict__":
            base, where = _step(node.args[0].value, model, f_globals, out, seen)
            if not isinstance(base, type):
                raise _NotWalked
            return _class_dict(base), f"{where}.__dict__"
        if func == "object.__getattribute__" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
            base, where = _step(node.args[0], model, f_globals, out, seen)
            attr = node.args[1].value
            own = own_dict(base)
            if own is None:
                raise _NotWalked
            out.owners.append((where.lstrip("."), base, own, attr))
            _classed(base, where, out)
            if attr == "__dict__":
                return own, f"{where}.__dict__"
            if data_descriptor(type(base), attr):
                raise _NotWalked
            at = f"{where}.{attr}".lstrip(".")
            if attr in own:
                out.hops.append((at, own, attr, own[attr]))
                return own[attr], f"{where}.{attr}"
            return _class_attribute(base, own, attr, at, out), f"{where}.{attr}"
    raise _NotWalked


def _attribute(obj, attr: str, where: str, out):
    if attr == "__mro__" and isinstance(obj, type):
        out.pinned.append((where, obj, "__mro__", obj.__mro__))
        return obj.__mro__
    if type(obj) is types.MethodType and attr in ("__self__", "__func__"):
        return getattr(obj, attr)  # read-only
    if type(obj) is property and attr in ("fget", "fset", "fdel"):
        value = getattr(obj, attr)  # a property's getter (torch 2.12+ guards its code): property.__init__ run
        out.pinned.append((where, obj, attr, value))  # again sets it anew, so it is compared by identity
        return value
    # __code__, __closure__, __defaults__, __dict__ ...: Dynamo reads those itself. A class's own `__call__` is a
    # plain entry of its dict (its metaclass's data descriptors are refused below).
    if attr.startswith("__") and attr.endswith("__") and not (isinstance(obj, type) and attr in _class_dict(obj)):
        raise _NotWalked
    place = where.rpartition(".")[0]  # obj's
    if isinstance(obj, types.ModuleType):
        if obj.__name__.startswith(_OWN):
            raise _NotWalked  # graph_opt's own state (the split hook): the check sets it as at the trace
        if type(obj).__getattribute__ is not types.ModuleType.__getattribute__ or attr not in obj.__dict__ \
                or data_descriptor(type(obj), attr):
            raise _NotWalked
        d = obj.__dict__
    elif isinstance(obj, type):
        d = _class_dict(obj)
        if type(obj).__getattribute__ is not type.__getattribute__ or attr not in d \
                or data_descriptor(type(obj), attr):
            raise _NotWalked
    else:
        d = own_dict(obj)
        if d is None or attr not in d or data_descriptor(type(obj), attr):
            raise _NotWalked
        out.owners.append((place, obj, d, attr))
    _classed(obj, place, out)
    value = d[attr]
    out.hops.append((where, d, attr, value))
    return value


def _class_attribute(obj, own: dict, attr: str, where: str, out):
    """A plain class attribute read through obj (object.__getattribute__): absent from obj's __dict__ and
    from every class before the one that holds it (one set there later would be read instead)."""
    cls = type(obj)
    out.pinned.append((f"{where} (the MRO of {cls.__name__})", cls, "__mro__", cls.__mro__))
    out.absent.append((where, own, attr))
    for klass in cls.__mro__:
        d = _class_dict(klass)
        if attr in d:
            value = d[attr]
            if hasattr(type(value), "__get__") and \
                    not isinstance(value, (types.FunctionType, classmethod, staticmethod)):
                raise _NotWalked  # a descriptor's __get__ runs Python
            out.hops.append((f"{where} (on class {klass.__name__})", d, attr, value))
            return getattr(obj, attr) if isinstance(value, (types.FunctionType, classmethod)) else value
        out.absent.append((f"{where} (set on class {klass.__name__})", d, attr))
    raise _NotWalked


def evaluate(source: str, **names) -> Any:
    """Dynamo's source expression evaluated as its guards would (its helper functions in scope), with
    `names` bound (G: the forward's globals; L or self: the frame's locals or the model). Raises what the
    expression raises."""
    helpers = getattr(torch._dynamo.guards, "_CLOSURE_VARS", None) or {}  # made at Dynamo's first guards
    return eval(source, dict(helpers, **names))  # noqa: S307


def rebindable(key: str, value, identity) -> bool:
    """A global of the forward's module that a server may rebind at every call to another object of its
    class (a request object, an equal tuple or dict) and that Dynamo holds to its class or contents only:
    no step goes through it, and a guard on it stays with Dynamo unless it compares a plain value."""
    return not key.startswith(("__import_", "__builtins_dict")) and f"G[{key!r}]" not in identity and rebinds(value)


def rebinds(value) -> bool:
    """An object a module may bind anew to another of its kind: an instance, a plain tuple, dict or list
    (not a module, class or function, nor a subclass of tuple or dict)."""
    return type(value) in (dict, tuple, list, collections.OrderedDict) or not isinstance(
        value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, dict, tuple))


def class_can_change(obj) -> bool:
    """Whether `obj.__class__ = other` is possible: for instances of Python classes and for modules."""
    return bool(type(obj).__flags__ & _HEAP_TYPE) or isinstance(obj, types.ModuleType)


def _classed(obj, where: str, out) -> None:
    # The model's submodules' classes are compared at every replay by the model-state check.
    if class_can_change(obj) and not isinstance(obj, torch.nn.Module):
        out.classes.append((f"{where}.__class__".lstrip("."), obj, type(obj)))


def real_dict(mapping) -> Optional[dict]:
    """The dict itself: a class's mappingproxy refers to its class's dict alone; None for another mapping."""
    if type(mapping) in (dict, collections.OrderedDict):
        return mapping
    inner = gc.get_referents(mapping) if type(mapping) is types.MappingProxyType else ()
    return inner[0] if len(inner) == 1 and type(inner[0]) is dict else None


def _class_dict(cls) -> dict:
    d = real_dict(vars(cls))
    if d is None:
        raise _NotWalked
    return d


def own_dict(obj) -> Optional[dict]:
    """The object's own __dict__ (not through its class's __getattribute__), where it is a plain dict."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None
    return d if type(d) is dict else None


def data_descriptor(cls, name: str) -> bool:
    """A class attribute that a read of the instance's name goes through (a property, a slot)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            kind = type(vars(klass)[name])
            return hasattr(kind, "__set__") or hasattr(kind, "__delete__")
    return False


def _global_name(key: str) -> str:
    """`__import_transformers_dot_masking_utils` as `transformers.masking_utils`."""
    if key.startswith("__import_"):
        return key[len("__import_"):].replace("_dot_", ".")
    return key
