"""PaddlePaddle tensors and CUDA graphs behind the core's adapter protocol.

Every CUDA call is gated on is_cuda_graph_supported(): on CPU builds CUDAGraph() asserts and
CUDAGraph.end_capture() / current_stream() segfault. Written against the Paddle 3.2+ API; the real
CUDA-graph path has not been run (no Paddle GPU build runs on the machines this was built on).
"""
from __future__ import annotations

import contextlib
import functools
import math

import paddle
from paddle.device.cuda import graphs as _graphs

from ...replay.static_address import MARK
from .host_copies import PaddleHostCopies
from .layer_counters import (
    _attribute_sets, _conversions, _hook_changes, _install_hook_counter, _install_mode_counter,
    _install_registration_counter, _mode_changes, _registrations,
)


def _cuda_graphs_available() -> bool:
    return bool(_graphs.is_cuda_graph_supported()) and paddle.is_compiled_with_cuda() and \
        paddle.device.cuda.device_count() > 0


class PaddleGraph:
    """One paddle.device.cuda.graphs.CUDAGraph, allocating from `pool` when one is given."""

    def __init__(self, pool):
        self._graph = _graphs.CUDAGraph(pool_id=pool)

    def capture_begin(self) -> None:
        self._graph.capture_begin()

    def capture_end(self) -> None:
        self._graph.capture_end()

    def replay(self) -> None:
        self._graph.replay()

    def reset(self) -> None:
        if self._graph._graph is not None:
            self._graph.reset()


