"""Level >= 1 on torch: Dynamo traces the forward inside the capture phase; pieces are captured per size.

How one padded size goes:
- warmup: the forward runs through torch.compile with this module's backend, inside
  sot_warmup_guard(True) and capture_custom_allreduce(). The first warmup traces: Dynamo reads
  is_capturing() as true and bakes the capture branch. The backend splits the FX graph
  (fx_split.py) at the selected splitting ops and at ops that touch host tensors; level 2 compiles
  each capturable piece with Inductor. The pieces run as compiled (GraphState WARMUP).
- capture: the same call with GraphState CAPTURE: each capturable piece records a graph for this
  size; splitting ops and host ops run eagerly between them. Dynamo's bytecode hook told us which
  transformed code object belongs to the graph that ran.
- replay: that transformed code is called directly, as vLLM's TorchCompileWrapperWithCustomDispatcher
  does, so Dynamo's guards are not evaluated. This is the point: Dynamo guards the globals it read
  while tracing, so once is_capturing() flips back to false a guarded call would recompile and run
  the non-capture branch. The plugin guards what it skips instead: the padded size and the
  non-tensor arguments are the runner's dispatch key. Where the size's work is one graph and the
  transformed code provably does nothing but gather the graph's inputs and return its outputs
  (pure_replay_code), not even that code runs: a replay is the graph's replay(), as at level 0;
  piecewise, it is the pieces' graphs and the eager pieces in the captured order (pieces.ReplayPlan).

The traced forward must be one graph (fullgraph=True): after a graph break the rest of the forward
runs in resume functions that only Dynamo's frame hook compiles, and a direct call of the code would
run them uncompiled, on the non-capture branch. Splitting needs no graph break: a splitting op is
one FX node (a torch.library custom op, or a selected @graph_opt.splitting_op function, which the
trace routes to fx_split.call_splitting_op).

Calls that do not replay (sizes above the max, autograd on, a failed capture) go through
run(): a second, ordinary torch.compile of the forward, guards and recompiles included.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from ... import split
from ...guards import as_captured
from .. import private_copy
from ...cudagraph import Captured
from ...errors import CaptureError
from ...pytree import flatten
from ...testing import simulation_enabled
from . import fx_split
from .adapter import _install_registration_hooks, _registrations, module_fingerprint
from .pieces import CapturablePiece, CompiledForward, EagerPiece, GraphState, Mode

logger = logging.getLogger("graph_opt")


def graphs_compiled() -> int:
    """Dynamo's count of FX graphs compiled in this process (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


# -- which transformed code belongs to which compiled graph ------------------------------------------
_OWNERS: "weakref.WeakValueDictionary[int, DynamoStrategy]" = weakref.WeakValueDictionary()
_hook_installed = False


def _on_bytecode(old_code, new_code):
    owner = _OWNERS.get(id(old_code))
    if owner is not None and owner._graph_code is old_code:
        owner._on_transformed_code(new_code)
    return None  # keep Dynamo's code as it is


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        torch._dynamo.convert_frame.register_bytecode_hook(_on_bytecode)
        _hook_installed = True


class _ReleaseSize:
    """Keepalive entry of a Captured: reset() drops the per-size graphs of one compiled forward."""

    def __init__(self, forward: CompiledForward, key):
        self.forward = forward
        self.key = key

    def reset(self) -> None:
        self.forward.release(self.key)


