"""The direct replay at level >= 1 on torch: when a replay may skip Dynamo's transformed code.

Dynamo's transformed code of the captured frame gathers the graph's inputs from the module tree and the
arguments, calls the compiled graph and returns its outputs, then replays the frame's side effects. Where
it provably does nothing else (pure_replay_code), a replay is the graph's replay() alone; where its only
side effects are constants stored into attributes of objects reached from globals (transformers' output
collector), the replay makes those stores itself (constant_stores, replay_stores). _ModuleTensors sends
the replays back through the transformed code once a parameter or buffer was replaced.
"""
from __future__ import annotations

import functools
import types
from typing import Optional, Tuple

import torch
import torch._dynamo

from ...errors import ReplayDivergence
from ...watch.fallbacks import Fallback, Reason
from ...watch.module_watch import Registrations
from .adapter import ADAPTER
from .module_counters import module_state


class _ModuleTensors:
    """Whether the model still holds the parameter and buffer objects its graphs read.

    The graphs read the captured tensors' memory. Replacing one goes through torch's registration
    hooks, which bump a process-wide count: a replay compares one integer, and only after a registration
    anywhere looks at the model's tensors again (the Registrations part of graph_opt/watch/module_watch.py, as
    the inference check at level 0 has it). Not replayed (ReplayDivergence, until put back):
    - a parameter or buffer replaced by another object. Copying its values into the captured one, where
      the graph reads, would change a tensor the user may still hold and put back (an EMA swap: the
      restored weight would hold the EMA's values), or that the model holds elsewhere (a tied weight);
    - one of another shape, dtype or device: the graph may have baked what the forward read of it
      (`self.scale.shape[0]` is a constant in the graph, and Dynamo's guards on the parameters' and
      buffers' metadata are left out: guard_reads.ReplayGuards);
    - the same tensor with other memory or strides (set_(), a buffer's `.data` assigned, seen at a
      registration of the module): the graph reads the memory as it was laid out at capture. A
      parameter's `.data` assigned (transformers' resize_token_embeddings) is seen before, by the
      model-state check, as a conversion.
    A submodule or a tensor slot added since capture moves the replays to the transformed code."""

    def __init__(self, model):
        self.model = model
        # the ids of the model's submodules, parameters and buffers when the first graph was captured
        self.registrations = Registrations(ADAPTER)
        self.layouts = None  # and the tensors' shapes, dtypes and devices
        self.moved = False
        self.relaid = None  # (registration count, what changed, fingerprint as captured) of the last look

    def _start(self):
        if self.layouts is None:
            self.registrations.snapshot(self.model)
            self.layouts = module_state(self.model)[1]

    def checked(self, replay):
        """A replay through the transformed code, refused where a tensor changed layout (see above)."""
        self._start()
        registrations = self.registrations
        count = registrations.count

        def run():
            if count[0] != registrations.seen:
                self._unchanged()
            return replay()

        return run

    def direct(self, graph_replay, bytecode_replay, outputs, stores=(), f_globals=None):
        self._start()
        registrations = self.registrations
        count = registrations.count

        if not stores:
            def replay():
                if count[0] != registrations.seen and not self._unchanged():
                    return bytecode_replay()
                graph_replay()
                return outputs

            return replay

        def replay_and_store():
            if count[0] != registrations.seen and not self._unchanged():
                return bytecode_replay()
            graph_replay()
            # What the transformed code stores after its graph, into the objects its globals name now
            # (a global rebound since capture gets the stores, as in the transformed code).
            for store, root, path, name, value in stores:
                obj = f_globals[root]
                for attr in path:
                    obj = getattr(obj, attr)
                store(obj, name, value)
            return outputs

        return replay_and_store

    def with_check(self, guards):
        """The replay's check (Captured.check): the framework's guards (None: none kept), then a parameter
        or buffer replaced or relaid (see above), which refuses the replay before it runs, as "replaced",
        so that explain() and the call say the same."""
        registrations = self.registrations

        def check():
            failed = guards() if guards is not None else None
            if failed is None and self.layouts is not None and registrations.count[0] != registrations.seen:
                conflict = self._look()[1]
                if conflict is not None:
                    return Fallback(Reason.REPLACED, conflict + ". To keep it, clear_graphs() and capture_model() again")
            return failed

        return check

    def _look(self):
        """(registration count, what changed, fingerprint as captured), looked at once per registration count."""
        count = self.registrations.count[0]
        if self.relaid is None or self.relaid[0] != count:
            fingerprint, layouts = module_state(self.model)
            self.relaid = (count, self._conflict(layouts), fingerprint == self.registrations.ids)
        return self.relaid

    def _unchanged(self) -> bool:
        """True when the model holds the captured tensors; False when some were replaced by tensors of
        the same layouts (the transformed code passes them in); ReplayDivergence otherwise (see above)."""
        registrations = self.registrations
        count = registrations.count[0]
        _, conflict, as_captured = self._look()
        if conflict is not None:
            raise ReplayDivergence(conflict + ". To keep it, clear_graphs() and capture_model() again")
        if not self.moved and as_captured:
            registrations.seen = count
            return True
        self.moved = True
        return False

    def _conflict(self, now: dict) -> Optional[str]:
        held_at = {}
        for path, layout in now.items():
            held_at.setdefault(layout[0], path)
        for path, (ident, address, dtype, device, shape, strides) in self.layouts.items():
            if path not in now:
                continue
            ident2, address2, dtype2, device2, shape2, strides2 = now[path]
            if (shape2, dtype2, device2) != (shape, dtype, device):
                return (f"{path} was replaced by a tensor of shape {list(shape2)}, {dtype2} on {device2}; the graphs "
                        f"were captured with {list(shape)}, {dtype} on {device} and may hold what the forward read of it")
            if ident2 == ident and (address2 != address or strides2 != strides):
                return (f"{path} holds other memory or strides than at capture (its .data was replaced, or set_() or "
                        "as_strided_() ran on it); the graphs read the memory as it was laid out then")
            if ident2 != ident:
                where = f", and the captured one is still in the model at {held_at[ident]}" if ident in held_at else ""
                return (f"{type(self.model).__name__}.{path} was replaced by a new object after capture{where}; the "
                        "graphs read the captured tensor's memory, and copying the new values there would change "
                        "that tensor. Load new values in place instead (load_state_dict, or p.copy_() under "
                        "no_grad), or put the captured one back")
        return None


