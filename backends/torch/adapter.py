"""PyTorch tensors and CUDA graphs behind the core's adapter protocol.

Capture follows torch/cuda/graphs.py (side-stream warmup and capture, one private memory pool) with
two differences that matter for many sizes:
- one capture stream is created per process and reused for the warmups and capture of every size.
  Every new stream gets its own cuBLAS workspace: a new side stream per size held 952 MiB for 35
  sizes where one reused stream held 68 MiB (measured on an H200);
- torch.cuda.graph() runs gc.collect() and empty_cache() before every graph. Here graphs are made
  with CUDAGraph.capture_begin/capture_end directly, the core collects once per capture phase
  (paused_gc), and while the capture phase runs both calls are no-ops, as in vLLM, so code reached
  from it (a library entering torch.cuda.graph, Inductor's first run) cannot pay for them per graph.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import operator
import warnings

import torch
from torch.nn.modules import module as _module_mod

from ...replay.static_address import MARK
from . import math_mode
from .host_copies import TorchHostCopies, device_alias
from .module_counters import (
    _conversions, _hook_changes, _install_conversion_counter,
    _install_hook_counter, _install_mode_counter, _install_registration_hooks, _mode_changes, _registrations,
    module_fingerprint, tensor_layout,
)
logger = logging.getLogger("graph_opt")
_NO_COUNT = [0]  # attribute_counter(): never bumped


class TorchGraph:
    """One torch.cuda.CUDAGraph, allocating from `pool` (a graph_pool_handle) when one is given."""

    __slots__ = ("_graph", "_pool", "replay")

    def __init__(self, pool):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool
        self.replay = self._graph.replay  # bound once: replay is the hot path

    def capture_begin(self) -> None:
        if self._pool is None:
            self._graph.capture_begin()
        else:
            self._graph.capture_begin(pool=self._pool)

    def capture_end(self) -> None:
        self._graph.capture_end()

    def reset(self) -> None:
        self._graph.reset()


def _no_op(*args, **kwargs):
    return 0


class TorchAdapter(TorchHostCopies):
    """The contract's groups; the host copies (contracts.HostCopies) in host_copies.py."""

    name = "torch"

    def __init__(self):
        self._tensor = torch.Tensor
        self._stream = None  # the one capture stream, created on first use
        TorchHostCopies.__init__(self)

    # -- tensors ---------------------------------------------------------------------------------
    def is_tensor(self, x) -> bool:
        return isinstance(x, self._tensor)

    # C-level callables, not methods: these run for every argument of every replay.
    shape = staticmethod(operator.attrgetter("shape"))
    dtype = staticmethod(operator.attrgetter("dtype"))
    device = staticmethod(operator.attrgetter("device"))

    def zeros_like(self, t, dim, size):
        shape = list(t.shape)
        if dim is not None:
            shape[dim] = size
        # Plugin-owned buffers are never inference tensors: a capture under torch.inference_mode() must
        # still replay for a call under no_grad(), which copies into them.
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=t.dtype, device=t.device)

    def clone(self, t):
        with torch.inference_mode(False):
            return t.clone()

    def fill_(self, t, value) -> None:
        t.fill_(value)

    def fill_rows(self, t, dim, start, stop, value) -> None:
        t.narrow(dim, start, stop - start).fill_(value)

    def rows(self, t, dim, start, stop):
        return t.narrow(dim, start, stop - start)

    def stride(self, t):
        return t.stride()

    def version(self, t) -> int:
        return t._version

    def mark_written(self, t) -> None:
        torch.autograd.graph.increment_version(t)

    def dense(self, t) -> bool:
        """Whether every element has a memory location of its own (a copy_ into t is defined)."""
        return t.is_contiguous()

    def compact(self, t):
        """t with every broadcast (stride-0) dimension cut to one element."""
        for dim, (size, step) in enumerate(zip(t.shape, t.stride())):
            if step == 0 and size > 1:
                t = t.narrow(dim, 0, 1)
        return t

    def varied(self, t):
        """t, or where it is floating with every element equal (zeros, a dummy input), a tensor of its
        shape and dtype whose elements all differ: capture_checks compares rows with padding rows."""
        if not t.is_floating_point() or t.numel() < 2 or not bool((t == t.reshape(-1)[0]).all()):
            return t
        with torch.inference_mode(False):
            ramp = (torch.arange(t.numel(), dtype=torch.float64, device=t.device) * _GOLDEN).remainder_(1.0) - 0.5
        return ramp.reshape(t.shape).to(t.dtype)

    def shifted(self, t):
        """A copy of t plus a ramp whose elements all differ (floating tensors; a copy of others): another
        state a capture check starts from, where a write of the value an element held shows."""
        if not t.is_floating_point() or t.numel() == 0:
            return t.clone()
        with torch.inference_mode(False):
            ramp = (torch.arange(t.numel(), dtype=torch.float64, device=t.device) * _GOLDEN).remainder_(1.0) + 0.5
        return t + ramp.reshape(t.shape).to(t.dtype)

    def all_equal_to(self, t, value) -> bool:
        return bool((t == value).all())

    def max_abs_diff(self, a, b) -> float:
        """The largest |a - b| (NaN where both are NaN counts as equal); inf where shapes or dtypes differ."""
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not (a.is_floating_point() or a.is_complex()):
            return 0.0 if torch.equal(a, b) else float("inf")
        both_nan = torch.isnan(a) & torch.isnan(b)
        diff = (a.double() - b.double()).abs().masked_fill(both_nan, 0)
        return float(diff.max()) if diff.numel() else 0.0

    def fits(self, value, dtype) -> bool:
        """Whether a Python number converts to dtype unchanged (a pad value)."""
        if dtype.is_floating_point or dtype.is_complex:
            return True
        if dtype == torch.bool:
            return value in (0, 1)
        if isinstance(value, float) and not value.is_integer():
            return False
        info = torch.iinfo(dtype)
        return info.min <= value <= info.max

    def eps(self, t) -> float:
        """The spacing of t's dtype at 1.0 (0 for integers): what rounding alone can change."""
        return torch.finfo(t.dtype).eps if (t.is_floating_point() or t.is_complex()) else 0.0

    def max_abs(self, t) -> float:
        if not (t.is_floating_point() or t.is_complex()) or not t.numel():
            return 0.0
        return float(t.double().abs().nan_to_num(0, 0, 0).max())

    def narrow(self, t, dim, length):
        return t.narrow(dim, 0, length)

    copy_ = staticmethod(torch.Tensor.copy_)  # copy_(dst, src)

    def data_ptr(self, t) -> int:
        return t.data_ptr()

    def on_host(self, t) -> bool:
        return t.device.type == "cpu"

    def static_address(self, t) -> bool:
        # torch's own marker (torch._dynamo.mark_static_address; transformers' StaticCache sets it) means the same
        return getattr(t, MARK, False) or getattr(t, "_dynamo_static_input_type", None) is not None

    def same_values(self, a, b) -> bool:
        """Same shape, dtype and elements, NaN equal to NaN (a NaN input is not a changed one)."""
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        return (a.is_floating_point() or a.is_complex()) and bool(_equal_elements(a, b).all())

    def keep_changes(self, before, want, got):
        """got where want differs from before, want elsewhere (NaN equal to NaN): the elements one run
        changed, as another run left them."""
        return torch.where(_equal_elements(before, want), want, got)

    def other_writes(self, before, want, got):
        """want where it differs from before, got elsewhere (NaN equal to NaN): the state one run left,
        with what only another run wrote."""
        return torch.where(_equal_elements(before, want), got, want)

    def alias(self, t):
        """A new tensor object over t's memory: what a replay hands out (graph_opt/replay/handed_outputs.py)."""
        return t.detach()

    def keep_values(self, t) -> None:
        """A handed-out alias made to hold a copy of its values, in memory of its own."""
        with (torch.inference_mode() if t.is_inference() else torch.no_grad()):
            t.set_(t.clone())

    def training_modules(self, model) -> list:
        kinds = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm)
        return [f"{name or type(model).__name__} ({type(m).__name__})" for name, m in model.named_modules()
                if m.training and isinstance(m, kinds) and getattr(m, "p", 1) != 0]  # dropout at p=0 is the identity

    def model_tensors(self, model) -> list:
        return list(itertools.chain(model.parameters(), model.buffers()))

    def nbytes(self, t) -> int:
        return t.numel() * t.element_size()

    def numel(self, t) -> int:
        return t.numel()

    def host_bytes(self, t) -> bytes:
        # Its bytes as a kernel reads them: a NaN equal to itself, bf16 without a numpy dtype
        return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()

    def extent(self, t):
        start = t.data_ptr()
        if t.is_contiguous():
            return start, start + t.nbytes
        if not t.numel():
            return start, start
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()

    def layout(self, t):
        return (t.dtype, t.device)

    def weak_alias(self, t):
        """A tensor over t's memory that does not keep it allocated, as CUDA-graph trees do (only for
        CUDA tensors: those come from the graph pool; a host tensor is returned as is)."""
        if not t.is_cuda:
            return t
        return device_alias(t, t.device)

    # -- execution context -----------------------------------------------------------------------
    grad_enabled = staticmethod(torch.is_grad_enabled)

    def no_grad(self):
        return _no_grad_normal_tensors()

    @staticmethod
    def ambient():
        """The autocast state and default dtype a replay must match; None (the common case) without
        autocast and with float32 as the default dtype."""
        default = _default_dtype()
        if not _any_autocast():
            return None if default is _float32 else (("default dtype", default),)
        return tuple((device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                     if torch.is_autocast_enabled(device)) + ((("default dtype", default),) if default is not _float32 else ())

    @staticmethod
    def math_mode_counter() -> bytearray:
        """What setting TF32, reduced-precision reductions or deterministic algorithms appends to (len: the count)."""
        return math_mode.counter()

    math_mode = staticmethod(math_mode.now)

    @staticmethod
    def describe_math_mode(was, now) -> str:
        return math_mode.describe(was, now)

    def describe_ambient(self, ambient) -> str:
        """Both halves, whichever changed: "no autocast and torch.set_default_dtype(torch.float64)"."""
        ambient = ambient or ()
        dtype = [d for device, d in ambient if device == "default dtype"]
        casts = [f"torch.autocast({device!r}, dtype={d})" for device, d in ambient if device != "default dtype"]
        return f"{' and '.join(casts) or 'no autocast'} and torch.set_default_dtype({(dtype or [torch.float32])[0]})"

    # -- the model as a replay sees it (graph_opt.watch.replay_guards) ----------------------------------
    static_follows_ambient = True  # Dynamo guards autocast and the default dtype
    static_makes_python_stores = True  # Dynamo's transformed code makes the stores
    static_reads_replaced_tensors = True  # level >= 1: a replaced parameter reaches the graph (dynamo.py)
    static_folds_host_constants = True  # host_constants.py: the default level traces where level 0 cannot copy them
    # immutable non-tensor values (an operator such as torch.ops.aten.relu.default is one)
    value_types = (torch.dtype, torch.device, torch.layout, torch.memory_format, torch._ops.OpOverload,
                   torch._ops.OpOverloadPacket)
    def module_dicts(self, model):
        return [(path, m.__dict__) for path, m in model.named_modules(remove_duplicate=False)]

    def named_modules(self, model) -> list:
        return list(model.named_modules(remove_duplicate=False))

    def module_classes(self, model) -> list:
        """The class of each module, in module_dicts' order."""
        return [type(m) for _, m in model.named_modules(remove_duplicate=False)]

    @functools.cached_property
    def framework_attributes(self) -> frozenset:
        """Attributes nn.Module keeps for itself (hooks, training): not the model's state a replay checks."""
        return frozenset(torch.nn.Module().__dict__)

    def registration_counter(self) -> list:
        """[count] that parameter, buffer and submodule registrations bump, process-wide."""
        _install_registration_hooks()
        return _registrations

    def hook_counter(self) -> list:
        """[count] that making or removing a hook handle bumps (RemovableHandle: every module, global and
        tensor hook): a replay looks at the submodules' hooks only after a bump."""
        _install_hook_counter()
        return _hook_changes

    def hooks_fingerprint(self, dicts):
        """The hooks that run inside the forward: those of every submodule (dicts[1:]; the model's own
        run around the plugin) and the global module hooks."""
        keys = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
        return (tuple(tuple(_acting_hooks(d[k]) for k in keys) for d in dicts[1:]),
                tuple(tuple(g) for g in (_module_mod._global_forward_hooks, _module_mod._global_forward_pre_hooks,
                                         _module_mod._global_backward_hooks, _module_mod._global_backward_pre_hooks)))

    def conversion_counter(self) -> list:
        """[count] that Module._apply bumps (to, half, float, cuda, cpu ...): the conversions that keep
        the Parameter objects and change their data, which a graph reads by address."""
        _install_conversion_counter()
        return _conversions

    def attribute_counter(self) -> list:
        """A count that never moves: nn.Module.__setattr__ is not patched to count, because Dynamo then no
        longer traces any module whose forward sets an attribute ("UnspecializedNNModuleVariable missing
        method __setattr__": plain torch.compile, and graph_opt's level 1, would fail or break the graph in
        every process that captured a level-0 model). So a level-0 replay does not see a submodule's plain
        attribute set after capture (docs/replay-assumptions.md); Paddle's Layer.__setattr__ is counted."""
        return _NO_COUNT

    def tensor_fingerprint(self, model):
        """(id, address, dtype, device, shape, strides) of every parameter and buffer: where and how the
        graphs read each (ModelState compares them by object, so that a replaced one is not a conversion)."""
        return tuple(map(tensor_layout, itertools.chain(model.parameters(), model.buffers())))

    def mode_counter(self) -> list:
        """[count] that Module.train() (and so eval()) bumps, process-wide: a replay compares one integer
        and looks at every submodule's training flag only after a change."""
        _install_mode_counter()
        return _mode_changes

    def named_buffers(self, model):
        return list(model.named_buffers())

    def module_tensor_ids(self, model):
        return module_fingerprint(model)

    def call_hooks(self, model) -> bool:
        """Whether calling model runs hooks around its forward (its own, or torch's global ones)."""
        d = model.__dict__
        return bool(d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                    or d["_backward_pre_hooks"] or _module_mod._global_forward_hooks
                    or _module_mod._global_forward_pre_hooks or _module_mod._global_backward_hooks
                    or _module_mod._global_backward_pre_hooks)

    def synchronize(self) -> None:
        if self.graphs_supported():
            torch.cuda.synchronize()

    # -- graphs ----------------------------------------------------------------------------------
    def graphs_supported(self) -> bool:
        return torch.cuda.is_available()

    def new_pool(self):
        if not self.graphs_supported():
            return None
        return torch.cuda.graph_pool_handle()

    def new_graph(self, pool):
        return TorchGraph(pool)

    def after_failed_capture(self) -> None:
        """A capture that failed inside (a host sync, say) ends without the CUDA generators' capture
        epilogue (torch runs it only after a successful cudaStreamEndCapture), and every later random op
        of the process then raises "Offset increment outside graph capture". An empty capture, which
        ends well, runs the epilogue."""
        if not self.graphs_supported() or torch.cuda.is_current_stream_capturing():
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(self._stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the CUDA graph is empty"
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin()
                graph.capture_end()
                graph.reset()
        except RuntimeError as exc:
            logger.warning("graph_opt: could not reset the CUDA generators after a failed capture (%s); random "
                           "ops may fail with 'Offset increment outside graph capture'", exc)

    def capture_stream(self):
        if not self.graphs_supported():
            return contextlib.nullcontext()
        return self._on_capture_stream()

    @contextlib.contextmanager
    def _on_capture_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        current = torch.cuda.current_stream()
        stream.wait_stream(current)  # warmups read what the caller's stream wrote
        collect, empty_cache = gc.collect, torch.cuda.empty_cache
        gc.collect, torch.cuda.empty_cache = _no_op, _no_op
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            gc.collect, torch.cuda.empty_cache = collect, empty_cache
            current.wait_stream(stream)  # the caller's next work sees the capture phase's outputs

    def memory_in_use(self):
        if not self.graphs_supported():
            return None
        return torch.cuda.memory_reserved()

    def release_memory(self) -> None:
        if self.graphs_supported():
            torch.cuda.empty_cache()


_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")
# Read before every replay (ambient): bound once
_default_dtype = torch.get_default_dtype
_any_autocast = torch._C._is_any_autocast_enabled
_float32 = torch.float32


@contextlib.contextmanager
def _no_grad_normal_tensors():
    """no_grad, and out of inference mode: tensors made in the capture phase (static buffers, outputs,
    landing buffers) must be normal tensors, so that calls under no_grad can write and return them."""
    with torch.inference_mode(False), torch.no_grad():
        yield


_GOLDEN = 0.6180339887498949  # steps of it modulo 1 never repeat


def _equal_elements(a, b):
    """a == b elementwise, NaN equal to NaN."""
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same |= a.isnan() & b.isnan()
    return same


def _acting_hooks(hooks: dict) -> tuple:
    """The handles of the hooks that can change what the forward computes. transformers' output-capturing
    hooks, installed at the first call that asks for hidden states or attentions, return at once unless
    that call's collector asks for their key: a graph without them computes what they would."""
    return tuple(k for k, fn in hooks.items()
                 if not (getattr(fn, "__name__", "") == "output_capturing_hook"
                         and getattr(fn, "__module__", "") == "transformers.utils.output_capturing"))


ADAPTER = TorchAdapter()
