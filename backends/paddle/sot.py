"""Level >= 1 on Paddle: SOT translation deferred into the capture phase, graphs driven through run_program.

How one padded size goes:
- warmup: the forward runs under SOT's eval-frame callback, inside sot_warmup_guard(True) and
  capture_custom_allreduce(). The first warmup translates: SOT reads is_capturing() as true and
  bakes the capture branch. Every run_program call gets cuda_graph_state=WARMUP.
- capture: the same, with CAPTURE. Each run_program call (one per SOT subgraph) is captured by
  Paddle's run_program op (GPU builds; FLAGS_cuda_graph_blacklist splits it into pieces there) or,
  under simulate_cuda_graphs(), by a host stand-in: the capture's recorder (contracts.Recorder) says
  which. The frames SOT hands back are recorded in order.
- replay: the recorded frames are replayed through our own eval-frame callback, which checks each
  frame against the recording instead of evaluating SOT's guards. This is the point of the design:
  SOT guards the globals it read while translating, so flipping is_capturing() back to false would
  re-translate and run the non-capture branch. The plugin guards what it skips instead: the padded
  size and the non-tensor arguments are the dispatch key, and any frame that differs from the
  recording aborts the replay (ReplayDivergence) and the call runs without graphs.

The pieces, each in its own file: the hooks around a SOT call and the splitting helpers SOT reads
(sot_scope.py), the run_program hook and its records (run_program_hook.py), the checks of frames
at replay (sot_guards.py).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import paddle
from paddle.jit.dy2static.program_translator import ProgramTranslator, StaticFunction
from paddle.jit.dy2static.utils import CUDAGraphState
from paddle.jit.marker import DYNAMIC_DIMS_ATTR_NAME
from paddle.jit.sot import symbolic_translate
from paddle.jit.sot.opcode_translator import eval_frame_callback
from paddle.jit.sot.opcode_translator.custom_code import CustomCode
from paddle.jit.sot.opcode_translator.executor.executor_cache import OpcodeExecutorCache
from paddle.jit.sot.utils import StepInfoManager
from paddle.jit.sot.utils.exceptions import InnerError

from ...capture import split
from .. import frame_locals as frame_of, private_copy
from ...replay.captured_size import Captured
from ...contracts import StrategyTraits
from ...errors import CaptureError, GraphOptError, GuardFailed, ReplayDivergence
from ...capture.failures import describe
from ...watch.fallbacks import Fallback, Reason
from ...guards import as_captured
from ...recorders.host_graphs import graphs_for
from ...pytree import flatten
from .run_program_hook import ProgramHook, SizeRecord
from .sot_guards import FrameArguments, KnownTranslations, _failed_guard, _FrameView, _guard_of
from .sot_recursion import explain as explain_recursion
from .sot_scope import _Scope

logger = logging.getLogger("graph_opt")

_BLACKLIST_FLAG = "FLAGS_cuda_graph_blacklist"


def translate_count() -> int:
    return OpcodeExecutorCache().translate_count


_RUN_AS_IS = CustomCode(None, False)


def _instance_forwards(model) -> Dict[int, Any]:
    """The sublayers whose `forward` is an instance attribute (paddle.jit.to_static(layer) sets one), by id."""
    return {id(layer): layer.__dict__["forward"] for layer in model.sublayers(include_self=True)
            if "forward" in layer.__dict__}


def _undo_static_forwards(model, before: Dict[int, Any]) -> int:
    """After a failed SOT call: give back the eager forward of every sublayer SOT left converted.

    SOT infers the output of a Paddle layer, or of a layer class marked @paddle.jit.marker.unified, with
    paddle.jit.to_static(layer, full_graph=True), which sets the layer's `forward` to an ASTStaticFunction,
    and rolls that back only when the translation succeeds (paddle/jit/sot/infer_meta.py,
    infer_meta_for_layer: the rollback is not in a finally). When dy2static raises there, the layer keeps
    the StaticFunction and every later eager call of the model goes through dy2static and raises again.
    Returns how many sublayers were restored."""
    undone = 0
    for layer in model.sublayers(include_self=True):
        forward = layer.__dict__.get("forward")
        if not isinstance(forward, StaticFunction) or before.get(id(layer)) is forward:
            continue
        if id(layer) in before:
            layer.__dict__["forward"] = before[id(layer)]
        else:
            del layer.__dict__["forward"]  # the class's forward again
        undone += 1
    if undone:
        logger.debug("undid paddle.jit.to_static left by a failed SOT call on %d sublayer(s)", undone)
    return undone


class SotStrategy:
    """Warm up, capture and replay a Paddle model's forward through SOT, per padded size."""

    traits = StrategyTraits(
        describe="Paddle's SOT (its programs do not support writing their inputs: \"not support input out tensor\")",
        # Autograd through SOT's programs gave PaddleFormers' Llama wrong gradients (most None; bare
        # paddle.jit.to_static(full_graph=False) too, Paddle 3.3.1): calls with autograd on run the plain forward.
        runs_autograd=False,
        # SOT dropped in-place ops on intermediate tensors (Paddle 3.3.1): where padded calls differ from
        # eager, the check also compares a replay of the padded size itself with the plain forward.
        verify_path="Paddle's SOT can drop an in-place op on an intermediate tensor: write y = y + 1 for y.add_(1)",
    )

    def __init__(self, model, forward_fn, config, adapter, selection: Optional[split.SplitSelection]):
        self.model = model
        self.forward_fn = private_copy(forward_fn)
        self.config = config
        self.adapter = adapter
        self.selection = selection
        self.sot_kwargs = {"training": False, "backend": _backend(config), "build_strategy": None}
        self.translations = 0
        self.pass_counts: Dict[str, int] = {}
        self.program_ops: Dict[int, List[str]] = {}  # id(layer) -> op names of its forward program
        self.hook = ProgramHook(adapter, list(config.program_passes), self._on_new_program)
        self.records: Dict[Any, SizeRecord] = {}
        self._static_fns: Dict[bool, Any] = {}  # model.training -> the SOT-translating forward
        self._translator = ProgramTranslator()  # a singleton: holds paddle.jit.enable_to_static's switch
        self._scope = None
        self._cache = OpcodeExecutorCache()
        self._forwards = _instance_forwards(model)  # what a failed SOT call must leave as it found
        self._known = KnownTranslations()
        # "file:line" of each place the forward read a tensor's value on the host while captured (`if x.min()
        # > 0`, `while h.abs().max() > 1`, `.item()`): a padded call decides it over the padding rows too
        self.value_branches: List[str] = []
        self._static_batch = False  # the forward makes its batch dim a constant: translated per size (warmup)
        self.blacklist = self._blacklist_names()
        self.split_names = frozenset(
            w.__graph_opt_split__.name for w in selection.selected_functions()
        ) if selection is not None else frozenset()

    # -- strategy protocol -------------------------------------------------------------------------
    def run(self, args, kwargs):
        """Without graphs: the ordinary SOT path, guards and all (it may translate once for new shapes)."""
        if not self._translator.enable_to_static:  # paddle.jit.enable_to_static(False): dygraph, as to_static does
            return self.forward_fn(self.model, *args, **kwargs)
        training = self.model.training
        static_fn = self._static_fns.get(training)
        if static_fn is None:
            # What paddle.jit.to_static(full_graph=False) runs, made once per training flag: to_static
            # calls symbolic_translate on every call, which makes a new eval-frame callback, and
            # Paddle 3.3.1's set_eval_frame keeps a reference to every callback it is given: about
            # 450 bytes leaked per call (tests/paddle_tests/test_soak_faults.py measures it).
            static_fn = symbolic_translate(self.forward_fn, training=training, backend=self.sot_kwargs["backend"],
                                           build_strategy=None)
            self._static_fns[training] = static_fn
            if self._scope is None:
                self._scope = _Scope(self.hook, self.split_names, min_graph_size=True)
        cache = self._cache
        before = cache.translate_count
        try:
            with self._scope:
                return static_fn(self.model, *args, **kwargs)
        except (InnerError, RecursionError) as exc:  # the translator's own failure, not the forward's: say what to do
            _undo_static_forwards(self.model, self._forwards)
            recursion = explain_recursion(exc)
            if recursion is None and not isinstance(exc, InnerError):
                raise
            raise GraphOptError(
                f"{type(self.model).__name__}: this call runs without graphs (a size, shape or non-tensor value "
                f"that was not captured), which at graph_opt_level>=1 is SOT's translation of forward, and SOT "
                f"could not translate it: {recursion or describe(exc)}. Capture with these values (capture_model's "
                "make_inputs), " + ("apply the fix above" if recursion else "keep the function SOT fails in out of the "
                                    "translation (paddle.jit.not_to_static(fn))") + ", or use graph_opt_level=0"
            ) from exc
        except BaseException:
            _undo_static_forwards(self.model, self._forwards)
            raise
        finally:
            self.translations += max(0, cache.translate_count - before)

    def warmup(self, args, kwargs, padded, sig):
        record = SizeRecord(sig.key(padded))
        self._mark_dynamic(args, kwargs, sig)
        try:
            return self._translating_call(args, kwargs, CUDAGraphState.WARMUP, record, frames=None)
        except AssertionError as exc:
            # Paddle 3.3.1: a forward's first translation that makes its dynamic batch dim a constant
            # (`int(x.shape[0])`) caches nothing and fails SOT's `assert guard_fn is not None`. Such a forward
            # is translated per size, with static shapes, as SOT does for a frame first seen with them.
            if str(exc) or self._static_batch:
                raise
            self._static_batch = True
            self._unmark_dynamic(args, kwargs, sig)
            return self._translating_call(args, kwargs, CUDAGraphState.WARMUP, record, frames=None)

    def capture(self, args, kwargs, padded, sig, pool) -> Captured:
        record = SizeRecord(sig.key(padded))
        self._mark_dynamic(args, kwargs, sig)
        outputs = self._translating_call(args, kwargs, CUDAGraphState.CAPTURE, record, frames=record.frames,
                                         recorder=graphs_for(self.adapter))
        if not record.subgraphs:
            raise CaptureError(
                "SOT produced no static subgraph for the forward, so there is nothing to capture (it runs "
                "eagerly). A splitting op called directly inside a Python loop of forward does this: call it "
                "from a sublayer's forward instead, or name PIR ops in cudagraph_splitting_ops"
            )
        self.records[(id(sig), padded)] = record
        for code, _, _, _ in record.frames:
            # Paddle's eval-frame shim stops calling the callback below frames that ran a number of
            # times without a subgraph on their stack; SOT marks them only during its first steps.
            # Replays must keep reaching the recorded frames, so mark them for good.
            paddle.framework.core.sot_set_with_graph(code)
        captured_outputs = {id(t) for sub in record.subgraphs for t in sub.outputs}
        out_leaves, _ = flatten(outputs, self.adapter.is_tensor)
        stable = all(id(t) in captured_outputs for t in out_leaves)
        pieces = sum(self._pieces_of(sub.layer) for sub in record.subgraphs)
        check = self._first_frame_check(args, kwargs, record)
        diverged = _diverged_from(outputs, self.adapter.is_tensor)
        replay = self._make_replay(args, kwargs, record, first_checked=check is not None, diverged=diverged)
        return Captured(outputs, replay, stable, pieces, len(record.subgraphs),
                        keepalive=[sub.graph for sub in record.subgraphs if sub.graph is not None] + [record],
                        check=check, diverged=diverged)

    def release(self) -> None:
        for record in self.records.values():
            for sub in record.subgraphs:
                if sub.graph is not None:
                    sub.graph.reset()
            record.subgraphs.clear()
            record.frames.clear()
        self.records.clear()
        self._known.clear()

    # -- internals ---------------------------------------------------------------------------------
    def _mark_dynamic(self, args, kwargs, sig) -> None:
        if self._static_batch:
            return
        for leaf, dim in sig.dynamic_leaves(args, kwargs, self.adapter.is_tensor):
            # One symbolic program serves every batch size; without this, size 1 gets its own.
            paddle.jit.marker.dynamic_dims(leaf, [dim])

    def _unmark_dynamic(self, args, kwargs, sig) -> None:
        for leaf, _ in sig.dynamic_leaves(args, kwargs, self.adapter.is_tensor):
            if hasattr(leaf, DYNAMIC_DIMS_ATTR_NAME):
                delattr(leaf, DYNAMIC_DIMS_ATTR_NAME)

    def _translating_call(self, args, kwargs, state, record, frames, recorder=None):
        sot_kwargs = self.sot_kwargs
        guarded = self.config.guarded_replays
        known = self._known

        def callback(frame):
            custom, guard = known.find(frame)
            if custom is None:
                custom = eval_frame_callback(frame, **sot_kwargs)
            if custom.code is not None:
                guard = guard or _guard_of(frame.f_code, custom)
                arguments = FrameArguments(frame, guard)
                known.add(frame, custom, arguments)
                if frames is not None:
                    frames.append((frame.f_code, custom, arguments, guard if guarded else None))
            elif frames is not None:
                frames.append((frame.f_code, custom, None, None))
            return custom

        before = translate_count()
        self.hook.begin(state, record, recorder)
        try:
            with _Scope(self.hook, self.split_names, min_graph_size=True), self._blacklist_scope(), \
                    _host_reads_noted(self.value_branches, self.hook.shape_values), \
                    StepInfoManager().step_guard(self.forward_fn.__code__):
                old = paddle.framework.core.set_eval_frame(callback)
                try:
                    return self.forward_fn(self.model, *args, **kwargs)
                finally:
                    paddle.framework.core.set_eval_frame(old)
        except BaseException as exc:
            _undo_static_forwards(self.model, self._forwards)
            recursion = explain_recursion(exc)  # name the function that recursed, and why
            if recursion is not None:
                raise CaptureError(recursion) from exc
            raise
        finally:
            self.hook.end()
            self.translations += translate_count() - before

    def _make_replay(self, args, kwargs, record: SizeRecord, first_checked: bool, diverged):
        frames = record.frames
        count = len(frames)
        position = [0]
        hook = self.hook
        forward_fn, model = self.forward_fn, self.model
        set_eval_frame = paddle.framework.core.set_eval_frame
        replay_state = CUDAGraphState.REPLAY
        hook_calls = [0]
        expected_calls = len(record.subgraphs)
        scope = _Scope(hook, self.split_names, min_graph_size=False)

        def callback(frame):
            # SOT stops handing some frames to the callback after their first runs (frames that hold
            # no graph), so a frame recorded at capture may not come back: search forward for the
            # frame's code. What must match exactly is checked by the hook: the same programs, in
            # the same order, and all of them.
            code = frame.f_code
            i = position[0]
            while i < count:
                recorded_code, custom, arguments, guard = frames[i]
                if recorded_code is code:
                    position[0] = i + 1
                    # A non-tensor argument that changed (such as the value of a tensor that decided a Python
                    # branch before this frame) raises; objects made at every call are compared by content.
                    if arguments is not None:
                        rebound = arguments.guard_for(frame)
                        guard = rebound if guard is not None else None  # guarded_replays: false keeps None
                    # SOT's guards, with graph_opt's capture flags as at capture (the first frame's
                    # were checked before the replay: Captured.check).
                    if guard is not None and (i > 0 or not first_checked) and not as_captured(guard, frame):
                        raise GuardFailed(_failed_guard(guard, frame))
                    return custom
                i += 1
            return _RUN_AS_IS

        def replay():
            position[0] = 0
            hook.begin(replay_state, record)
            try:
                with scope:
                    old = set_eval_frame(callback)
                    try:
                        out = forward_fn(model, *args, **kwargs)
                    finally:
                        set_eval_frame(old)
            finally:
                hook_calls[0] = hook.call_index
                off_record = hook.off_record
                hook.end()
            if (hook_calls[0] != expected_calls or off_record) and not diverged(out):
                # The path differed and the forward returned captured outputs, which a program this call
                # did not replay may hold: the plain forward answers (its effects happened once already).
                raise ReplayDivergence(f"replay ran {hook_calls[0]} of the {expected_calls} subgraphs captured")
            return out

        return replay

    def _first_frame_check(self, args, kwargs, record: SizeRecord):
        """Before a replay: SOT's guards of the forward's own frame, on the arguments the capture ran
        with (the static buffers; their values are the runner's to check), with graph_opt's state as
        when SOT translated (the capture flags, the splitting hook). None when they hold, else
        a GUARD Fallback naming the failing guard. Frames after a graph break are checked as the replay
        reaches them."""
        if not record.frames or record.frames[0][3] is None or record.frames[0][0] is not self.forward_fn.__code__:
            return None
        guard = record.frames[0][3]
        bound = inspect.signature(self.forward_fn).bind(self.model, *args, **kwargs)
        bound.apply_defaults()
        # The static buffers and values the capture ran with, and the closure's variables as they are now.
        f_locals, refresh = frame_of(self.forward_fn, bound.arguments)
        frame = _FrameView(f_locals, self.forward_fn.__globals__, self.forward_fn.__code__)
        scope = _Scope(self.hook, self.split_names, min_graph_size=False)

        def check():
            if refresh is not None:
                refresh()
            with scope:
                try:
                    if as_captured(guard, frame):
                        return None
                except Exception as exc:  # a guard that cannot read the frame: this call runs eagerly
                    return Fallback(
                        Reason.GUARD, f"SOT's guard of the forward could not be evaluated ({type(exc).__name__}: "
                        f"{exc})")
                return Fallback(Reason.GUARD, _failed_guard(guard, frame))

        return check

    def _on_new_program(self, layer, counts: Dict[str, int]) -> None:
        for name, n in counts.items():
            self.pass_counts[name] = self.pass_counts.get(name, 0) + n
        ops = [op.name() for op in layer.program.forward_program.global_block().ops]
        self.program_ops[id(layer)] = ops
        if self.blacklist:
            for name in split.names_in(ops, self.blacklist):
                self.selection.mark_seen(name)

    def _pieces_of(self, layer) -> int:
        ops = self.program_ops.get(id(layer), [])
        if not self.blacklist:
            return 1
        return max(1, split.plan(ops, self.blacklist.__contains__).num_pieces)

    def _blacklist_names(self) -> List[str]:
        if self.selection is None or self.selection.names is None:
            return []
        functions = {w.__graph_opt_split__.name for w in split.registered().values()}
        functions |= {w.__graph_opt_split__.qualified_name for w in split.registered().values()}
        return [n for n in self.selection.names if n not in functions]

    @contextlib.contextmanager
    def _blacklist_scope(self):
        """FLAGS_cuda_graph_blacklist holds our splitting op names while programs are built, then is restored."""
        if not self.blacklist:
            yield
            return
        old = paddle.get_flags(_BLACKLIST_FLAG)[_BLACKLIST_FLAG]
        names = [n for n in old.split(",") if n] + [n for n in self.blacklist if n not in old.split(",")]
        paddle.set_flags({_BLACKLIST_FLAG: ",".join(names)})
        try:
            yield
        finally:
            paddle.set_flags({_BLACKLIST_FLAG: old})


