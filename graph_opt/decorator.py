"""@support_graph_optimization and the per-model plugin state it installs (GraphOptState, state_of).

capture_model, clear_graphs and stats, which act on a decorated model, are in lifecycle.py.
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable, Dict, Optional, Sequence

from . import backends, config as config_mod, env, fastdeploy_config
from .replay import dispatch, padding
from .capture import level_switch, split
from .errors import GraphOptConfigError, GraphOptInputError
from .replay.fast_replay import MISS
from .replay.host_outputs import HostOutputs
from .capture.level0 import EagerStrategy
from .watch.replay_guards import STATE_ATTR as _STATE_ATTR, ModelState
from .replay.runner import GraphRunner
from .replay.signature import as_made, forward_params
from .recorders.host_graphs import graphs_for, simulation_enabled

logger = logging.getLogger("graph_opt")


_ABSENT = object()  # no instance attribute `forward` before a call with hooks

class GraphOptState:
    """Per-model plugin state: the config, the mode, and the runner once graphs are in use."""

    def __init__(self, model, cfg, dynamic_arg_dims, framework: str, orig_call: Callable,
                 dispatch_key_fn: Optional[Callable] = None, pad_values: Optional[Dict[str, Any]] = None,
                 owner: Optional[type] = None):
        self.model = model
        self.dynamic_arg_dims = dynamic_arg_dims
        self.pad_values = pad_values
        self.owner = owner  # the decorated class whose options built this state (pickling rebuilds from it)
        self.backend = backends.load(framework)
        self.adapter = self.backend.ADAPTER
        self.call_hooks = self.adapter.call_hooks
        self.orig_call = orig_call
        self._hooks_lock = threading.Lock()  # _with_hooks: the calls running with our `forward` installed
        self._hook_calls = 0
        self._forward_before: Any = _ABSENT
        self.forward_fn = forward_fn = type(model).forward
        self.name = type(model).__name__
        # The forward without the module's hooks: the decorated call runs the hooks around the plugin,
        # so that they run at every call, replays included (and not twice on a fallback).
        self.forward_call = _as_called(forward_fn, model, forward_params(forward_fn, for_call=True))
        self.disabled = env.disabled()
        self.runner: Optional[GraphRunner] = None
        self.use_config(cfg)
        self.retraced_reason: Optional[str] = None  # why level 1 runs where the config left level 0 (level_switch.py)
        self.dispatch_key_fn = dispatch_key_fn
        if cfg.graph_mode == "full_and_piecewise" and dispatch_key_fn is None and cfg.use_cudagraph:
            raise GraphOptConfigError(
                f"cudagraph_mode='full_and_piecewise'{config_mod._origin(cfg, 'cudagraph_mode')} for {self.name}: "
                "say per call which kind of graph runs with @support_graph_optimization(dispatch_key_fn=fn), fn "
                "taking the forward's arguments and returning 'full' or 'piecewise'; or use cudagraph_mode "
                "'full' or 'piecewise'")
        self.notes: list = []
        self.host_outputs: Optional[HostOutputs] = None

    def use_config(self, cfg) -> None:
        """Run with cfg, from construction or from the default level's switch to level 1 (level_switch.py):
        what depends on the level (the watch of the model, the path without graphs, the runner) made anew."""
        self.config = cfg
        level0 = cfg.graph_opt_level == 0
        # Without the framework's guards a level >= 1 replay keeps level 0's watch of the model's attributes.
        self.model_state = ModelState(self.adapter, self.model, self.name,
                                      watch_attributes=level0 or not cfg.guarded_replays,
                                      watch_replacements=level0 or not self.adapter.static_reads_replaced_tensors,
                                      reads_recorded=level0)
        self.plain: Optional[Callable] = None  # the path without graphs, once chosen
        self.selection = None if cfg.graph_mode == "full" else split.SplitSelection(cfg.splitting_ops)
        if cfg.graph_mode == "full" and cfg.cudagraph_splitting_ops and cfg.use_cudagraph:
            fastdeploy_config.warn_unused_splitting_ops(self.name, cfg)
        if self.runner is not None:
            self.runner = None
            self.ensure_runner()

    # -- mode ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        cfg = self.config
        if self.disabled:
            return "disabled (GRAPH_OPT_DISABLE)"
        base = "eager" if cfg.graph_opt_level == 0 else f"static (level {cfg.graph_opt_level})"
        if not cfg.use_cudagraph:
            return base
        kind = {"full": "full graph", "piecewise": "piecewise", "full_and_piecewise": "full and piecewise"}[
            cfg.graph_mode]
        if self.runner is not None:
            return f"{base} + {'simulated ' if self._simulated else ''}cuda graphs, {kind}"
        if not self.graphs_available():
            return f"{base}; cuda graphs ({kind}) configured but unavailable here"
        return f"{base} + cuda graphs, {kind}"

    @property
    def _simulated(self) -> bool:
        return simulation_enabled() or not self.adapter.graphs_supported()

    def graphs_available(self) -> bool:
        return graphs_for(self.adapter).available()

    def plain_call(self) -> Callable:
        """The path a call takes without graphs: eager at level 0, SOT at level >= 1."""
        if self.plain is None:
            if self.config.graph_opt_level == 0 or self.disabled:
                self.plain = self.forward_call
            else:
                # Level >= 1 without graphs: the strategy's plain static path (SOT / torch.compile).
                strategy = self.backend.static_strategy(self.model, self.forward_fn, self.config, None)

                eager_with_grad = not strategy.traits.runs_autograd

                def static_call(*args, **kwargs):
                    if eager_with_grad and self.adapter.grad_enabled():
                        return self.forward_call(*args, **kwargs)  # see GraphRunner._fallback
                    try:
                        return strategy.run(args, kwargs)
                    except Exception as exc:
                        # Name the arguments whose batch dims disagree, as the graph modes do, rather
                        # than leave the framework's error from inside its tracer.
                        problem = self._batch_disagreement(args, kwargs)
                        if problem is None:
                            raise
                        raise GraphOptInputError(f"{self.name}: {problem}") from exc

                static_call.strategy = strategy
                self.plain = static_call
        return self.plain

    def _batch_disagreement(self, args, kwargs) -> Optional[str]:
        """For a failed call without graphs: what GraphRunner would say about its batch dims, or None."""
        checker = GraphRunner(adapter=self.adapter, config=self.config, strategy=None, eager=None,
                              dynamic_arg_dims=self.dynamic_arg_dims, params=forward_params(self.forward_fn),
                              name=self.name)
        return checker.batch_disagreement(args, kwargs)

    def ensure_runner(self) -> Optional[GraphRunner]:
        """The runner when graphs are configured and available; else None (after one warning)."""
        if self.runner is not None:
            return self.runner
        cfg = self.config
        if self.disabled or not cfg.use_cudagraph:
            return None
        if not self.graphs_available():
            if not self.notes:
                msg = (f"{self.name}: CUDA graphs are unavailable here ({self.adapter.name} has no CUDA graph support); "
                       f"running the {'eager' if cfg.graph_opt_level == 0 else 'static'} path without graphs. "
                       "Use graph_opt.testing.simulate_cuda_graphs() or GRAPH_OPT_SIMULATE_CUDAGRAPH=1 to simulate them.")
                logger.warning(msg)
                self.notes.append(msg)
            return None
        if cfg.graph_mode == "full_and_piecewise":
            guard = threading.RLock()  # a call of either kind is refused while another thread uses the other
            warned: set = set()  # one model: each warning once, whichever kind hits it
            full, pieces = self._new_runner(None, guard, warned), self._new_runner(self.selection, guard, warned)
            self.runner = dispatch.KindDispatch(full, pieces, self.dispatch_key_fn, self.name)
        else:
            self.runner = self._new_runner(self.selection)
        return self.runner

    def _new_runner(self, selection, guard=None, warned=None) -> GraphRunner:
        """A runner of one kind of graph: full (selection None) or split at the selected ops."""
        cfg = self.config
        if cfg.graph_opt_level == 0:
            strategy = EagerStrategy(self.forward_call, self.adapter, selection)
        else:
            strategy = self.backend.static_strategy(self.model, self.forward_fn, cfg, selection)
        retrace = level_switch.may_trace_instead(cfg, self.adapter)
        return GraphRunner(
            adapter=self.adapter, config=cfg, strategy=strategy, eager=self.forward_call,
            dynamic_arg_dims=self.dynamic_arg_dims,
            params=forward_params(self.forward_fn), keyword_defaults=_keyword_defaults(self.forward_fn), name=self.name,
            host_outputs=self.host_outputs, guard=guard, warned=warned,
            model_state=self.model_state, pad_values=self.pad_values,
            on_capture_failure=functools.partial(level_switch.trace_instead, self) if retrace else None,
        )

    # -- the call --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.call_hooks(self.model):
            return self._with_hooks(args, kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The plugin in the place of the model's forward: replay, capture or run without graphs."""
        runner = self.runner
        if runner is not None:
            out = runner(*args, **kwargs)
        else:
            runner = self.ensure_runner()
            out = runner(*args, **kwargs) if runner is not None else self.plain_call()(*args, **kwargs)
        if self.host_outputs is not None:
            return self.host_outputs.apply(self.adapter, out)
        return out

    def _with_hooks(self, args, kwargs):
        """The framework's own module call (its hooks, in its order), with the plugin as the forward it
        calls: the instance attribute `forward` is ours while any such call runs. Counted, so that calls
        that overlap (nested, or from two threads) put back what was there before the first."""
        held = self.model.__dict__
        with self._hooks_lock:
            if not self._hook_calls:
                self._forward_before = held.get("forward", _ABSENT)
                held["forward"] = self.forward
            self._hook_calls += 1
        try:
            return self.orig_call(self.model, *args, **kwargs)
        finally:
            with self._hooks_lock:
                self._hook_calls -= 1
                if not self._hook_calls:
                    if self._forward_before is _ABSENT:
                        held.pop("forward", None)
                    else:
                        held["forward"] = self._forward_before
                    self._forward_before = _ABSENT

    # -- copies of the model (copy.deepcopy, pickle, torch.save) ------------------------------------
    def __reduce__(self):
        # A copy is a decorated model of its own, with no graphs yet: graphs, static buffers and the
        # runner belong to this instance.
        # A model the default level moved to level 1 (level_switch.py) stays there, and says why: its
        # config names stats().retraced_reason as the level's source.
        return _restored_state, (self.model, self.config, self.owner, self.retraced_reason)

    def __deepcopy__(self, memo):
        import copy

        return _restored_state(memo.get(id(self.model), self.model), copy.deepcopy(self.config, memo), self.owner,
                               self.retraced_reason)