class PaddleAdapter(PaddleHostCopies):
    """The contract's groups; the host copies (contracts.HostCopies) in host_copies.py."""

    name = "paddle"

    def __init__(self):
        self._tensor = paddle.Tensor
        self._graphs = None
        PaddleHostCopies.__init__(self)

    def is_tensor(self, x) -> bool:
        return isinstance(x, self._tensor)

    def shape(self, t):
        return t.shape

    def dtype(self, t):
        return t.dtype

    def device(self, t):
        return t.place

    def zeros_like(self, t, dim, size):
        shape = list(t.shape)
        if dim is not None:
            shape[dim] = size
        return paddle.zeros(shape, dtype=t.dtype, device=t.place)

    def clone(self, t):
        return t.clone()

    def fill_(self, t, value) -> None:
        t.fill_(value)

    def fill_rows(self, t, dim, start, stop, value) -> None:
        if dim == 0:
            t[start:stop] = value
        else:
            index = [slice(None)] * len(t.shape)
            index[dim] = slice(start, stop)
            t[tuple(index)] = value

    def rows(self, t, dim, start, stop):
        return paddle.slice(t, [dim], [start], [stop])

    def stride(self, t):
        return tuple(t.strides)

    def version(self, t) -> int:
        return t._inplace_version()

    def mark_written(self, t) -> None:
        t._bump_inplace_version()

    def dense(self, t) -> bool:
        return t.is_contiguous()

    def compact(self, t):
        return t  # Paddle's expand copies: no broadcast views

    def varied(self, t):
        """t, or where it is floating with every element equal (zeros, a dummy input), a tensor of its
        shape and dtype whose elements all differ: capture_checks compares rows with padding rows."""
        if not t.is_floating_point() or t.size < 2:
            return t
        flat = t.flatten()
        if not bool((flat == flat[0]).all()):
            return t
        ramp = (paddle.arange(t.size, dtype="float64") * 0.6180339887498949) % 1.0 - 0.5
        return ramp.reshape(t.shape).astype(t.dtype)

    def shifted(self, t):
        """A copy of t plus a ramp whose elements all differ (floating tensors; a copy of others): another
        state a capture check starts from, where a write of the value an element held shows."""
        if not t.is_floating_point() or t.size == 0:
            return t.clone()
        ramp = (paddle.arange(t.size, dtype="float64") * 0.6180339887498949) % 1.0 + 0.5
        return t + ramp.reshape(t.shape).astype(t.dtype)

    def all_equal_to(self, t, value) -> bool:
        return bool((t == value).all()) if t.size else True

    def max_abs_diff(self, a, b) -> float:
        """The largest |a - b| (NaN where both are NaN counts as equal); inf where shapes or dtypes differ."""
        if list(a.shape) != list(b.shape) or a.dtype != b.dtype:
            return float("inf")
        x, y = a.numpy(), b.numpy()
        if x.dtype.kind not in "fc":
            return 0.0 if (x == y).all() else float("inf")
        import numpy as np

        diff = np.atleast_1d(np.abs(x.astype(np.float64) - y.astype(np.float64)))  # 0-d: a numpy scalar otherwise
        diff[np.atleast_1d(np.isnan(x) & np.isnan(y))] = 0
        return float(diff.max()) if diff.size else 0.0

    def fits(self, value, dtype) -> bool:
        """Whether a Python number converts to dtype unchanged (a pad value)."""
        import numpy as np

        kind = str(dtype).replace("paddle.", "")
        if "float" in kind or "complex" in kind:
            return True
        if kind == "bool":
            return value in (0, 1)
        if isinstance(value, float) and not value.is_integer():
            return False
        info = np.iinfo(getattr(np, kind))
        return info.min <= value <= info.max

    def eps(self, t) -> float:
        """The spacing of t's dtype at 1.0 (0 for integers): what rounding alone can change."""
        import numpy as np

        kind = str(t.dtype)
        if "bfloat16" in kind:
            return 2.0 ** -7
        if "float16" in kind:
            return 2.0 ** -10
        if "float64" in kind:
            return float(np.finfo(np.float64).eps)
        if "float32" in kind:
            return float(np.finfo(np.float32).eps)
        return 0.0

    def max_abs(self, t) -> float:
        import numpy as np

        x = t.numpy()
        if x.dtype.kind not in "fc" or not x.size:
            return 0.0
        return float(np.nan_to_num(np.abs(x.astype(np.float64)), nan=0, posinf=0, neginf=0).max())

    def narrow(self, t, dim, length):
        if dim == 0:
            return t[:length]
        return paddle.slice(t, [dim], [0], [length])

    def copy_(self, dst, src) -> None:
        dst.copy_(src, False)

    def data_ptr(self, t) -> int:
        return t.data_ptr()

    def on_host(self, t) -> bool:
        return t.place.is_cpu_place()

    def static_address(self, t) -> bool:
        return getattr(t, MARK, False)

    def same_values(self, a, b) -> bool:
        """Same shape, dtype and elements, NaN equal to NaN (a NaN input is not a changed one)."""
        if list(a.shape) != list(b.shape) or a.dtype != b.dtype:
            return False
        return bool(_equal_elements(a, b).all())

    def keep_changes(self, before, want, got):
        """got where want differs from before, want elsewhere (NaN equal to NaN): the elements one run
        changed, as another run left them."""
        return paddle.where(_equal_elements(before, want), want, got)

    def other_writes(self, before, want, got):
        """want where it differs from before, got elsewhere (NaN equal to NaN): the state one run left,
        with what only another run wrote."""
        return paddle.where(_equal_elements(before, want), got, want)

    def alias(self, t):
        """A new tensor object over t's memory: what a replay hands out (graph_opt/replay/handed_outputs.py).
        A view, not detach(): a detached tensor or a slice shares t's own storage object, which set_
        (keep_values) would move too."""
        return t.view(t.shape)

    def keep_values(self, t) -> None:
        """A handed-out alias made to hold a copy of its values, in memory of its own."""
        with paddle.no_grad():
            t.set_(t.clone())

    def training_modules(self, model) -> list:
        from paddle.nn.layer import common, norm

        kinds = (common.Dropout, common.Dropout2D, common.Dropout3D, common.AlphaDropout, common.FeatureAlphaDropout,
                 norm.BatchNorm, norm._BatchNormBase)
        return [f"{name or type(model).__name__} ({type(m).__name__})"
                for name, m in model.named_sublayers(include_self=True)
                if m.training and isinstance(m, kinds) and getattr(m, "p", 1) != 0]  # dropout at p=0 is the identity

    def model_tensors(self, model) -> list:
        return [t for t in list(model.parameters()) + list(model.buffers()) if t._is_initialized()]

    def nbytes(self, t) -> int:
        return math.prod(t.shape) * t.element_size()

    def numel(self, t) -> int:
        return math.prod(t.shape)

    def host_bytes(self, t) -> bytes:
        return t.numpy().tobytes()  # bf16 comes back as uint16: its bits

    def extent(self, t):
        start = t.data_ptr()
        if t.is_contiguous():
            return start, start + math.prod(t.shape) * t.element_size()
        if not math.prod(t.shape):
            return start, start
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides))) * t.element_size()

    def layout(self, t):
        return (t.dtype, str(t.place))

    def weak_alias(self, t):
        # Paddle has no public non-owning view of a tensor's memory: piecewise graphs then keep the
        # tensors splitting ops read from earlier pieces, and their pool blocks are not reused across sizes.
        return t

    def grad_enabled(self) -> bool:
        return paddle.is_grad_enabled()

    def no_grad(self):
        return paddle.no_grad()

    def ambient(self):
        """The auto_cast state and default dtype a replay must match; None (the common case) without
        auto_cast and with float32 as the default dtype. (Paddle's CPU build ignores auto_cast.)"""
        default = _default_dtype(_LayerHelperBase)
        tracer = paddle.base.framework._dygraph_tracer()
        level = tracer._amp_level
        if level == paddle.base.core.AmpLevel.O0:
            return None if default == "float32" else (("default dtype", default),)
        return ((str(level), str(tracer._amp_dtype)),) + ((("default dtype", default),) if default != "float32" else ())

    @staticmethod
    def math_mode_counter() -> bytes:
        """Paddle's math-mode flags (paddle.set_flags) are not watched: a count (its len) that never moves."""
        return _NEVER

    @staticmethod
    def math_mode():
        return None

    @staticmethod
    def describe_math_mode(was, now) -> str:
        return "unknown"

    def describe_ambient(self, ambient) -> str:
        """Both halves, whichever changed: "no auto_cast and paddle.set_default_dtype('float64')"."""
        ambient = ambient or ()
        dtype = [b for a, b in ambient if a == "default dtype"]
        casts = [f"paddle.amp.auto_cast (level {a}, dtype {b})" for a, b in ambient if a != "default dtype"]
        return f"{' and '.join(casts) or 'no auto_cast'} and paddle.set_default_dtype({(dtype or ['float32'])[0]!r})"

    # -- the model as a replay sees it (graph_opt.watch.replay_guards) ----------------------------------
    static_follows_ambient = False  # SOT, as graph_opt runs it, keeps a translation made under another default dtype
    static_makes_python_stores = False  # its captures check what the forward binds and sets, as level 0
    static_reads_replaced_tensors = False  # SOT replays run on the parameters captured
    static_folds_host_constants = False  # a level-0 capture that fails on a host copy is not traced instead
    value_types = (paddle.dtype, paddle.base.core.Place, paddle.CPUPlace)  # immutable non-tensor values
    def module_dicts(self, model):
        return [(path, layer.__dict__) for path, layer in model.named_sublayers(include_self=True)]

    def named_modules(self, model) -> list:
        return list(model.named_sublayers(include_self=True))

    def module_classes(self, model) -> list:
        """The class of each module, in module_dicts' order."""
        return [type(layer) for _, layer in model.named_sublayers(include_self=True)]

    @functools.cached_property
    def framework_attributes(self) -> frozenset:
        """Attributes Layer keeps for itself (_built, hooks, training): not the model's state a replay checks."""
        return frozenset(paddle.nn.Layer().__dict__)

    def registration_counter(self) -> list:
        """[count] that Layer.__setattr__ with a tensor or layer value, add_parameter, register_buffer and
        add_sublayer bump: a parameter, buffer or sublayer replaced (Paddle has no registration hooks)."""
        _install_registration_counter()
        return _registrations

    def hook_counter(self) -> list:
        """[count] that registering or removing a Layer hook bumps (HookRemoveHelper)."""
        _install_hook_counter()
        return _hook_changes

    def hooks_fingerprint(self, dicts):
        """The hooks that run inside the forward: those of every sublayer (dicts[1:])."""
        return tuple((tuple(d["_forward_pre_hooks"]), tuple(d["_forward_post_hooks"])) for d in dicts[1:])

    def attribute_counter(self) -> list:
        """[count] that Layer.__setattr__ and __delattr__ bump (a dropout's p set), process-wide (see the
        torch adapter's)."""
        _install_registration_counter()
        return _attribute_sets

    def conversion_counter(self) -> list:
        """[count] that Layer._apply and a parameter's `.data` assigned bump (to, astype, float, ...)."""
        _install_registration_counter()
        return _conversions

    def tensor_fingerprint(self, model):
        """(id, address, dtype, place, shape, strides) of every parameter and buffer (see the torch adapter's)."""
        return tuple((id(t), address(t), t.dtype, str(t.place), tuple(t.shape), tuple(t.strides))
                     for t in list(model.parameters()) + list(model.buffers()))

    def after_failed_capture(self) -> None:
        pass  # Paddle's generators: not known to need it (its CUDA path is not run here)

    def mode_counter(self) -> list:
        """[count] that Layer.train() and Layer.eval() bump, process-wide (see the torch adapter's)."""
        _install_mode_counter()
        return _mode_changes

    def named_buffers(self, model):
        """Those holding memory: a buffer without any yet (the RNN layers' `_dropout_state`) has no
        values to copy aside or compare."""
        return [(name, b) for name, b in model.named_buffers() if b._is_initialized()]

    def module_tensor_ids(self, model):
        return tuple((name, id(t)) for name, t in list(model.named_parameters()) + list(model.named_buffers()))

    def call_hooks(self, model) -> bool:
        d = model.__dict__
        return bool(d["_forward_pre_hooks"] or d["_forward_post_hooks"])

    def synchronize(self) -> None:
        if self.graphs_supported():
            paddle.device.synchronize()

    def graphs_supported(self) -> bool:
        if self._graphs is None:
            self._graphs = _cuda_graphs_available()
        return self._graphs

    def new_pool(self):
        if not self.graphs_supported():
            return None
        return paddle.base.core.CUDAGraph.gen_new_memory_pool_id()

    def new_graph(self, pool):
        return PaddleGraph(pool)

    def capture_stream(self):
        return contextlib.nullcontext()

    def memory_in_use(self):
        if not self.graphs_supported():
            return None
        return paddle.device.cuda.memory_reserved()

    def release_memory(self) -> None:
        if self.graphs_supported():
            paddle.device.cuda.empty_cache()


_NEVER = b""


def _equal_elements(a, b):
    """a == b elementwise, NaN equal to NaN."""
    same = a == b
    if a.is_floating_point():
        same = same | (paddle.isnan(a) & paddle.isnan(b))
    return same


ADAPTER = PaddleAdapter()


# paddle.get_default_dtype() is two Python calls (0.3 µs); a replay reads the class attribute they return
_LayerHelperBase = paddle.base.layer_helper_base.LayerHelperBase


def _default_dtype(helper) -> str:
    return helper._LayerHelperBase__dtype


def address(t) -> int:
    """data_ptr(), or 0 for a tensor without memory yet (the RNN layers' `_dropout_state` buffer), whose
    data_ptr() raises."""
    return t.data_ptr() if t._is_initialized() else 0