class DynamoStrategy:
    """Warm up, capture and replay a torch model's forward through Dynamo, per padded size."""

    def __init__(self, model, forward_fn, config, adapter, selection: Optional[split.SplitSelection]):
        self.model = model
        self.forward_fn = forward_fn
        self.config = config
        self.adapter = adapter
        self.selection = selection
        self.level = config.graph_opt_level
        self.translations = 0
        self.direct_replays = 0  # sizes whose replay is the graph's replay() alone (pure_replay_code)
        self.planned_replays = 0  # of those, piecewise sizes replayed by a pieces.ReplayPlan
        self.pass_counts = {}  # no program passes on torch
        self.state = GraphState()
        self._tensors = _ModuleTensors(model)
        self.forwards: List[CompiledForward] = []
        self._pending: List[CompiledForward] = []  # compiled by the backend, bytecode not seen yet
        self._code_of: Dict[int, types.CodeType] = {}  # id(CompiledForward) -> its transformed code
        self._stores_of: Dict[int, Optional[tuple]] = {}  # id(CompiledForward) -> constant_stores() at its trace
        self._split_at = fx_split.splitting_op_matcher(selection)
        self._trace_hook = None  # routes selected splitting ops to one FX node while Dynamo traces
        self._graph_fn = None  # the forward for the graph path, its own code object
        self._graph_code = None
        self._compiled = None
        self._run_fn = None
        self._compiled_run = None

    # -- strategy protocol -------------------------------------------------------------------------
    def run(self, args, kwargs):
        """Without graphs: torch.compile as usual, guards and all (it may recompile for new shapes or flags)."""
        if self._compiled_run is None:
            self._run_fn = private_copy(self.forward_fn)
            backend = "inductor" if self.level >= 2 else _traced
            self._compiled_run = torch.compile(self._run_fn, backend=backend, dynamic=None)
        before = graphs_compiled()
        try:
            return self._compiled_run(self.model, *args, **kwargs)
        finally:
            self.translations += graphs_compiled() - before

    def warmup(self, args, kwargs, padded, sig):
        """Run the graph path without graphs; returns the outputs (the core ignores them, tests compare them)."""
        self._mark_dynamic(args, kwargs, sig)
        return self._graph_path(Mode.WARMUP, sig.key(padded), args, kwargs)[0]

    def capture(self, args, kwargs, padded, sig, pool) -> Captured:
        key = sig.key(padded)
        self._mark_dynamic(args, kwargs, sig)
        larger = sig.largest_above(padded)  # its owned outputs take ours (output_sharing)
        share_key = None if larger is None else sig.key(larger)
        outputs, ran = self._graph_path(Mode.CAPTURE, key, args, kwargs, pool, simulation_enabled(),
                                        share_key, padded)
        if not ran:
            raise CaptureError("Dynamo produced no FX graph for the forward, so there is nothing to capture")
        forward = ran[0]
        code = self._code_of.get(id(forward))
        if len(ran) != 1 or code is None:
            raise CaptureError(
                f"the capture call ran {len(ran)} compiled graphs; a replay needs exactly one with known bytecode"
            )
        graph_fn = self._graph_fn
        direct = types.FunctionType(code, graph_fn.__globals__, graph_fn.__name__, graph_fn.__defaults__,
                                    graph_fn.__closure__)
        direct.__kwdefaults__ = graph_fn.__kwdefaults__
        forward.finish(key)  # simulated graphs too: host tensors are their own aliases, the bookkeeping is the same
        graphs = sum(1 for p in forward.pieces if key in p.entries)
        captured_ids = forward.output_ids(key)
        out_leaves, _ = flatten(outputs, self.adapter.is_tensor)
        stable = all(id(t) in captured_ids for t in out_leaves)
        keepalive = [_ReleaseSize(forward, key)]
        one_graph = len(forward.split.pieces) == 1 and len(forward.pieces) == 1 and graphs == 1
        graph_args = forward.captured_args.pop(key, None)
        replay = _in_replay_mode(self.state, key, functools.partial(direct, self.model, *args, **kwargs))
        stores = self._stores_of.get(id(forward))
        made = None if stores is None else replay_stores(code, stores)
        if stable and _tensors_only(outputs, self.adapter.is_tensor) and made is not None \
                and pure_replay_code(code, *stores_names(stores)):
            # The transformed code would only read the same inputs and return these very tensors: run
            # the one graph, or the split module's pieces on the inputs it gathered at capture.
            self.direct_replays += 1
            # Piecewise: the pieces' graphs and the eager pieces on the arguments they got at capture
            # (pieces.ReplayPlan), or where that is not sound the split module's forward on what the
            # transformed code handed it at capture (parameters, the static input buffers, sizes).
            plan = forward.plans.get(key)
            if one_graph:
                work = forward.pieces[0].entries[key].graph.replay
            elif plan is not None:
                work = plan
                self.planned_replays += 1
            else:
                work = _in_replay_mode(self.state, key, functools.partial(forward.split.module.forward, *graph_args))
            replay = self._tensors.direct(work, replay, outputs, made, graph_fn.__globals__)
        check = _guard_check(self._graph_code, code, graph_fn, self.model, args, kwargs, self._trace_hook) \
            if self.config.guarded_replays else None
        return Captured(outputs, replay, stable, graphs, graphs, keepalive=keepalive, check=check)

    def release(self) -> None:
        for forward in self.forwards:
            forward.release()
        self._tensors = _ModuleTensors(self.model)

    # -- internals ---------------------------------------------------------------------------------
    def _mark_dynamic(self, args, kwargs, sig) -> None:
        for leaf, dim in sig.dynamic_leaves(args, kwargs, self.adapter.is_tensor):
            # One dynamic trace serves every size >= 2 (Dynamo specialises sizes 0 and 1, so
            # size 1 is traced once more); "maybe": a forward that specialises the dim still works.
            torch._dynamo.maybe_mark_dynamic(leaf, dim)

    def _ensure_graph_path(self) -> None:
        if self._compiled is not None:
            return
        self._trace_hook = fx_split.splitting_op_router(self.selection)
        self._graph_fn = private_copy(self.forward_fn)
        self._graph_code = self._graph_fn.__code__
        _OWNERS[id(self._graph_code)] = self
        _install_hook()
        self._compiled = torch.compile(self._graph_fn, backend=self._backend, fullgraph=True, dynamic=None,
                                       options={"guard_filter_fn": _replay_guards})

    def _graph_path(self, mode: Mode, key, args, kwargs, pool=None, simulate=False, share_key=None, padded=0):
        self._ensure_graph_path()
        state = self.state
        before = graphs_compiled()
        state.begin(mode, key, pool, simulate, share_key, padded)
        try:
            with split.active_hook(self._trace_hook):
                outputs = self._compiled(self.model, *args, **kwargs)
            ran = list(state.forwards_run)
        except torch._dynamo.exc.Unsupported as exc:
            raise CaptureError(
                "graph_opt_level>=1 traces forward as one Dynamo graph, so that replays can skip Dynamo's guards, "
                f"and Dynamo could not: {exc}. Make that code traceable, move it into a splitting op (a "
                "torch.library custom op or a @graph_opt.splitting_op function), or use graph_opt_level=0"
            ) from exc
        finally:
            state.end()
            self.translations += graphs_compiled() - before
            _restore_guard_settings()
        return outputs, ran

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        """The torch.compile backend of the graph path: split, compile pieces (level 2), wrap for per-size graphs."""
        _fast_guards()  # Dynamo builds this graph's guards after the backend returns
        graph = fx_split.split_graph(gm, self._split_at, keep_host_ops_out=fx_split.computes_on_device(gm))
        if self.selection is not None:
            for piece in graph.pieces:
                for name in piece.split_ops:
                    self.selection.mark_seen(name)
        compiled = _inductor_pieces(graph, example_inputs) if self.level >= 2 else {}
        module = graph.module
        runners = []
        for piece in graph.pieces:
            sub = getattr(module, piece.name)
            if piece.capturable:
                runner = CapturablePiece(piece.name, compiled.get(piece.name, sub.forward), self.state, self.adapter)
                runners.append(runner)
                module.__dict__[piece.name] = runner  # the split module's forward calls self.<name>
            else:
                module.__dict__[piece.name] = EagerPiece(sub.forward, self.state)  # skips nn.Module.__call__
        forward = CompiledForward(graph, runners, self.state)
        self._stores_of[id(forward)] = constant_stores()
        self.forwards.append(forward)
        self._pending.append(forward)
        logger.debug("graph_opt: Dynamo graph of %d ops split into %d pieces (%d capturable)",
                     sum(p.ops for p in graph.pieces), len(graph.pieces), len(runners))
        return forward

    def _on_transformed_code(self, code: types.CodeType) -> None:
        # The bytecode hook runs after the backend returned, once per traced frame; the graph the
        # backend made last is the one this code calls.
        if self._pending:
            self._code_of[id(self._pending[-1])] = code
            self._pending.clear()