def _new_state(model, cfg, owner: type) -> "GraphOptState":
    """The plugin state of `model` from the options its decorated class `owner` was given."""
    options = owner.__dict__["__graph_opt_options__"]
    state = GraphOptState(model, cfg, options["dynamic_arg_dims"], options["framework"], options["orig_call"],
                          options["dispatch_key_fn"], options["pad_values"], owner)
    if options["host_outputs"] is not None:
        state.host_outputs = HostOutputs(options["host_outputs"], options["host_ring_depth"], owner.__qualname__)
    return state


def _restored_state(model, cfg, owner, retraced_reason=None) -> "GraphOptState":
    """A fresh state for a copy of a decorated model (deepcopy, unpickling): the config, no graphs."""
    state = _new_state(model, cfg, owner)
    state.retraced_reason = retraced_reason
    return state


def _state_for_call(model) -> Optional["GraphOptState"]:
    """The model's state; a fresh one where it belongs to another instance (a shallow copy.copy shares
    its __dict__'s values: the copy must not run the original's graphs)."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is not None and state.model is not model:
        state = _restored_state(model, state.config, state.owner, state.retraced_reason)
        object.__setattr__(model, _STATE_ATTR, state)
    return state


def _as_called(forward_fn, model, params) -> Callable:
    """forward_fn(model, ...) for the runner's canonical arguments, as the caller made the call (as_made)."""
    def call(*args, **kwargs):
        args, kwargs = as_made(params, args, kwargs)
        return forward_fn(model, *args, **kwargs)

    return call


