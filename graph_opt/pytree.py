"""Flatten nested dict/list/tuple/dataclass structures into tensor leaves and a hashable spec.

Containers walked: tuple, list, dict and its subclasses (OrderedDict, defaultdict), namedtuple, and
dataclass objects (their fields and any other attribute they hold; a Hugging Face ModelOutput, a
dataclass and an OrderedDict at once, is rebuilt with its items). The spec holds every non-tensor value, so two calls share a spec only when their non-tensor
arguments are the same (value_key: same type and value): the spec is the non-tensor part of the
dispatch key.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

TENSOR = "<tensor>"  # the spec of a tensor leaf


class _ById:
    """Wraps an unhashable non-tensor value: it matches only the very same object."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _ById) and other.obj is self.obj

    def __repr__(self):
        return f"<{type(self.obj).__name__} object by identity>"


def value_key(value):
    """A hashable key that two values share only when a replay may treat them as the same: of the same
    type and equal, so that 1, 1.0 and True differ (they select different dtypes), as do 0.0 and -0.0
    (1 / x tells them apart); NaN equals NaN. Unhashable values match only the very same object."""
    kind = type(value)
    if kind is float:
        return (kind, value.hex())
    try:
        hash(value)
    except TypeError:
        return (kind, _ById(value))
    if kind is complex:
        return (kind, value.real.hex(), value.imag.hex())
    return (kind, value)


def strict_key(value):
    """value_key, element by element through tuples, lists and dicts: (1,) and (1.0,) differ, as do
    (0.0,) and (-0.0,)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind, tuple(map(strict_key, value)))
    if kind is dict:
        return (kind, tuple((k, strict_key(v)) for k, v in value.items()))
    return value_key(value)


class _Const:
    """A non-tensor value in a spec: equal to another only by value_key (1 and 1.0 differ, NaN matches NaN)."""

    __slots__ = ("value", "key")

    def __init__(self, value, key):
        self.value = value
        self.key = key

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Const) and other.key == self.key

    def __repr__(self):
        return repr(self.value)


def _constant(value):
    key = value_key(value)
    if isinstance(key[1], _ById):
        return ("o", key[1])
    return ("c", _Const(value, key))


def flatten(obj: Any, is_tensor: Callable[[Any], bool]) -> Tuple[List[Any], Any]:
    leaves: List[Any] = []
    return leaves, _walk(obj, is_tensor, leaves)


# Module-level recursion, not a closure: a closure that calls itself is a reference cycle, and it would
# keep every call's tensors alive until the next garbage collection (which capture holds off).
def _walk(x, is_tensor, leaves):
    if is_tensor(x):
        leaves.append(x)
        return TENSOR
    kind = type(x)
    if kind is tuple:
        return ("t", tuple(_walk(v, is_tensor, leaves) for v in x))
    if kind is list:
        return ("l", tuple(_walk(v, is_tensor, leaves) for v in x))
    if kind is dict:
        keys = tuple(x)
        return ("d", keys, tuple(_walk(x[k], is_tensor, leaves) for k in keys))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return ("n", kind, tuple(_walk(v, is_tensor, leaves) for v in x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = _attribute_names(x)
        return ("dc", kind, names, tuple(_walk(getattr(x, n), is_tensor, leaves) for n in names))
    if isinstance(x, dict):  # OrderedDict, defaultdict, ...: their items, as a plain dict's
        keys = tuple(x)
        return ("D", kind, keys, tuple(_walk(x[k], is_tensor, leaves) for k in keys))
    return _constant(x)


def _attribute_names(x) -> tuple:
    """A dataclass object's fields, then any other attribute it holds (one set in __post_init__): a
    replay must see every value the object carries, not the first call's."""
    names = [f.name for f in dataclasses.fields(x)]
    held = getattr(x, "__dict__", None)
    if held:
        names += sorted(k for k in held if k not in names)
    return tuple(names)


def unflatten(spec: Any, leaves: List[Any], template: Any = None) -> Any:
    """Rebuild the structure. Dataclass nodes are shallow copies of `template`'s objects."""
    return _build(spec, iter(leaves), template)