_saved_guard_settings: Dict[str, Any] = {}


def _fast_guards() -> None:
    """Build the guards of the graph being compiled (which every replay evaluates: guarded_replays) to
    skip the subtrees of nn modules whose __dict__s are unchanged (dict tags), where this torch has it.
    It assumes, as torch does for it, that functions' __code__, __defaults__ ... are not rebound. Set
    from the backend, which Dynamo calls before it builds the guards, and restored after the call
    (_restore_guard_settings): a config.patch per call cost 27 us and leaked memory."""
    config = torch._dynamo.config
    name = "use_recursive_dict_tags_for_guards"
    if hasattr(config, name) and name not in _saved_guard_settings:
        _saved_guard_settings[name] = getattr(config, name)
        setattr(config, name, True)


def _restore_guard_settings() -> None:
    if _saved_guard_settings:
        config = torch._dynamo.config
        for name, value in _saved_guard_settings.items():
            setattr(config, name, value)
        _saved_guard_settings.clear()


def _replay_guards(entries):
    """guard_filter_fn of the graph path: every guard but the parameters' and buffers' tensor metadata
    (dtype, shape, requires_grad ...). Replays run under no_grad, so requires_grad_ does not matter, and
    a conversion (to(), half()) is seen by the model-state check (replay_guards), as are hooks added to
    submodules (Dynamo skips guards on those: skip_nnmodule_hook_guards)."""
    return [not (e.guard_type == "TENSOR_MATCH" and ("._parameters[" in e.name or "._buffers[" in e.name))
            for e in entries]


