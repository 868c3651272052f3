"""What the framework-neutral core needs from a framework, written down: the adapter (tensors, graphs,
host copies, module introspection), the autograd bridge of training graphs, and the static strategy
of levels >= 1 with its traits as data. And the graph recorder a capture records with: the device's
graphs or the host stand-in's.

Implementations live in backends/<framework>/ (adapter.py, autograd_bridge.py, dynamo.py / sot.py),
level0.py, device_graphs.py and host_graphs.py. tests/test_contracts.py checks that every member the
core calls is declared here and that each backend, and each recorder, has every member declared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple


class DeviceGraph(Protocol):
    """One captured graph: capture_begin() ... capture_end(), then replay() any number of times."""

    def capture_begin(self) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class Tensors(Protocol):
    """Tensors: their metadata, views, copies and fills. Read on every replay: keep them plain reads."""

    def is_tensor(self, x: Any) -> bool: ...

    def shape(self, t) -> Sequence[int]: ...

    def dtype(self, t) -> Any: ...  # compared with != on every replayed leaf

    def device(self, t) -> Any: ...  # compared with != on every replayed leaf; str() names it

    def stride(self, t) -> Sequence[int]: ...

    def data_ptr(self, t) -> int: ...

    def extent(self, t) -> Tuple[int, int]: ...  # (start, end) bytes its elements span, gaps of a view included

    def nbytes(self, t) -> int: ...

    def numel(self, t) -> int: ...

    def layout(self, t) -> Any: ...  # hashable (dtype, device): what a buffer must share to hold t

    def dense(self, t) -> bool: ...  # every element has a location of its own (a copy_ into t is defined)

    def version(self, t) -> int: ...  # counts in-place writes to t's memory (views share it)

    def mark_written(self, t) -> None: ...  # moves version(t) as a write would, values untouched

    def clone(self, t): ...

    def copy_(self, dst, src) -> None: ...  # in place, shapes equal

    def narrow(self, t, dim: int, length: int): ...  # a view of the first `length` rows along dim

    def rows(self, t, dim: int, start: int, stop: int): ...  # a view of rows [start, stop) along dim

    def select(self, t, index: int): ...  # t[index]

    def zeros_like(self, t, dim: Optional[int], size: int): ...  # like t, with t.shape[dim] = size

    def fill_(self, t, value) -> None: ...

    def fill_rows(self, t, dim: int, start: int, stop: int, value) -> None: ...

    def compact(self, t): ...  # t with every broadcast (stride-0) dimension cut to one element

    def alias(self, t): ...  # a new tensor object over t's memory

    def weak_alias(self, t): ...  # t's memory without owning it, where the graph pool allows; else t

    def keep_values(self, t) -> None: ...  # an alias made to hold a copy of its values, in memory of its own

    value_types: Tuple[type, ...]  # non-tensor values keyed by value in a signature (dtypes, devices)

    def fits(self, value, dtype) -> bool: ...  # a Python number converts to dtype unchanged (a pad value)


class Values(Protocol):
    """Comparisons the capture checks make, and what a tensor argument is to a graph (arguments.py)."""

    def same_values(self, a, b) -> bool: ...  # same shape, dtype and elements, NaN equal to NaN

    def max_abs(self, t) -> float: ...

    def max_abs_diff(self, a, b) -> float: ...  # inf where shapes or dtypes differ

    def eps(self, t) -> float: ...  # the spacing of t's dtype at 1.0 (0 for integers)

    def all_equal_to(self, t, value) -> bool: ...

    def keep_changes(self, before, want, got): ...  # got where want differs from before, want elsewhere

    def other_writes(self, before, want, got): ...  # want where it differs from before, got elsewhere

    def shifted(self, t): ...  # a copy of t plus a ramp of distinct values (floating tensors)

    def varied(self, t): ...  # t, or where floating with every element equal, a tensor of distinct values

    def on_host(self, t) -> bool: ...  # in host memory (a CPU tensor)

    def host_bytes(self, t) -> bytes: ...  # a host tensor's elements, as the bytes a kernel reads

    def static_address(self, t) -> bool: ...  # marked to be read in place (graph_opt.mark_static_address)


class Context(Protocol):
    """The mode a call runs in: autograd, autocast and default dtype, math mode."""

    name: str  # "torch" | "paddle"

    def grad_enabled(self) -> bool: ...

    def no_grad(self) -> ContextManager: ...

    def synchronize(self) -> None: ...

    def ambient(self) -> Any: ...  # autocast and default dtype a replay must match; None in the common case

    def describe_ambient(self, ambient) -> str: ...

    def math_mode(self) -> Tuple: ...  # TF32, reduced-precision reductions, deterministic algorithms

    def math_mode_counter(self) -> Any: ...  # grows when a math-mode setter runs (len() compared)

    def describe_math_mode(self, was, now) -> str: ...


class Graphs(Protocol):
    """Recording and replaying device graphs, and their memory."""

    def graphs_supported(self) -> bool: ...

    def new_pool(self) -> Any: ...

    def new_graph(self, pool: Any) -> DeviceGraph: ...

    def capture_stream(self) -> ContextManager: ...  # entered around warmups, capture and split ops

    def memory_in_use(self) -> Optional[int]: ...  # device bytes reserved, None where not measurable

    def release_memory(self) -> None: ...

    def after_failed_capture(self) -> None: ...  # a capture that raised inside: the generators' capture state


class Recorder(Protocol):
    """How graphs are recorded and replayed: on the device (device_graphs.DeviceGraphs: the adapter's
    CUDA graphs, pools and memory accounting) or by the host stand-in (host_graphs.HostGraphs, under
    graph_opt.testing.simulate_cuda_graphs()). A capture picks one (host_graphs.graphs_for) and calls the
    same methods whichever it is; where the stand-in differs in structure, the difference is inside it."""

    def available(self) -> bool: ...  # graphs can be captured here

    def new_pool(self) -> Any: ...  # None: no pool (the host)

    def memory_in_use(self) -> Optional[int]: ...  # None where not measurable

    def release_memory(self) -> None: ...

    # inference
    def record(self, fn, pool) -> Tuple[Any, list]: ...  # (a replay doing fn's work, graphs to keep alive)

    def record_outputs(self, fn, pool, share=None) -> Tuple[Any, Any]: ...  # (fn's outputs, a graph rewriting them)

    # An op that records its own graph when told (Paddle's run_program): (its outputs, a replay given the op's
    # call with the replay state, a graph to keep alive or None). `plain` is the op without graphs.
    def op_recorded(self, capture, plain) -> Tuple[Any, Any, Any]: ...

    def capture_eager(self, eager, args, kwargs, pool, tail=None, share=None) -> Any: ...  # level 0's Captured

    # training (training_graphs.py): one key's forward and backward
    def capturing_parameters(self, bridge, module, params) -> ContextManager: ...  # the params the graphs read

    # Before the capture: a device's private run of forward and backward; what `writes` then finds written
    def warm_up_step(self, bridge, forward, needs_grad: bool, grad_inputs, writes, rng) -> set: ...

    def step_forward(self, bridge, forward, pool) -> DeviceGraph: ...

    def captured_writes(self, writes) -> set: ...  # what the capture itself wrote (the stand-in's runs the forward)

    def step_backward(self, bridge, forward, inputs, grad_out_buffers, pool, used=None) -> DeviceGraph: ...

    def keep(self, graph, *written) -> None: ...  # the tensors a replay of graph writes (the stand-in copies there)

    def kept_outputs(self, outputs): ...  # the capture's outputs kept for a partial backward, or None

    def partial_outputs(self, step): ...  # a StepGraphs' differentiable outputs with their autograd graph

    def weak_alias(self, t): ...  # a tensor the capture allocated, as a key holds it

    def after_capture(self, bridge, rng) -> None: ...


class HostCopies(Protocol):
    """Device-to-host copies the host does not wait for (host_outputs.py): pinned rings and events."""

    def pinned_like(self, t): ...

    def pinned_like_ring(self, t, depth: int): ...

    def host_slots(self, pinned, like): ...  # the ring as a device-visible tensor, or None

    def host_view(self, t): ...  # a numpy array over a pinned buffer's memory

    def host_numpy(self, t): ...

    def new_event(self, like): ...

    def record_event(self, event) -> None: ...

    def event_done(self, event) -> bool: ...

    def event_wait(self, event) -> None: ...

    def copy_to_host_async(self, buffers, sources): ...

    def slot_counter(self, like): ...

    def advance_slot(self, counter, depth: int) -> None: ...

    def set_slot(self, counter, slot: int) -> None: ...

    def copy_into_slot(self, ring, counter, src) -> None: ...


class Modules(Protocol):
    """A model's modules as the change watch reads them (module_watch.py)."""

    framework_attributes: frozenset  # a module's own bookkeeping attributes, never user state

    def model_tensors(self, model) -> list: ...  # its parameters and buffers

    def training_modules(self, model) -> list: ...  # 'path (Class)' of its dropout / batch-norm modules in training mode

    def named_buffers(self, model): ...

    def module_dicts(self, model) -> list: ...  # each module's __dict__, the model's first

    def module_classes(self, model) -> list: ...  # in module_dicts' order

    def named_modules(self, model) -> list: ...  # (path, module) of the model and every submodule, in module_dicts' order

    def module_tensor_ids(self, model): ...  # (name, id) of every parameter, buffer and submodule

    def tensor_fingerprint(self, model): ...  # (id, address, dtype, device, shape, strides) of each

    def hooks_fingerprint(self, dicts): ...  # the hooks that run inside the forward

    def call_hooks(self, model) -> bool: ...  # calling model runs hooks around its forward

    # Process-wide change counters ([count] lists a patched framework method bumps): a replay compares
    # one int where nothing changed (backends/call_counters.py)
    def mode_counter(self) -> list: ...  # train() / eval()

    def registration_counter(self) -> list: ...  # parameters, buffers, submodules registered or deleted

    def conversion_counter(self) -> list: ...  # to(), half(), cuda() ..., a parameter's .data assigned

    def hook_counter(self) -> list: ...  # a hook handle made or removed

    def attribute_counter(self) -> list: ...  # an attribute of a module set or deleted