def _build(s, it, tmpl):
    if s is TENSOR:
        return next(it)
    tag = s[0]
    if tag == "c":
        return s[1].value
    if tag == "o":
        return s[1].obj
    if tag == "t":
        return tuple(_build(c, it, _child(tmpl, i)) for i, c in enumerate(s[1]))
    if tag == "l":
        return [_build(c, it, _child(tmpl, i)) for i, c in enumerate(s[1])]
    if tag == "d":
        return {k: _build(c, it, _child(tmpl, k)) for k, c in zip(s[1], s[2])}
    if tag == "n":
        return s[1](*(_build(c, it, _child(tmpl, i)) for i, c in enumerate(s[2])))
    if tag == "dc":
        if tmpl is None:
            raise ValueError("rebuilding a dataclass needs a template object")
        obj = copy.copy(tmpl)
        for name, c in zip(s[2], s[3]):
            object.__setattr__(obj, name, _build(c, it, getattr(tmpl, name, None)))
        if isinstance(obj, dict):
            # A dataclass that is also a mapping (a Hugging Face ModelOutput): its items are its
            # non-None fields, and indexing (out[0], out["logits"]) reads them, not the attributes.
            for key in list(obj.keys()):
                obj[key] = getattr(obj, key)
        return obj
    if tag == "D":
        values = [_build(c, it, _child(tmpl, k)) for k, c in zip(s[2], s[3])]
        obj = copy.copy(tmpl) if tmpl is not None else s[1]()
        obj.clear()
        obj.update(zip(s[2], values))
        return obj
    raise ValueError(f"bad spec node {s!r}")


def _child(tmpl, key):
    if tmpl is None:
        return None
    if dataclasses.is_dataclass(tmpl):
        return getattr(tmpl, key, None)
    if isinstance(tmpl, dict):
        return tmpl.get(key)
    if isinstance(tmpl, (list, tuple)):
        return tmpl[key] if key < len(tmpl) else None
    return None


def tensor_leaf_owners(spec: Any) -> List[Any]:
    """For a spec of `(args, kwargs)`: the top-level owner of each tensor leaf, an int position or a kwarg name."""
    owners: List[Any] = []

    def walk(s, owner):
        if s is TENSOR:
            owners.append(owner)
            return
        tag = s[0]
        if tag in ("t", "l"):
            for c in s[1]:
                walk(c, owner)
        elif tag == "n":
            for c in s[2]:
                walk(c, owner)
        elif tag == "d":
            for c in s[2]:
                walk(c, owner)
        elif tag in ("dc", "D"):
            for c in s[3]:
                walk(c, owner)

    args_spec, kwargs_spec = spec[1]
    for i, c in enumerate(args_spec[1]):
        walk(c, i)
    for k, c in zip(kwargs_spec[1], kwargs_spec[2]):
        walk(c, k)
    return owners


def leaf_paths(spec: Any, root: str = "output") -> List[Tuple[str, Any]]:
    """(path, leaf) for every leaf of a spec in flatten order: leaf is TENSOR for a tensor, else the
    constant's node (compare with ==). Paths read like code: output['y'], output[0], output.field."""
    out: List[Tuple[str, Any]] = []

    def walk(s, path):
        if s is TENSOR:
            out.append((path, TENSOR))
            return
        tag = s[0]
        if tag in ("c", "o"):
            out.append((path, s[1]))
        elif tag in ("t", "l"):
            for i, c in enumerate(s[1]):
                walk(c, f"{path}[{i}]")
        elif tag == "n":
            for name, c in zip(s[1]._fields, s[2]):
                walk(c, f"{path}.{name}")
        elif tag == "d":
            for k, c in zip(s[1], s[2]):
                walk(c, f"{path}[{k!r}]")
        elif tag == "D":
            for k, c in zip(s[2], s[3]):
                walk(c, f"{path}[{k!r}]")
        elif tag == "dc":
            for name, c in zip(s[2], s[3]):
                walk(c, f"{path}.{name}")

    walk(spec, root)
    return out


def objects_holding_tensors(tree: Any, is_tensor: Callable[[Any], bool]) -> List[str]:
    """Paths of the values in `tree` that it keeps as constants (objects it cannot rebuild, as a
    torch.distributions object) although they hold tensors among their attributes: a replay would hand
    back the capture's object and its tensors, not this call's."""
    found = []
    for path, node in leaf_paths(flatten(tree, is_tensor)[1]):
        if node is TENSOR:
            continue
        obj = node.obj if isinstance(node, _ById) else node.value
        if holds_tensor(obj, is_tensor, 3):
            found.append(f"{path} (a {type(obj).__name__} object)")
    return found


def tensor_paths(spec: Any, root: str = "output") -> List[str]:
    """The paths of a spec's tensor leaves, in flatten order."""
    return [path for path, node in leaf_paths(spec, root) if node is TENSOR]