def _keyword_defaults(forward_fn) -> list:
    """(name, default) of forward's keyword-only parameters that have a default."""
    params = list(inspect.signature(forward_fn).parameters.values())[1:]
    return [(p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY and p.default is not p.empty]


def _check_dynamic_arg_dims(cls, dynamic_arg_dims) -> Optional[Dict[str, int]]:
    if dynamic_arg_dims is None:
        return None
    if not isinstance(dynamic_arg_dims, dict) or not dynamic_arg_dims:
        raise GraphOptConfigError(
            f"dynamic_arg_dims must be a non-empty dict of forward argument name -> dim, e.g. {{'x': 0}}, "
            f"got {dynamic_arg_dims!r}"
        )
    params = list(inspect.signature(cls.forward).parameters)[1:]
    accepts_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())
    for name, dim in dynamic_arg_dims.items():
        if not isinstance(name, str) or (name not in params and not accepts_kwargs):
            raise GraphOptConfigError(
                f"dynamic_arg_dims key {name!r} is not an argument of {cls.__qualname__}.forward; "
                f"its arguments are {', '.join(params)}"
            )
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise GraphOptConfigError(
                f"dynamic_arg_dims[{name!r}] must be an int dimension of argument {name!r} (0 for the first, "
                f"-1 for the last), got {dim!r}"
            )
    return dict(dynamic_arg_dims)