class IdentityCompiler(Protocol):
    """What watch/dict_reads.Reads.compile_with takes: (object, kind, name, expected) checks, kind "class"
    (type(object) is expected), "dict" (its own __dict__ is expected) or "attr" (object.__getattribute__(
    object, name) is expected, `cell_contents` for a cell), compiled into a callable that is True while all
    hold; None where they cannot be (Reads keeps its Python check). backends/torch/compiled_reads.py."""

    def __call__(self, items: Sequence[tuple]) -> Optional[Any]: ...


class Adapter(Tensors, Values, Context, Graphs, HostCopies, Modules, Protocol):
    """Everything the core asks of a framework, besides training's autograd bridge and the static
    strategy. The static path's behaviour the runner must know:"""

    static_follows_ambient: bool  # the translated forward follows autocast/dtype changes (Dynamo) or not (SOT)
    static_makes_python_stores: bool  # the translated code around the graphs makes the forward's stores
    static_reads_replaced_tensors: bool  # the static path reads a replaced parameter anew
    static_folds_host_constants: bool  # the tracer makes a tensor of Python numbers once (no host copy per call)


def _never() -> bool:
    return False


def _always() -> bool:
    return True


@dataclass(frozen=True)
class DataParallel:
    """What a data-parallel wrapper around a graphed module asks of its block (AutogradBridge.data_parallel)."""

    # Asked at each capture and warm-up (a wrapper may turn it on later: DDP._set_static_graph()): it
    # refuses a replayed backward that hands a parameter it left out an empty gradient.
    static_graph: Callable[[], bool] = _never
    ready: Callable[[], bool] = _always  # keys with a backward run eagerly until this says True