# What Dynamo's transformed code for a graph without side effects is made of: reads of the module tree,
# the call of the compiled graph, building the returned containers. Anything else (an attribute or
# item store, a call of anything but these) may be a side effect the replay would have to repeat.
_PURE_OPS = frozenset({
    "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PRECALL", "CALL", "CALL_FUNCTION", "CALL_FUNCTION_KW",
    "CALL_METHOD", "CALL_KW", "KW_NAMES", "PUSH_NULL", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST",
    "LOAD_FAST_AND_CLEAR", "STORE_FAST", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST", "DELETE_FAST",
    "LOAD_CONST", "RETURN_CONST", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "BINARY_SUBSCR", "BUILD_LIST",
    "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP", "LIST_EXTEND", "LIST_TO_TUPLE", "UNPACK_SEQUENCE",
    "COPY", "SWAP", "DUP_TOP", "ROT_TWO", "ROT_THREE", "ROT_FOUR", "POP_TOP", "RETURN_VALUE",
    "COPY_FREE_VARS", "LOAD_DEREF", "MAKE_CELL",
})
_PURE_ATTRS = frozenset({"_modules", "_parameters", "_buffers", "call_size", "record_pregraph_bytecode_enter",
                         "record_pregraph_bytecode_exit"})


_STORE_HELPER = "object_setattr_ignore_descriptor"  # torch._dynamo.utils': how Dynamo replays an attribute store


@functools.lru_cache(maxsize=256)  # one code object serves every size: disassembling it took 15 ms a size
def pure_replay_code(code: types.CodeType, chains: frozenset = frozenset(), stored: frozenset = frozenset()) -> bool:
    """Whether Dynamo's transformed code only gathers the compiled graph's inputs from the module tree
    and the arguments and returns its outputs: no store outside its locals, no call but the graph's
    and Dynamo's own helpers. Then skipping it changes nothing but the time it took.

    chains, stored: the paths (global, attribute, ...) to the objects of constant_stores(), and the
    attributes stored into them. With them the code may also walk exactly those paths (a global, then
    its attributes in order: an attribute of that name read from anything else is refused) and store
    those attributes (STORE_ATTR, or Dynamo's store helper): the replay makes those stores."""
    import dis

    prefixes = {chain[:i] for chain in chains for i in range(1, len(chain) + 1)}
    attrs = _PURE_ATTRS | {_STORE_HELPER} if chains else _PURE_ATTRS
    walking = None  # the path so far while the top of the stack is an object on a store's path
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in ("COPY", "STORE_FAST") and walking is not None:
            continue  # Dynamo keeps each step of the path in a temporary: the top of the stack is the same
        path, walking = walking, None
        if op == "STORE_ATTR" and ins.argval in stored:
            continue
        if op not in _PURE_OPS:
            return False
        if op in ("LOAD_ATTR", "LOAD_METHOD"):
            if path is not None and path + (ins.argval,) in prefixes:
                walking = path + (ins.argval,)
            elif ins.argval not in attrs:
                return False
        elif op == "LOAD_GLOBAL":
            if (ins.argval,) in prefixes:
                walking = (ins.argval,)
            elif not str(ins.argval).startswith(("__compiled_fn", "__import_torch")):
                return False
    return True