def _check_same_options(cls, options: Dict[str, Any]) -> None:
    """Decorating a decorated class again is a no-op, unless it asks for other options: those would be lost."""
    had = cls.__graph_opt_options__
    # Only what this decoration asks for: a bare @support_graph_optimization asks for nothing.
    defaults = inspect.signature(support_graph_optimization).parameters
    asked = {name: value for name, value in options.items() if value != defaults[name].default}
    differ = [name for name, value in asked.items() if not _same_option(had[name], value)]
    if differ:
        was = ", ".join(f"{name}={had[name]!r}" for name in differ)
        now = ", ".join(f"{name}={options[name]!r}" for name in differ)
        raise GraphOptConfigError(
            f"@support_graph_optimization({now}) on {cls.__qualname__}: the class is already decorated with {was}; "
            "decorate it once, with all its options")


def _same_option(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b or repr(a) == repr(b)  # {'x': nan} twice


def _check_no_own_call(cls) -> None:
    """The decorator replaces __call__ to dispatch each call to a graph: a __call__ of the user's own, on the
    class or a base below the framework's module class, would silently stop running."""
    for klass in cls.__mro__:
        own = klass.__dict__.get("__call__")
        if own is None:
            continue
        defined_in = getattr(own, "__module__", None) or klass.__module__
        if hasattr(own, "_graph_opt_orig_call") or defined_in.split(".")[0] in ("torch", "paddle"):
            return  # the framework's (`__call__ = nn.Module.__call__` too), or a decorated base's (checked then)
        where = inspect.getsourcefile(own) if inspect.isfunction(own) else None
        line = f" ({where}:{own.__code__.co_firstlineno})" if where else ""
        raise TypeError(
            f"@support_graph_optimization on {cls.__qualname__}: {klass.__qualname__} defines __call__{line}, which "
            "the decorator replaces to send each call to a graph, so its code would never run. Move that code into "
            "forward, or into a module that calls the decorated one")


def support_graph_optimization(cls=None, *, dynamic_arg_dims: Optional[Dict[str, int]] = None,
                               host_outputs: Optional[Sequence[str]] = None, host_ring_depth: int = 2,
                               dispatch_key_fn: Optional[Callable[..., str]] = None,
                               pad_values: Optional[Dict[str, Any]] = None):
    """Class decorator for a paddle.nn.Layer or torch.nn.Module subclass.

    The constructor then accepts `graph_opt_config=` (a GraphOptConfig, a dict, a YAML path or JSON text;
    default load_config()). Without it, a constructor that takes FastDeploy's `fd_config` reads
    `fd_config.graph_opt_config` (graph_opt.fastdeploy_config), as FastDeploy's models are built. Calls go through the plugin: padded to the nearest captured size and replayed when
    graphs are captured, otherwise eager (level 0) or static (level >= 1). The module's hooks run
    around it at every call, as around an eager forward.

    dynamic_arg_dims maps forward argument names to their batch dimension; by default dimension 0 of
    every tensor argument is the batch dimension. Given, it names every argument that has one: the
    others are passed whole ({"x": 1, "mask": 0}, not {"x": 1} alone, for a mask batched in dim 0).

    pad_values maps forward argument names to the number their padding rows hold when a call is padded
    to a captured size (default 0): {"slot_mapping": -1} for a kernel that skips slot -1 (see
    graph_opt.replay.padding). Padding rows never hold an earlier call's data.

    host_outputs names output leaves ("next_tokens", "out.tokens", "aux.0") that come back as
    HostFutures: their device-to-host copies start at once and the host waits only in result(). Each
    model has its own pinned rings, host_ring_depth buffers per shape (see graph_opt.replay.host_outputs).

    dispatch_key_fn(*args, **kwargs) -> "full" | "piecewise": with cudagraph_mode "full_and_piecewise",
    which kind of graph a call replays (e.g. "full" for a decode-only batch, "piecewise" for a mixed
    one, whose attention runs eagerly between the pieces). See graph_opt.replay.dispatch.
    """
    if cls is None:
        return lambda c: support_graph_optimization(c, dynamic_arg_dims=dynamic_arg_dims, host_outputs=host_outputs,
                                                    host_ring_depth=host_ring_depth, dispatch_key_fn=dispatch_key_fn,
                                                    pad_values=pad_values)
    if not isinstance(cls, type):
        raise TypeError(
            "@support_graph_optimization decorates a class (a paddle.nn.Layer or torch.nn.Module subclass), "
            f"got {type(cls).__name__}"
        )
    framework = backends.framework_of(cls)
    dims = _check_dynamic_arg_dims(cls, dynamic_arg_dims)
    parameters = inspect.signature(cls.forward).parameters
    pads = padding.check_pad_values(cls.__qualname__, pad_values, list(parameters)[1:],
                                    any(p.kind == p.VAR_KEYWORD for p in parameters.values()))
    dispatch.check_key_fn(dispatch_key_fn, cls.__qualname__)
    if host_outputs is not None:  # checked now: a bad path list is an error at decoration
        HostOutputs(host_outputs, host_ring_depth, cls.__qualname__)
    elif host_ring_depth != 2:
        raise GraphOptInputError(
            f"@support_graph_optimization(host_ring_depth={host_ring_depth!r}) on {cls.__qualname__}: "
            "host_ring_depth sizes the rings of host_outputs; name the outputs too (host_outputs=[...])")
    options = dict(dynamic_arg_dims=dims, pad_values=pads, host_outputs=host_outputs, host_ring_depth=host_ring_depth,
                   dispatch_key_fn=dispatch_key_fn)
    if cls.__dict__.get("__graph_opt_decorated__"):
        _check_same_options(cls, options)
        return cls
    _check_no_own_call(cls)
    orig_init = cls.__init__
    # A subclass of a decorated class inherits the plugin's __call__ and __setattr__: wrap the
    # framework's own, or a call would go plugin -> "original" (the base's plugin call) -> plugin ...
    orig_call = getattr(cls.__call__, "_graph_opt_orig_call", cls.__call__)
    orig_setattr = getattr(cls.__setattr__, "_graph_opt_orig_setattr", cls.__setattr__)
    cls.__graph_opt_options__ = dict(options, framework=framework, orig_call=orig_call)

    fd_position = fastdeploy_config.fd_config_position(orig_init, cls)

    @functools.wraps(orig_init)
    def __init__(self, *args, graph_opt_config=None, **kwargs):
        orig_init(self, *args, **kwargs)
        # A decorated subclass runs its own __init__ last: the outermost config wins.
        if graph_opt_config is not None or _STATE_ATTR not in self.__dict__:
            if graph_opt_config is None and fd_position is not None:
                fd = kwargs.get("fd_config", args[fd_position] if 0 <= fd_position < len(args) else None)
                found = fastdeploy_config.graph_opt_config_of(fd)  # FastDeploy's constructor: Model(fd_config)
                cfg = fastdeploy_config.from_fastdeploy(found) if found is not None else config_mod.resolve(None)
            else:
                cfg = config_mod.resolve(graph_opt_config)
            object.__setattr__(self, _STATE_ATTR, _new_state(self, cfg, cls))

    def __call__(self, *args, **kwargs):
        state = self.__dict__.get(_STATE_ATTR)
        if state is not None and state.model is not self:
            state = _state_for_call(self)
        if state is None or state.disabled:
            return orig_call(self, *args, **kwargs)
        runner = state.runner
        if runner is not None and state.host_outputs is None and not state.call_hooks(self):
            # The hot path: the runner's shortcut is called from here, not through runner(...).
            fast = runner.fast
            if fast is not None and not kwargs:
                out = fast(args)
                if out is not MISS:
                    return out
            return runner.full_call(args, kwargs)
        return state(*args, **kwargs)

    def __setattr__(self, name, value):
        # Level 0 bakes the attributes forward read: one set after capture is compared at replay.
        state = self.__dict__.get(_STATE_ATTR)
        watch = state is not None and state.model_state.watching and name not in state.adapter.framework_attributes
        if watch:
            state.model_state.before_set(name)
        orig_setattr(self, name, value)
        if watch:
            state.model_state.after_set(name)

    __call__._graph_opt_orig_call = orig_call
    __setattr__._graph_opt_orig_setattr = orig_setattr
    cls.__init__ = __init__
    cls.__call__ = __call__
    cls.__setattr__ = __setattr__
    cls.__graph_opt_decorated__ = True
    return cls


def state_of(model) -> GraphOptState:
    state = getattr(model, "__dict__", {}).get(_STATE_ATTR)
    if state is not None and state.model is not model:
        state = _state_for_call(model)  # a shallow copy: its own state, not the original's
    if state is None and isinstance(model, type):
        raise TypeError(f"got the class {model.__name__}, not a model: pass an instance ({model.__name__}(...))")
    if state is None:
        raise TypeError(
            f"{type(model).__name__} is not graph-optimized: decorate its class with @graph_opt.support_graph_optimization "
            "or wrap it with graph_opt.autocudagraph"
        )
    return state