def _guard_check(original_code, code, graph_fn, model, args, kwargs, trace_hook):
    """Dynamo's guards of the cache entry whose transformed code the replays call, evaluated as a call
    with the capture's own arguments would, with graph_opt's own state as it was when Dynamo traced:
    the capture flags (guards.as_captured) and the hook that routes splitting ops to one FX node.
    None when the guards hold; else ("guard", the failing guard)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entry = next((e for e in _debug_get_cache_entry_list(original_code) if e.code is code), None)
    manager = getattr(entry, "guard_manager", None)
    if manager is None:
        raise CaptureError("Dynamo's cache holds no guards for the captured code; replays could not check that the "
                           "Python state the forward read is unchanged (set guarded_replays: false to replay "
                           "without that check)")
    bound = inspect.signature(graph_fn).bind(model, *args, **kwargs)
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)  # the static buffers and values the capture ran with
    is_inference = torch.is_inference_mode_enabled

    def holds(f_locals):
        saved = split._split_hook
        split._split_hook = trace_hook
        try:
            return manager.check(f_locals)
        finally:
            split._split_hook = saved

    def check():
        if is_inference():
            # The captured graph computes the same in inference mode; only the tensors' dispatch keys
            # differ there, which Dynamo's tensor guards would read as a change.
            with torch.inference_mode(False), torch.no_grad():
                ok = as_captured(holds, frame_locals)
        else:
            ok = as_captured(holds, frame_locals)
        if ok:
            return None
        return ("guard", _failed_guard(manager, frame_locals, trace_hook))

    return check


def _failed_guard(manager, frame_locals, trace_hook) -> str:
    """The first failing guard, as Dynamo words it, with the model code it came from."""
    def verbose():
        saved = split._split_hook
        split._split_hook = trace_hook
        try:
            return manager.check_verbose(frame_locals).verbose_code_parts
        finally:
            split._split_hook = saved

    with torch.inference_mode(False), torch.no_grad():
        parts = as_captured(verbose)
    if not parts:
        return "a guard of the captured graph failed (Dynamo gave no detail)"
    guard, _, where = parts[0].partition("#")
    guard = " ".join(guard.split())
    where = " ".join(where.split())
    return (f"Python state the forward read changed since capture: Dynamo's guard `{guard}` fails"
            + (f" (from: {where})" if where else ""))


def _in_replay_mode(state: GraphState, key, run):
    """run() with every piece in REPLAY mode for this size's key."""
    replay_mode, eager_mode = Mode.REPLAY, Mode.EAGER

    def replay():
        state.mode = replay_mode
        state.key = key
        try:
            return run()
        finally:
            state.mode = eager_mode

    return replay