def holding_tensors_message(held: List[str], when: str) -> str:
    """The capture error for objects_holding_tensors' findings; `when`: "call" or "step"."""
    if any("Cache object)" in h for h in held):  # transformers' DynamicCache: returned unless asked not to
        return (f"forward returns {', '.join(held)}: a Hugging Face model's key/value cache, holding this {when}'s "
                "tensors, which a replay cannot rebuild. Call the model with use_cache=False"
                + (" (a training step rarely uses the cache)" if when == "step" else
                   ", or keep the cache in tensors the forward takes and updates in place") +
                ", and return only the tensors you use (out.loss, out.logits)")
    return (f"forward returns {', '.join(held)}: an object graph_opt cannot rebuild, holding tensors; a replay "
            f"would return the capture's object and its tensors, not this {when}'s. Return the tensors (a "
            "torch.distributions object's logits; a Hugging Face model's cache object goes with use_cache=False), "
            "or a dict, tuple or dataclass of them")


def holds_tensor(obj, is_tensor, depth: int) -> bool:
    """Whether obj is a tensor, or a tensor is among its attributes (in __dict__ or __slots__), or in the
    lists, tuples, deques, dicts and objects they hold, `depth` levels down."""
    if depth < 0:
        return False
    if is_tensor(obj):
        return True
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return any(holds_tensor(v, is_tensor, depth - 1) for v in obj)
    if isinstance(obj, dict):
        return any(holds_tensor(v, is_tensor, depth - 1) for v in obj.values())
    if isinstance(obj, (str, bytes, int, float, complex, type)) or obj is None:
        return False
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name) and name not in ("__dict__", "__weakref__"):
                values.append(getattr(obj, name))
    return any(holds_tensor(v, is_tensor, depth - 1) for v in values)


def shallow_copier(tree: Any, fresh: Optional[Callable[[Any], Optional[Callable[[], Any]]]] = None) -> Any:
    """A function returning `tree` with every container a caller could change (dict, list, a dataclass
    or Hugging Face ModelOutput object) a new one, the leaves shared; None where `tree` holds no such
    container (a tensor, a tuple of them). A replay returns its stored outputs through it: a caller that
    changes one call's dict must not change the next call's. `fresh(leaf)` may give a function making a
    new object for that leaf at every call (handed_outputs.py), or None to share it."""
    return _copier(tree, fresh)


def _copier(x, fresh=None):
    kind = type(x)
    if kind is tuple or (isinstance(x, tuple) and hasattr(x, "_fields")):
        parts = [_copier(v, fresh) for v in x]
        if not any(parts):
            return None
        make = tuple if kind is tuple else (lambda values, _kind=kind: _kind(*values))
        return lambda: make([p() if p else v for p, v in zip(parts, x)])
    if kind is list:
        parts = [_copier(v, fresh) for v in x]
        return lambda: [p() if p else v for p, v in zip(parts, x)]
    if kind is dict:
        parts = {k: _copier(v, fresh) for k, v in x.items()}
        if not any(parts.values()):
            return x.copy
        return lambda: {k: (p() if p else x[k]) for k, p in parts.items()}
    if isinstance(x, collections.OrderedDict) or (dataclasses.is_dataclass(x) and not isinstance(x, type)) \
            or isinstance(x, dict):
        return _object_copier(x, fresh)
    return None if fresh is None else fresh(x)


def _object_copier(x, fresh=None):
    """A dict subclass or dataclass object: a new one of its class with its items and attributes; the
    ones that are containers themselves copied too. An OrderedDict subclass (a ModelOutput) is built
    directly (copy.copy of one costs 17 us); any other (a defaultdict, a slotted dataclass) is copied
    with copy.copy, then its containers replaced."""
    kind = type(x)
    items = list(x.items()) if isinstance(x, dict) else []
    held = getattr(x, "__dict__", None)
    if held is not None:
        attrs = dict(held)
    elif dataclasses.is_dataclass(x):
        attrs = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    else:
        attrs = {}
    item_parts = [(k, _copier(v, fresh), v) for k, v in items]
    attr_parts = [(k, _copier(v, fresh), v) for k, v in attrs.items()]
    if not isinstance(x, collections.OrderedDict) or held is None:
        def make_copy():
            new = copy.copy(x)
            made = {}
            for k, p, _ in item_parts:
                if p is not None:
                    made[k] = p()
                    dict.__setitem__(new, k, made[k])
            for k, p, v in attr_parts:
                if p is not None:
                    object.__setattr__(new, k, made[k] if k in made and v is x.get(k) else p())
            return new

        return make_copy

    set_item = collections.OrderedDict.__setitem__

    def make():
        new = kind.__new__(kind)
        made = {}
        for k, p, v in item_parts:
            value = made[k] = p() if p else v
            set_item(new, k, value)
        state = new.__dict__
        for k, p, v in attr_parts:
            if p is None:
                state[k] = v
            else:  # the same object as the item of that name (a ModelOutput field) stays the same object
                state[k] = made[k] if k in made and v is x.get(k) else p()
        return new

    return make