_HOST_READS = ("__bool__", "item", "__int__", "__float__", "__index__", "numpy", "tolist")
_SHAPE_DTYPES = (paddle.int64, paddle.int32)
_PASSED = (os.path.dirname(paddle.__file__), os.path.dirname(os.__file__), "<")  # Paddle, stdlib, generated
# graph_opt's own code: backends/ (a folder of the checkout, or graph_opt/backends once installed) and graph_opt/
_GRAPH_OPT = tuple(os.path.join(p, "") for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 os.path.dirname(os.path.abspath(sys.modules["graph_opt"].__file__))))


def _reader(frame):
    """The frame of the model's code that made a host read, walking up from `frame` past Paddle's (SOT's
    generated code calls through its own wrappers), the standard library's and generated code (a
    dataclass's `<string>` __repr__); None where graph_opt's frames come first: graph_opt's own reads, and
    SOT's while it translates (printing a variable), under graph_opt's eval-frame callback."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_GRAPH_OPT):
            return None
        if not name.startswith(_PASSED):
            return frame
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _host_reads_noted(seen: List[str], shape_values: Dict[int, Any]):
    """While the forward runs in the capture phase: each place outside Paddle and graph_opt that reads a
    tensor's value on the host (`if x.min() > 0` and `while` on a tensor, which SOT's code evaluates with
    bool(); `.item()`, `int(t)`, `all(t)`, a comprehension over a tensor) is added to `seen` as "file:line".
    The forward's Python then depends on the values, which a padded call decides over its padding rows
    too. Seen as it runs, in every frame SOT translated, reused from another model, or left to plain
    Python; not a program's output made from its inputs' shapes alone (`shape_values`, the run_program
    hook's: `if x.numel() == 0`). Installed around the warmups and the capture only (the state lock is
    held), and put back."""
    tensor = paddle.Tensor
    real = {name: getattr(tensor, name) for name in _HOST_READS if hasattr(tensor, name)}

    def noting(name, method):
        def read(self, *args, **kwargs):
            frame = _reader(sys._getframe(1))
            # SOT's own code (its names start with # or $) reads a symbolic dim as a 0-d int64 tensor (the
            # batch size, when the forward unpacks x.shape): the padded size, which each graph holds anyway.
            if frame is not None and name != "__bool__" and frame.f_code.co_name[:1] in "#$" \
                    and not self.shape and self.dtype in _SHAPE_DTYPES:
                frame = None
            if frame is not None and shape_values.get(id(self)) is self:  # `if x.numel() == 0`: no data read
                frame = None
            if frame is not None:
                where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                if where not in seen:
                    seen.append(where)
            return method(self, *args, **kwargs)
        return read

    for name, method in real.items():
        setattr(tensor, name, noting(name, method))
    try:
        yield
    finally:
        for name, method in real.items():
            setattr(tensor, name, method)


def _diverged_from(outputs, is_tensor):
    """Captured.diverged for SOT's replays: a frame the capture did not record runs as plain Python
    (_RUN_AS_IS: the branch of `if x.min() > 0` that the capture did not take, a loop's other number of
    turns), so the forward then returns other tensors than the captured ones, and its own are right."""
    leaves, spec = flatten(outputs, is_tensor)
    ids = [id(t) for t in leaves]

    def diverged(out) -> bool:
        now, now_spec = flatten(out, is_tensor)
        return now_spec != spec or any(id(t) != i for t, i in zip(now, ids))

    return diverged


_warned_no_cinn = False


def _backend(config) -> Optional[str]:
    global _warned_no_cinn
    if config.graph_opt_level >= 2:
        if paddle.is_compiled_with_cinn():
            return "CINN"
        if not _warned_no_cinn:
            _warned_no_cinn = True
            logger.warning("graph_opt_level=2: this Paddle build has no CINN; running level 1 (SOT without CINN)")
    return None