class AutogradBridge(Protocol):
    """What a training block (training_block.py, training_graphs.py) needs of a framework's autograd."""

    # tensors
    def is_tensor(self, x) -> bool: ...

    def leaf_key(self, t) -> Any: ...  # shape, dtype, requires-grad, device, layout: part of a key

    def requires_grad(self, t) -> bool: ...

    def static_input(self, t): ...  # a static buffer like t (its layout, its requires-grad flag)

    def detach(self, t): ...

    def clone(self, t): ...

    def zero_(self, t) -> None: ...

    def zeros_like(self, t): ...

    def ones_like(self, t): ...

    def copy_detached(self, dst, src) -> None: ...

    def same_memory(self, a, b) -> bool: ...

    def addresses(self, tensors): ...

    # autograd
    def grad_enabled(self) -> bool: ...

    def enable_grad(self) -> ContextManager: ...

    def grad(self, outputs, inputs, grad_outputs, retain_graph: bool = False): ...

    def apply(self, block, graphs, tensors): ...  # the custom autograd function whose backward replays

    def graph_mark(self) -> Any: ...  # a point in autograd's node sequence

    def outside_tensors(self, outputs, known, mark): ...  # leaves requiring grad reached from outputs

    def reached_from(self, outputs, leaves): ...

    def keeps_graph(self) -> bool: ...  # inside a backward: retain_graph=True

    def check_nested_grad(self) -> None: ...

    def saved_as_views(self) -> ContextManager: ...

    def saved_tensor_hooks_active(self) -> bool: ...

    def leaf_hooks_off(self, tensors) -> ContextManager: ...

    def hand_out(self, buffers, inputs, lent, nodes): ...  # the gradients backward returns, one per input
    # (nodes: a dict the block keeps per parameter, {id: (param, None)} at first, for the bridge's own use)

    def unshared(self, grads, taken): ...

    def set_grad(self, t, grad) -> None: ...

    def snapshot_grads(self, tensors): ...

    def restore_grads(self, snapshot) -> None: ...

    # the module
    def all_parameters(self, module): ...

    def trainable_parameters(self, module): ...

    def trainable_flags(self, params) -> list: ...

    def parameters_for_capture(self, module, params) -> ContextManager: ...

    def owned_tensors(self, module): ...  # (owner dict, name, tensor) of parameters, buffers, attributes

    def tensor_attributes(self, module): ...

    def uninitialized(self, module) -> bool: ...  # a lazy parameter not yet materialised

    def data_parallel(self, wrapper) -> DataParallel: ...  # what a data-parallel wrapper asks of the block

    def snapshot_buffers(self, module): ...

    def restore_buffers(self, snapshot) -> None: ...

    # the step's mode and randomness
    def amp_state(self) -> Any: ...  # autocast and math mode: part of a key

    def amp_cache_disabled(self) -> ContextManager: ...

    def rng_state(self, module=None) -> Any: ...

    def set_rng_state(self, state) -> None: ...

    # levels 1 and 2
    def traced(self, fn, level: int, name: str): ...  # forward and backward graphs traced by the compiler

    def root_output(self, outputs) -> Optional[int]: ...  # the output computed from all the others


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy is, as data the core reads (instead of probing it for attributes)."""

    runs_autograd: bool = True  # its run() with autograd on gives eager's gradients; else the plain forward runs
    folds_tail: bool = False  # capture(tail=, share=) records the output copies at the end of its last graph
    records_the_plain_forward: bool = False  # its graphs are the eager forward's own kernels, writes included
    # Set where the captured path may compute otherwise than the plain forward (why, for the message):
    # padded calls that differ from eager are then checked against the plain forward at the padded size
    verify_path: Optional[str] = None
    describe: str = "the captured path"  # named in capture errors


class StaticStrategy(Protocol):
    """How a runner warms up, captures and runs a forward: level0.EagerStrategy, backends' DynamoStrategy
    (torch, levels 1-2) and SotStrategy (Paddle, level 1)."""

    traits: StrategyTraits
    translations: int  # forwards the translator traced (stats().translations)
    pass_counts: Dict[str, int]  # what program passes did (stats())
    value_branches: List[str]  # "file:line" where the captured forward read a tensor's value on the host

    def run(self, args, kwargs): ...  # the call without graphs (the translated forward at levels >= 1)

    def warmup(self, args, kwargs, padded: int, sig) -> Any: ...

    def capture(self, args, kwargs, padded: int, sig, pool) -> Any: ...  # a captured_size.Captured

    def release(self) -> None: ...
