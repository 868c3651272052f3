"""Call signatures: one per call structure (its non-tensor argument values, where its tensors are).

Signature holds a structure's static buffers, padding, output layout and captured sizes.
SignatureTable, a runner's (runner.py), holds its signatures, makes them from calls and holds the checks
and error texts of calls that do not fit them: wrong rank or dtype, batch dimensions that disagree,
arguments a level-0 replay cannot check, new values after capture. All of it is off the hot path.
"""
from __future__ import annotations

import collections.abc
import enum
import functools
import inspect
import itertools
import types
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from . import output_layout
from .static_address import overlaps
from ..errors import GraphOptConfigError, GraphOptInputError
from ..watch.fallbacks import Fallback, Reason
from .padding import Padding
from ..pytree import TENSOR, flatten, leaf_paths, strict_key, tensor_leaf_owners

if TYPE_CHECKING:
    from .captured_size import CapturedSize

REQUIRED = object()  # a forward parameter without default


def forward_params(forward_fn, for_call: bool = False) -> list:
    """(name, default) of forward's positional parameters after self; REQUIRED where there is no default.
    for_call: as_made's, where a positional-only parameter counts as required (it cannot go by name)."""
    params = list(inspect.signature(forward_fn).parameters.values())[1:]  # drop self
    return [(p.name, REQUIRED if p.default is p.empty or for_call and p.kind is p.POSITIONAL_ONLY else p.default)
            for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def as_made(params, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The call to make of forward for canonical arguments (SignatureTable.canonical: every positional
    parameter filled, defaults included): a parameter holding its very default object is left out, and
    those after it go by name. A wrapper that fills parameters from a config where a call does not give
    them (transformers' merge_with_config_defaults: use_cache, return_dict) then sees the call as made.
    `params`: forward_params(for_call=True) (positional-only parameters, which lead, go as they are)."""
    n = len(args)
    if n > len(params):  # more than the named parameters (a forward taking *args): as given
        return args, kwargs
    first = next((i for i in range(n) if args[i] is params[i][1]), n)
    if first == n:
        return args, kwargs
    kwargs = dict(kwargs)
    kwargs.update((params[i][0], args[i]) for i in range(first + 1, n) if args[i] is not params[i][1])
    return args[:first], kwargs


class Signature:
    """One call structure: its non-tensor arguments, where its tensors are, their static buffers."""

    def __init__(self, index: int, spec, dims: List[Optional[int]], template,
                 layout: Optional[List[Tuple[Any, list]]] = None, lazy: bool = False):
        self.index = index  # 1, 2, ...: this signature's number in its runner
        self.spec = spec
        self.dims = dims
        self.template = template  # the first call's (args, kwargs), to rebuild dataclass arguments
        # (dtype, shape with None at the dynamic dim) of each tensor leaf: what every call must match
        self.input_layout = layout or []
        self.devices: List[Any] = []  # the device of each tensor leaf: where its static buffer is
        self.dynamic = [i for i, d in enumerate(dims) if d is not None]
        self.lazy = lazy  # made by a call rather than by capture_model
        self.entries: Dict[int, CapturedSize] = {}
        # real size -> fast_replay.ReplayPlan of the common call; dropped when what a plan resolved changes
        self.plans: Dict[int, Any] = {}
        self.buffers: Optional[List[Any]] = None  # static input buffers at the max size (copy_inputs)
        # leaves marked with mark_static_address: read in place, their buffer is the caller's tensor
        self.in_place: frozenset = frozenset()
        self.restore_point: List[Tuple[Any, Any]] = []  # while a size is captured: their contents before
        self.padding: Optional[Padding] = None  # their padding rows (copy_inputs)
        self.mutated: List[int] = []  # leaves the forward writes in place: written back after a replay
        # (start, end) bytes of the copied static buffers, once an output is seen to share their memory (the
        # forward returns an input): arguments overlapping them are copied aside before any is copied in
        self.fed_back: Optional[List[Tuple[int, int]]] = None
        self.observations: List[output_layout.Observation] = []  # outputs seen at each size
        self.layout = output_layout.OutputLayout()  # the outputs' batch dims, once seen at two sizes
        self.eager_writes: set = set()  # leaves the plain forward writes in place (capture_checks)
        self.eager_buffer_writes: set = set()  # model buffers it writes in place
        self.static_buffer_writes: set = set()  # model buffers the captured path writes in place
        # sizes whose warmups and capture ran: the forward has run with these arguments before the next
        # (capture_phase checks that next one's whole window for Python values it sets)
        self.capture_windows = 0

    def key(self, padded: int) -> int:
        """An integer naming (this signature, padded size): what strategies key their graphs by."""
        return self.index * (1 << 20) + padded

    def dynamic_leaves(self, args, kwargs, is_tensor):
        """(tensor, dynamic dim) for the tensors of (args, kwargs) that have one."""
        leaves, _ = flatten((args, kwargs), is_tensor)
        return [(leaf, dim) for leaf, dim in zip(leaves, self.dims) if dim is not None]

    def batch_size(self, adapter, leaves) -> int:
        """The common size of every dynamic dim, or -1 when they disagree (IndexError: a leaf's rank is too low)."""
        dyn = self.dynamic
        dims = self.dims
        real = adapter.shape(leaves[dyn[0]])[dims[dyn[0]]]
        for i in dyn[1:]:
            if adapter.shape(leaves[i])[dims[i]] != real:
                return -1
        return real

    def buffer_bytes(self, adapter) -> int:
        if not self.buffers:
            return 0
        return sum(adapter.nbytes(b) for i, b in enumerate(self.buffers) if i not in self.in_place)

    def largest_above(self, padded: int) -> Optional[int]:
        """The largest size captured with this signature above `padded` (output_sharing), or None."""
        larger = [size for size in self.entries if size > padded]
        return max(larger) if larger else None

    def observe(self, observation: "output_layout.Observation") -> None:
        """Learn the output layout from one more size; cached replay views are cut anew if it changed."""
        self.observations.append(observation)
        layout = output_layout.learn(self.observations)
        layout.blocked = self.layout.blocked
        if layout != self.layout:
            self.layout = layout
            self.plans.clear()
            for entry in self.entries.values():
                entry.views.clear()

    def watch_feedback(self, adapter, outputs) -> None:
        """Set fed_back once an output shares memory with a copied static buffer."""
        if self.fed_back is not None or not self.buffers or self.padding is None:
            return
        spans = [adapter.extent(b) for i, b in enumerate(self.buffers) if i not in self.in_place]
        for t in flatten(outputs, adapter.is_tensor)[0]:
            if overlaps(spans, adapter.extent(t)):
                self.fed_back = spans
                self.plans.clear()
                return

    def block(self, why: str) -> None:
        """From now on only calls of a captured size replay (capture_checks found padded calls differ)."""
        self.layout.blocked.append(why)
        self.plans.clear()


class SignatureTable(dict):
    """A runner's signatures by call spec, how they are made from calls, and why a call does not fit one."""

    def __init__(self, *, adapter, config, name: str, params: Sequence[Tuple[str, Any]],
                 keyword_defaults: Sequence[Tuple[str, Any]] = (), dynamic_arg_dims=None,
                 pad_values: Optional[Dict[str, Any]] = None):
        super().__init__()
        self.adapter = adapter
        self.config = config
        self.name = name
        # forward's positional-or-keyword parameters after self: (name, default or REQUIRED)
        self.params = list(params)
        self.arg_names = [n for n, _ in self.params]
        # keyword-only parameters with a default, as value keys: m(x, flag=False) is m(x)
        self.keyword_defaults = [(n, strict_key(default)) for n, default in keyword_defaults]
        self.dynamic_arg_dims = dynamic_arg_dims  # None: dim 0 of every tensor argument
        self.pad_values = pad_values or {}
        self._numbers = itertools.count(1)  # not reused for a signature dropped unused (restarts on release)

    def release(self) -> None:
        """Forget every signature (their graphs and buffers are the runner's to drop first)."""
        self.clear()
        self._numbers = itertools.count(1)

    def canonical(self, args, kwargs):
        """Arguments as one positional tuple in forward's order, defaults filled in, so that m(x),
        m(x=x) and m(x, scale=1.0) (the default) share one signature; a keyword-only argument given its
        default (m(x, flag=False)) is left out, as in m(x)."""
        args = list(args)
        kwargs = dict(kwargs)
        for name, default in self.params[len(args):]:
            if name in kwargs:
                args.append(kwargs.pop(name))
            elif default is not REQUIRED:
                args.append(default)
            else:
                break
        for name, default in self.keyword_defaults:
            if name in kwargs and strict_key(kwargs[name]) == default:
                del kwargs[name]
        return tuple(args), kwargs

    # -- inputs that do not fit (slow paths only) ---------------------------------------------------
    def leaf_names(self, spec) -> List[str]:
        """A readable name per tensor leaf: the forward argument it belongs to."""
        owners = tensor_leaf_owners(spec)
        names = []
        for i, owner in enumerate(owners):
            if isinstance(owner, int):
                name = repr(self.arg_names[owner]) if owner < len(self.arg_names) else f"positional argument {owner}"
            else:
                name = repr(owner)
            if owners.count(owner) > 1:
                name += f" (tensor {owners[:i].count(owner) + 1} of {owners.count(owner)} in it)"
            names.append(name)
        return names

    def _describe(self, shape, dim) -> str:
        dims = ", ".join("batch" if i == dim else str(n) for i, n in enumerate(shape))
        return f"a {len(shape)}-dimensional tensor of shape [{dims}]"

    def misfit(self, sig: Signature, leaves, what: str, size: Optional[int] = None) -> Optional[Tuple[str, str]]:
        """(kind, message) saying why `leaves` cannot use `sig`'s graphs and buffers, or None when they can.

        kind "device", "rank" or "dtype" is the caller's error; "rows" (capture only: not `size` rows) too; "shape"
        (another non-batch dimension) is reported only when nothing worse is found: a call runs it
        without graphs."""
        adapter = self.adapter
        names = self.leaf_names(sig.spec)
        found = None
        for name, leaf, dim, (dtype, shape), device in zip(names, leaves, sig.dims, sig.input_layout, sig.devices):
            if adapter.device(leaf) != device:
                return "device", (f"{what} {name} is on device {adapter.device(leaf)}; {self.name} takes it on device "
                                  f"{device}, where its static buffer is (as at capture): move it there before the call")
            got = list(adapter.shape(leaf))
            if len(got) != len(shape):
                return "rank", (f"{what} {name} has {len(got)} dimensions (shape {got}); "
                                f"{self.name} takes {self._describe(shape, dim)} there")
            if adapter.dtype(leaf) != dtype:
                return "dtype", f"{what} {name} has dtype {adapter.dtype(leaf)}; {self.name} takes dtype {dtype} there"
            if dim is not None and size is not None and got[dim] != size:
                return "rows", (f"{what} {name} has {got[dim]} rows in its batch dimension {dim} (shape {got}); "
                                f"expected {size}, the size being captured")
            bad = [i for i, (g, s) in enumerate(zip(got, shape)) if i != dim and g != s]
            if bad and found is None:
                found = "shape", (f"{what} {name} has shape {got}, dimension {bad[0]} differs; "
                                  f"{self.name} takes {self._describe(shape, dim)} there")
        return found

    def bad_call(self, sig: Signature, leaves, misfit) -> GraphOptInputError:
        """The error for a call whose tensors cannot replay; raised before anything is copied or replayed."""
        if misfit is None or misfit[0] == "shape":
            return GraphOptInputError(f"{self.name}: {self.disagreement(sig, leaves)}")
        return GraphOptInputError(f"{self.name}: {misfit[1]}")

    def disagreement(self, sig: Signature, leaves) -> str:
        names = self.leaf_names(sig.spec)
        sizes = [f"{names[i]} has {self.adapter.shape(leaves[i])[sig.dims[i]]} (dim {sig.dims[i]})" for i in sig.dynamic]
        return ("the batch dimensions of the arguments disagree: " + ", ".join(sizes) + "; every dynamic dimension "
                "(dynamic_arg_dims, by default dim 0 of every tensor argument) must have the same size. "
                "Pass dynamic_arg_dims={'arg': dim} to @support_graph_optimization to name only the batch dimensions")

    def batch_disagreement(self, args, kwargs) -> Optional[str]:
        """Why the batch dimensions of (args, kwargs) disagree, or None when they agree. For a call that
        failed on a path without graphs, to name the arguments instead of the framework's kernel."""
        args, kwargs = self.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), self.adapter.is_tensor)
        try:
            sig = Signature(0, spec, self.dynamic_dims(spec, leaves), (args, kwargs))
            if not sig.dynamic or sig.batch_size(self.adapter, leaves) >= 0:
                return None
        except (GraphOptConfigError, IndexError):
            return None
        return self.disagreement(sig, leaves)

    # -- signatures --------------------------------------------------------------------------------
    def opaque_arguments(self, spec) -> List[str]:
        """Non-tensor arguments that are objects a replay cannot check (a Hugging Face DynamicCache, a
        user's state object). At level 0 the graph bakes whatever the forward read from them at capture,
        and they are compared by identity, so a call with the same object mutated would replay stale; at
        level >= 1 the framework guards what the forward reads from them. Plain values, containers,
        dataclasses, enums, functions and the framework's dtypes and devices are fine. A callable object
        whose class defines __call__ in Python (an nn.Module, a logits processor) is an object: the forward
        may read its attributes."""
        plain = _PLAIN + self.adapter.value_types
        found = []
        for path, leaf in self._named_leaves(spec):
            if leaf is TENSOR:
                continue
            value = getattr(leaf, "value", getattr(leaf, "obj", None))
            if _object_like(value, plain):
                found.append(f"{path} (a {type(value).__name__}{mapping_note(value)})")
        return found

    def refusal(self, spec, capture_model_done: bool) -> Optional[Fallback]:
        """Why a call with a structure or non-tensor value never seen before may not get graphs of its
        own at call time, or None. Replaying a graph captured with another value would be wrong; a
        graph per value without bound would capture (and hold static buffers) at every new value."""
        opaque = self.opaque_arguments(spec)
        if opaque and self.config.graph_opt_level == 0:
            return Fallback(Reason.OBJECT_ARGUMENT, f"{_opaque_message(opaque)}; these calls run without graphs",
                    ("object_argument",))
        if opaque:
            # The warmups, the capture and its check would run the forward on the caller's object, which
            # sees every run's changes (a cache object advanced several times by one call).
            return Fallback(
                Reason.OBJECT_ARGUMENT, f"forward argument {', '.join(opaque)}: capturing a size at this call would "
                "run the forward several times on the caller's object (warmups, the capture, its check), and "
                "it would see every run's changes, so sizes are captured at a call only without object "
                "arguments (capture_model() captures with the objects make_inputs returns); these calls run "
                "without graphs", ("object_argument",))
        if capture_model_done and self:
            return Fallback(
                Reason.NEW_SIGNATURE, f"{self._new_values(spec)}: a call with a structure or non-tensor value not "
                "seen at capture runs without graphs (capture_model() with inputs of that value captures it too)",
                ("new_signature",))
        limit = self.config.cudagraph_max_signatures
        if sum(1 for sig in self.values() if sig.lazy) >= limit:
            return Fallback(
                Reason.SIGNATURE_LIMIT, f"{self._new_values(spec)}; graphs are captured per non-tensor argument value "
                f"and {limit} were captured at call time (cudagraph_max_signatures={limit}), so calls with "
                "further values run without graphs. Pass a value that changes from call to call as a tensor",
                ("signature_limit",))
        return None

    def _new_values(self, spec) -> str:
        """What differs between a call's structure and the nearest one seen before, naming the argument."""
        new = self._named_leaves(spec)
        best = None
        for sig in self.values():
            old = self._named_leaves(sig.spec)
            diffs = [(path, value, dict(old).get(path, _ABSENT)) for path, value in new if dict(old).get(path, _ABSENT) != value]
            diffs += [(path, _ABSENT, value) for path, value in old if path not in dict(new)]
            if best is None or len(diffs) < len(best):
                best = diffs
        if not best:
            return "a call with another structure or non-tensor argument value than the calls seen before"
        path, value, before = best[0]
        return (f"forward argument {path} is {_show_value(value)}; the calls seen before had "
                f"{_show_value(before)}")

    def _named_leaves(self, spec) -> List[Tuple[str, Any]]:
        """(argument path, leaf) for every leaf of a call's spec: ('scale', <1.0>), ("cfg['k']", TENSOR)."""
        args_spec, kwargs_spec = spec[1]
        out: List[Tuple[str, Any]] = []
        for i, child in enumerate(args_spec[1]):
            name = self.arg_names[i] if i < len(self.arg_names) else f"args[{i}]"
            out.extend(leaf_paths(child, root=name))
        for key, child in zip(kwargs_spec[1], kwargs_spec[2]):
            out.extend(leaf_paths(child, root=key))
        return out

    def make(self, spec, leaves, args, kwargs, lazy: bool = False) -> Optional[Signature]:
        dims = self.dynamic_dims(spec, leaves)
        if not any(d is not None for d in dims):
            return None
        adapter = self.adapter
        layout = [(adapter.dtype(t), [None if i == d else n for i, n in enumerate(adapter.shape(t))])
                  for t, d in zip(leaves, dims)]
        self._check_pad_values(spec, leaves, dims)
        sig = Signature(next(self._numbers), spec, dims, (args, kwargs), layout, lazy=lazy)
        sig.devices = [adapter.device(t) for t in leaves]
        if self.config.cudagraph_copy_inputs:
            sig.in_place = frozenset(i for i, t in enumerate(leaves) if adapter.static_address(t))
        self[spec] = sig
        return sig

    def owner_names(self, spec) -> list:
        """Per tensor leaf of a spec of (args, kwargs): the name of the forward argument it belongs to (a
        position past the named parameters stays its int), as pad_values and dynamic_arg_dims name them."""
        names = self.arg_names
        return [names[o] if isinstance(o, int) and o < len(names) else o for o in tensor_leaf_owners(spec)]

    def reserved_pad_leaves(self, spec) -> set:
        """The leaves whose padding rows hold a value the user gave (pad_values): a reserved slot or id."""
        if not self.pad_values:
            return set()
        return {i for i, name in enumerate(self.owner_names(spec)) if name in self.pad_values}

    def _check_pad_values(self, spec, leaves, dims) -> None:
        """GraphOptConfigError where a pad value does not fit its argument's dtype (1e20 in int64, -1.5)."""
        if not self.pad_values:
            return
        for name, leaf, dim in zip(self.owner_names(spec), leaves, dims):
            value = self.pad_values.get(name)
            if dim is not None and value is not None and not self.adapter.fits(value, self.adapter.dtype(leaf)):
                raise GraphOptConfigError(
                    f"{self.name}: pad_values[{name!r}]={value!r} does not fit argument {name!r} of dtype "
                    f"{self.adapter.dtype(leaf)}; give a value that dtype holds exactly (e.g. -1 for an index)")

    def dynamic_dims(self, spec, leaves) -> List[Optional[int]]:
        dims: List[Optional[int]] = []
        for name, leaf in zip(self.owner_names(spec), leaves):
            ndim = len(self.adapter.shape(leaf))
            marked = self.adapter.static_address(leaf)
            if self.dynamic_arg_dims is None:
                dim = 0 if ndim > 0 and not marked else None
            else:
                dim = self.dynamic_arg_dims.get(name)
                if dim is not None and marked:
                    raise GraphOptConfigError(
                        f"{self.name}: dynamic_arg_dims[{name!r}]={dim} names a dimension of argument {name!r}, "
                        "which is marked with mark_static_address: the graphs read that one tensor in place at "
                        "every batch size, so it has no batch dimension. Leave it out of dynamic_arg_dims, or do "
                        "not mark it")
                if dim is not None and not -ndim <= dim < ndim:
                    raise GraphOptConfigError(
                        f"{self.name}: dynamic_arg_dims[{name!r}]={dim} is out of range for argument {name!r} of "
                        f"shape {list(self.adapter.shape(leaf))}: a dim of a {ndim}-dimensional tensor must be in "
                        f"{-ndim}..{ndim - 1}" if ndim else
                        f"{self.name}: dynamic_arg_dims[{name!r}]={dim} names a dimension of argument {name!r}, "
                        "which is a 0-dimensional tensor: a dynamic argument must have at least one dimension"
                    )
                if dim is not None and dim < 0:
                    dim += ndim
            dims.append(dim)
        return dims


_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, type)


def _object_like(value, plain) -> bool:
    """Whether an argument's value is an object whose state the forward may read (see _opaque_arguments):
    code (a function, a builtin, a C-level callable such as an lru_cache wrapper or a scripted function) is
    not; a bound method or a partial is judged by what it binds."""
    if isinstance(value, plain):
        return False
    if isinstance(value, types.MethodType):
        return _object_like(value.__self__, plain)
    if isinstance(value, functools.partial):
        return any(_object_like(v, plain) for v in (value.func, *value.args, *value.keywords.values()))
    if not callable(value):
        return True
    return isinstance(getattr(type(value), "__call__", None), types.FunctionType)


def mapping_note(value) -> str:
    """For a mapping that is not a dict (a tokenizer's BatchEncoding is a UserDict): graph_opt does not
    look inside it, so its tensors are neither copied nor checked."""
    if isinstance(value, collections.abc.Mapping) and not isinstance(value, dict):
        return (", a mapping graph_opt does not look inside (it reads dicts, lists, tuples and dataclasses): "
                "pass dict(...) of it, or its tensors")
    return ""


def _opaque_message(opaque: List[str]) -> str:
    return (f"forward argument {', '.join(opaque)}: at graph_opt_level=0 a replay cannot see what the forward "
            "reads from an object (the graph bakes it at capture, and a mutated object looks the same). Pass its "
            "tensors as arguments (or in a dict, list or dataclass), or use graph_opt_level=1, whose guards see it")
_ABSENT = object()


def _show_value(value) -> str:
    if value is _ABSENT:
        return "no such argument"
    if value is TENSOR:
        return "a tensor"
    inner = getattr(value, "value", getattr(value, "obj", value))
    return f"{inner!r} ({type(inner).__name__})"