class _ModuleTensors:
    """Whether the model still holds the parameter and buffer objects its graphs read.

    A direct replay skips the transformed code that would have read them anew; a parameter replaced by
    a new object must still reach the graph (the bytecode path copies it in). Replacing one goes through
    torch's registration hooks, which bump a process-wide count: a replay compares one integer, and
    only after a registration anywhere looks at the model's tensors again. Once one was replaced, the
    replays go through the transformed code for good (until clear_graphs)."""

    def __init__(self, model):
        self.model = model
        self.snapshot = None  # ids of the model's parameters and buffers when the first graph was captured
        self.seen = -1
        self.moved = False

    def current(self):
        return module_fingerprint(self.model)

    def direct(self, graph_replay, bytecode_replay, outputs, stores=(), f_globals=None):
        _install_registration_hooks()
        if self.snapshot is None:
            self.snapshot = self.current()
            self.seen = _registrations[0]
        count = _registrations

        if not stores:
            def replay():
                if count[0] != self.seen and not self._unchanged():
                    return bytecode_replay()
                graph_replay()
                return outputs

            return replay

        def replay_and_store():
            if count[0] != self.seen and not self._unchanged():
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

    def _unchanged(self) -> bool:
        if not self.moved and self.current() == self.snapshot:
            self.seen = _registrations[0]
            return True
        self.moved = True
        return False


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
    import dis

    if not stores:
        return ()
    stored = {s[1] for s in stores}
    instructions = list(dis.get_instructions(code))
    plain = any(ins.opname == "STORE_ATTR" and ins.argval in stored for ins in instructions)
    helper = any(ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == _STORE_HELPER for ins in instructions)
    if plain == helper:
        return None
    setter = setattr if plain else torch._dynamo.utils.object_setattr_ignore_descriptor
    return tuple((setter, chain[0], chain[1:], name, value) for chain, name, value in stores)


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


def _traced(gm: torch.fx.GraphModule, example_inputs):
    """Level 1 without graphs: the FX graph Dynamo traced, run as it is."""
    return gm.forward


def _inductor_pieces(graph: fx_split.SplitGraph, example_inputs) -> Dict[str, Any]:
    """Compile every capturable piece with Inductor, for symbolic sizes (one compile serves every size).

    Each piece needs example inputs of its own: run the split module on fake tensors, as vLLM's
    PiecewiseCompileInterpreter does, and compile each piece on the fake arguments it receives.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    names = {p.name for p in graph.capturable}
    compiled: Dict[str, Any] = {}
    fake_mode = detect_fake_mode(example_inputs)

    class _CompileOnTheWay(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in names and target not in compiled:
                compiled[target] = _compile_piece(compile_fx, self.fetch_attr(target), list(args))
            return super().call_module(target, args, kwargs)

    fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with fake_mode:
        _CompileOnTheWay(graph.module).run(*fake_args)
    return compiled


def _compile_piece(compile_fx, piece: torch.fx.GraphModule, fake_args):
    """Inductor returns a sequence of outputs; a piece with one output is unwrapped again, so the
    split module sees what the uncompiled piece returned."""
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compile_fx(piece, fake_args)
    graph = torch.fx.Graph()
    value = graph.graph_copy(piece.graph, {})  # copies every node but the output; returns its value
    graph.output((value,))
    compiled = compile_fx(torch.fx.GraphModule(piece, graph), fake_args)

    def first(*args):
        return compiled(*args)[0]

    return first