def replay_stores(code: types.CodeType, stores: tuple) -> Optional[tuple]:
    """constant_stores() as the replay makes them: ((setter, global, attribute path, attribute, value), ...),
    the setter being the one the transformed code uses: setattr where it has STORE_ATTR (torch 2.11),
    Dynamo's helper, which skips descriptors, where it loads that (2.13). None when it mixes the two or
    uses neither (not a code this replay understands)."""
    if not stores:
        return ()
    attribute_stores, loads_helper = _store_kinds(code)
    plain = any(s[1] in attribute_stores for s in stores)
    if plain == loads_helper:
        return None
    setter = setattr if plain else torch._dynamo.utils.object_setattr_ignore_descriptor
    return tuple((setter, chain[0], chain[1:], name, value) for chain, name, value in stores)


@functools.lru_cache(maxsize=256)  # per code object, not per size (see pure_replay_code)
def _store_kinds(code: types.CodeType) -> Tuple[frozenset, bool]:
    """The attributes the code stores with STORE_ATTR, and whether it loads Dynamo's store helper."""
    import dis

    instructions = list(dis.get_instructions(code))
    return (frozenset(ins.argval for ins in instructions if ins.opname == "STORE_ATTR"),
            any(ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == _STORE_HELPER for ins in instructions))


def constant_stores() -> Optional[tuple]:
    """What Dynamo's transformed code of the frame being compiled does after its graph, when that is only
    storing constants into attributes of objects that existed before the call, found from globals
    (transformers' output collector: `global_var = None`, `compiling = False` after every forward):
    ((path, attribute, value), ...), path being (global, attribute, ...) to the object, looked up again
    at each replay as the transformed code does. None when it does anything else (a list or dict
    mutated, an object made, a tensor hook): those replays run the transformed code. Called from the
    backend, when Dynamo's side effects are final."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationExisting, AttributeMutationNew
        from torch._dynamo.variables.constant import ConstantVariable
        from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

        effects = InstructionTranslator.current_tx().output.side_effects
        if effects.tensor_hooks or getattr(effects, "save_for_backward", None):
            return None
        stores = []
        for var in effects._get_modified_vars():
            attrs = effects.store_attr_mutations.get(var)
            if not attrs and isinstance(var.mutation_type, AttributeMutationNew):
                continue  # made during the call (a tensor the graph returns), no attribute set on it
            path = _source_path(var.source)
            if (not attrs or path is None or not isinstance(var, UserDefinedObjectVariable)
                    or not isinstance(var.mutation_type, AttributeMutationExisting)):
                return None
            for name, value in attrs.items():
                if type(value) is not ConstantVariable or not isinstance(value.value, (type(None), bool, int, float, str)):
                    return None
                stores.append((path, name, value.value))
        return tuple(stores)
    except Exception:  # another torch's internals: pure_replay_code alone decides, as without stores
        return ()


def _source_path(source) -> Optional[tuple]:
    """(global, attribute, ...) a Dynamo source reads; None for any other kind of source."""
    members = []
    while type(source).__name__ == "AttrSource":
        members.append(source.member)
        source = source.base
    if type(source).__name__ != "GlobalSource":
        return None
    return (source.global_name, *reversed(members))


def stores_names(stores: tuple) -> Tuple[frozenset, frozenset]:
    """pure_replay_code's arguments for these stores: their paths, and the attributes stored."""
    return frozenset(s[0] for s in stores), frozenset(s[1] for s in stores)


def _tensors_only(tree, is_tensor) -> bool:
    """Tensors (or None) in plain tuples, lists and dicts: no value the skipped code might compute
    afresh per call."""
    if tree is None or is_tensor(tree):
        return True
    if type(tree) in (tuple, list):
        return all(_tensors_only(x, is_tensor) for x in tree)
    if type(tree) is dict:
        return all(_tensors_only(x, is_tensor) for x in tree.values())
    return False
