"""GraphOptConfig: what to capture and how, with validation and where each value came from.

Precedence, lowest first: defaults < YAML (a path, or GRAPH_OPT_CONFIG) < keyword arguments < GRAPH_OPT_*.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from . import env
from .cudagraph_modes import CUDAGRAPH_MODES
from .errors import GraphOptConfigError
from .capture.passes import KNOWN_PASSES
from .replay.sizes import DEFAULT_MAX_CAPTURE_SIZE, default_capture_sizes
from .config_files import NESTED_KEY, read_text_or_file, read_yaml

# FastDeploy's keys for its own scheduler (prefill-only graphs, a draft model's) and the maps it derives from
# the sizes: accepted in any config source and skipped (graph_opt pads to the captured sizes itself), so
# that FastDeploy's configs load as they are (docs/fastdeploy.md)
FASTDEPLOY_ONLY = frozenset({
    "cudagraph_capture_sizes_prefill", "cudagraph_only_prefill", "max_capture_shape_prefill",
    "max_capture_size_prefill", "real_shape_to_captured_size", "real_shape_to_captured_size_prefill",
    "real_bsz_to_captured_size", "batch_size_to_captured_size", "draft_model_use_cudagraph",
})
_UNSET = object()
# A captured size has static buffers of that many rows and a slot in the padding table: above this, a
# typo (10**15), not a batch.
MAX_SIZE_LIMIT = 1 << 20


@dataclass
class GraphOptConfig:
    """How a model is optimized. See the mode table in the README.

    graph_opt_level: 0 eager, 1 static (Paddle SOT / torch Dynamo), 2 static plus the framework's compiler.
    use_cudagraph: capture and replay CUDA graphs, one per padded batch size.
    full_cuda_graph: one graph per size; False splits at cudagraph_splitting_ops. An alias of
        cudagraph_mode "full" / "piecewise", kept for configs written before it.
    cudagraph_mode: "full" (one graph per size), "piecewise" (split at cudagraph_splitting_ops) or
        "full_and_piecewise" (both per size, in one pool; the decorator's dispatch_key_fn picks one per
        call); None takes it from full_cuda_graph.
    cudagraph_capture_sizes: padded batch sizes to capture; None generates them up to max_capture_size.
    max_capture_size: largest size replayed from a graph; None means max(cudagraph_capture_sizes), else 256.
    cudagraph_num_of_warmups: eager runs before each capture (lazy initialisation must not happen inside one).
    cudagraph_splitting_ops: where piecewise graphs split; None (or [], as FastDeploy reads it) means every
        function marked @splitting_op. A full graph splits nowhere: ops named with it are unused (a warning
        at the model's construction; FastDeploy documents the two as exclusive).
    use_unique_memory_pool: all sizes of one model share one graph memory pool (captured largest first).
    cudagraph_copy_inputs: copy inputs into plugin-owned static buffers; False means the caller passes
        views of the same buffers at every call (checked), and nothing is copied.
    program_passes: PIR passes run on every static program before its first run (level >= 1, Paddle);
        by default protect_inplace_writes (the safety pass, first) then remove_loop_carried_copies.
    cudagraph_max_signatures: call structures (non-tensor argument values) that get graphs at call
        time, without capture_model; calls with further values run without graphs.
    guarded_replays: level >= 1, evaluate the framework's guards (Dynamo's guard manager, SOT's guard
        functions) before every replay, except those on graph_opt's own capture flags. False skips
        them, as vLLM does: the Python state the forward reads must then not change after capture
        (the decorated model's own attributes are still watched, as at level 0).
    sot_warmup_sizes: level >= 1, batch sizes above the largest captured size that capture_model also runs
        once through the static path, under sot_warmup_guard(True), so that their first real call does not
        translate (FastDeploy's key of that name); None: none.
    keep_outputs: an output the caller still holds when the next replay of the model runs keeps its
        values (they are copied to memory of its own first), as eager's would. False: every output is
        the graphs' memory until the next call overwrites it (no copy; for callers that read each
        call's outputs before the next call).
    """

    graph_opt_level: int = 0
    use_cudagraph: bool = True
    full_cuda_graph: bool = True
    cudagraph_mode: Optional[str] = None
    cudagraph_capture_sizes: Optional[List[int]] = None
    max_capture_size: Optional[int] = None
    cudagraph_num_of_warmups: int = 1
    cudagraph_splitting_ops: Optional[List[str]] = None
    use_unique_memory_pool: bool = True
    cudagraph_copy_inputs: bool = True
    program_passes: List[str] = field(default_factory=lambda: list(KNOWN_PASSES))
    cudagraph_max_signatures: int = 8
    guarded_replays: bool = True
    keep_outputs: bool = True
    sot_warmup_sizes: Optional[List[int]] = None
    sources: Dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.cudagraph_capture_sizes, tuple):
            self.cudagraph_capture_sizes = list(self.cudagraph_capture_sizes)
        if isinstance(self.cudagraph_splitting_ops, tuple):
            self.cudagraph_splitting_ops = list(self.cudagraph_splitting_ops)
        if isinstance(self.sot_warmup_sizes, tuple):
            self.sot_warmup_sizes = list(self.sot_warmup_sizes)
        validate(self)
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name, value):
        # A field set after construction is validated as the constructor validates it; a bad value is
        # refused and the config keeps its old one. `sources` is replaced, never changed in place: a
        # copy (copy.copy, dataclasses.replace) may share it.
        if name == "sources" or not self.__dict__.get("_validated"):
            object.__setattr__(self, name, value)
            return
        check_keys([name], "GraphOptConfig")
        old, old_sources = self.__dict__.get(name, _UNSET), self.sources
        object.__setattr__(self, name, list(value) if isinstance(value, tuple) else value)
        object.__setattr__(self, "sources", {**old_sources, name: "set after construction"})
        try:
            validate(self)
        except GraphOptConfigError:
            if old is _UNSET:
                object.__delattr__(self, name)
            else:
                object.__setattr__(self, name, old)
            object.__setattr__(self, "sources", old_sources)
            raise

    def __delattr__(self, name):
        if self.__dict__.get("_validated") and name in _FIELDS:
            raise GraphOptConfigError(f"GraphOptConfig.{name} cannot be deleted; set it to a value it accepts")
        object.__delattr__(self, name)

    # -- derived values -------------------------------------------------------------------------
    @property
    def effective_max_capture_size(self) -> int:
        if self.max_capture_size is not None:
            return self.max_capture_size
        if self.cudagraph_capture_sizes:
            return max(self.cudagraph_capture_sizes)
        return DEFAULT_MAX_CAPTURE_SIZE

    @property
    def capture_sizes(self) -> List[int]:
        """Sizes to capture, ascending. The largest is always the max capture size."""
        if self.cudagraph_capture_sizes is not None:
            sizes = sorted(self.cudagraph_capture_sizes)
            if sizes[-1] < self.effective_max_capture_size:
                sizes.append(self.effective_max_capture_size)
            return sizes
        return default_capture_sizes(self.effective_max_capture_size)

    @property
    def graph_mode(self) -> str:
        """The effective cudagraph_mode: "full", "piecewise" or "full_and_piecewise"."""
        if self.cudagraph_mode is not None:
            return self.cudagraph_mode
        return "full" if self.full_cuda_graph else "piecewise"

    @property
    def splitting_ops(self) -> Optional[List[str]]:
        """The ops piecewise graphs split at; None: every @splitting_op function. [] reads as None, as in
        FastDeploy, where an empty list with full_cuda_graph false means its default (attention) ops."""
        return self.cudagraph_splitting_ops or None

    @property
    def uses_graphs(self) -> bool:
        return self.use_cudagraph

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "dict") -> "GraphOptConfig":
        values = _unwrap(data, source)
        check_keys(values, source)
        return _build(values, {name: source for name in values})

    @classmethod
    def from_yaml(cls, path: str) -> "GraphOptConfig":
        return cls.from_dict(read_yaml(path), source=f"yaml:{path}")

    def to_dict(self) -> Dict[str, Any]:
        return {name: _copy_value(getattr(self, name)) for name in field_names()}

    def describe(self) -> str:
        """The effective config, one line per field, with where each value came from."""
        rows = []
        for name in field_names():
            rows.append((name, repr(getattr(self, name)), self.sources.get(name, "default")))
        rows.append(("(capture sizes used)", repr(self.capture_sizes), "derived"))
        rows.append(("(max capture size used)", repr(self.effective_max_capture_size), "derived"))
        width = max(len(r[0]) for r in rows)
        vwidth = min(60, max(len(r[1]) for r in rows))
        return "\n".join(f"{n:<{width}}  {v:<{vwidth}}  {s}" for n, v, s in rows)


_dataclass_init = GraphOptConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    # The generated __init__ would reject an unknown keyword with a bare TypeError; name the allowed keys.
    check_keys([key for key in kwargs if key != "sources"], "GraphOptConfig()")
    names = field_names()
    if "sources" not in kwargs and len(args) <= len(names):  # where each value came from: errors and describe() say it
        kwargs["sources"] = {key: "GraphOptConfig()" for key in names[:len(args)] + list(kwargs)}
    _dataclass_init(self, *args, **kwargs)


GraphOptConfig.__init__ = _init


def field_names() -> List[str]:
    return [f.name for f in dataclasses.fields(GraphOptConfig) if f.name != "sources"]


_FIELDS = frozenset(field_names())


def _copy_value(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _unwrap(data: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise GraphOptConfigError(f"{source}: a config must be a mapping, got {type(data).__name__}")
    if NESTED_KEY in data:
        others = [k for k in data if k != NESTED_KEY]
        if others:
            raise GraphOptConfigError(
                f"{source}: unknown key {others[0]!r} next to {NESTED_KEY!r}; put every setting under {NESTED_KEY}:"
            )
        nested = data[NESTED_KEY]
        if nested is None:
            return {}
        if not isinstance(nested, Mapping):
            raise GraphOptConfigError(f"{source}: {NESTED_KEY} must be a mapping, got {type(nested).__name__}")
        return nested
    return data


def _without_fastdeploy_keys(values: Mapping[str, Any]) -> Mapping[str, Any]:
    if not any(k in FASTDEPLOY_ONLY for k in values):
        return values
    return {k: v for k, v in values.items() if k not in FASTDEPLOY_ONLY}


def check_keys(values: Mapping[str, Any], source: str) -> None:
    allowed = field_names()
    for key in values:
        if key not in allowed:
            # A key missing its prefix (capture_sizes for cudagraph_capture_sizes) before a spelling match.
            hint = [name for name in allowed if name.endswith("_" + str(key))] \
                or difflib.get_close_matches(str(key), allowed, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise GraphOptConfigError(
                f"{source}: unknown key {key!r}{extra}; allowed keys are {', '.join(allowed)}"
            )


def _origin(cfg: GraphOptConfig, name: str) -> str:
    src = cfg.sources.get(name)
    return f" (from {src})" if src and src != "default" else ""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(cfg: GraphOptConfig) -> None:
    """Raise GraphOptConfigError naming the first bad key and what it accepts."""
    def fail(name, message):
        raise GraphOptConfigError(f"{name}={getattr(cfg, name)!r}{_origin(cfg, name)}: {message}")

    if not _is_int(cfg.graph_opt_level) or cfg.graph_opt_level not in (0, 1, 2):
        fail("graph_opt_level", "must be 0 (eager), 1 (static) or 2 (static + compiler)")
    for name in ("use_cudagraph", "full_cuda_graph", "use_unique_memory_pool", "cudagraph_copy_inputs",
                 "guarded_replays", "keep_outputs"):
        if not isinstance(getattr(cfg, name), bool):
            fail(name, "must be a boolean (true or false)")
    if cfg.cudagraph_mode is not None:
        if cfg.cudagraph_mode not in CUDAGRAPH_MODES:
            fail("cudagraph_mode", f"must be one of {', '.join(map(repr, CUDAGRAPH_MODES))}, or null to take it "
                                   "from full_cuda_graph")
        alias = cfg.sources.get("full_cuda_graph", "default") != "default"
        if alias and cfg.graph_mode != ("full" if cfg.full_cuda_graph else "piecewise"):
            fail("cudagraph_mode", f"disagrees with full_cuda_graph={cfg.full_cuda_graph!r}"
                                   f"{_origin(cfg, 'full_cuda_graph')}; full_cuda_graph is the older name of "
                                   "cudagraph_mode 'full' / 'piecewise': set one of the two")
    if not _is_int(cfg.cudagraph_max_signatures) or cfg.cudagraph_max_signatures < 1:
        fail("cudagraph_max_signatures", "must be a positive integer")
    if not _is_int(cfg.cudagraph_num_of_warmups) or cfg.cudagraph_num_of_warmups < 0:
        fail("cudagraph_num_of_warmups", "must be an integer >= 0")
    if cfg.max_capture_size is not None and (not _is_int(cfg.max_capture_size) or cfg.max_capture_size < 1):
        fail("max_capture_size", "must be a positive integer, or null to derive it")
    if cfg.max_capture_size is not None and cfg.max_capture_size > MAX_SIZE_LIMIT:
        fail("max_capture_size", f"must be at most {MAX_SIZE_LIMIT} (every captured size has static buffers of that "
                                 "many rows)")
    sizes = cfg.cudagraph_capture_sizes
    if sizes is not None:
        if not isinstance(sizes, list) or not sizes:
            fail("cudagraph_capture_sizes", "must be a non-empty list of positive integers, or null to generate them")
        for s in sizes:
            if not _is_int(s) or s < 1:
                fail("cudagraph_capture_sizes", f"every size must be a positive integer, got {s!r}")
            if s > MAX_SIZE_LIMIT:
                fail("cudagraph_capture_sizes", f"every size must be at most {MAX_SIZE_LIMIT}, got {s!r}")
        dupes = sorted({s for s in sizes if sizes.count(s) > 1})
        if dupes:
            fail("cudagraph_capture_sizes", f"sizes must be unique, {dupes[0]} appears more than once")
        if cfg.max_capture_size is not None and max(sizes) > cfg.max_capture_size:
            fail(
                "cudagraph_capture_sizes",
                f"size {max(sizes)} is above max_capture_size={cfg.max_capture_size}{_origin(cfg, 'max_capture_size')}",
            )
    warm = cfg.sot_warmup_sizes
    if warm is not None:
        if not isinstance(warm, list) or any(not _is_int(s) or s < 1 or s > MAX_SIZE_LIMIT for s in warm):
            fail("sot_warmup_sizes", f"must be a list of batch sizes (integers from 1 to {MAX_SIZE_LIMIT}), or null")
        if len(set(warm)) != len(warm):
            fail("sot_warmup_sizes", "sizes must be unique")
    for name in ("cudagraph_splitting_ops", "program_passes"):
        names = getattr(cfg, name)
        if names is None and name == "cudagraph_splitting_ops":
            continue
        if not isinstance(names, list) or any(not isinstance(n, str) or not n.strip() for n in names):
            fail(name, "must be a list of non-empty names")
        if len(set(names)) != len(names):
            fail(name, "names must be unique")
    if cfg.program_passes:
        for name in cfg.program_passes:
            if name not in KNOWN_PASSES:
                fail("program_passes", f"unknown pass {name!r}; known passes are {', '.join(KNOWN_PASSES)}")


def load_config(path: Optional[str] = None, *, environ: Optional[Mapping[str, str]] = None, **overrides) -> GraphOptConfig:
    """Effective config: defaults < YAML (path or GRAPH_OPT_CONFIG) < overrides < GRAPH_OPT_* env."""
    return _load(path, environ, overrides, "keyword argument", "kwargs")


def load_values(values: Mapping[str, Any], source: str) -> GraphOptConfig:
    """A config from explicit values named by `source` (defaults < GRAPH_OPT_CONFIG < values < GRAPH_OPT_*)."""
    return _load(None, None, values, source, source)


def _load(path, environ, overrides: Mapping[str, Any], where: str, source: str) -> GraphOptConfig:
    environ = os.environ if environ is None else environ
    env.apply_log_level(environ)
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    yaml_path = path if path is not None else env.read("GRAPH_OPT_CONFIG", environ)
    if yaml_path is not None:
        data, label = read_text_or_file(yaml_path, "" if path is not None else " (GRAPH_OPT_CONFIG)")
        data = _without_fastdeploy_keys(_unwrap(data, label))
        check_keys(data, label)
        for key, value in data.items():
            values[key] = _copy_value(value)
            sources[key] = label
    overrides = _without_fastdeploy_keys(overrides)
    check_keys(overrides, where)
    for key, value in overrides.items():
        values[key] = _copy_value(value)
        sources[key] = source
    for key, (value, var) in env.config_overrides(environ).items():
        values[key] = value
        sources[key] = f"env:{var}"
    return _build(values, sources)


def _build(values: Mapping[str, Any], sources: Mapping[str, str]) -> GraphOptConfig:
    """A validated config from explicit values (the rest default), recording where each came from."""
    cfg = GraphOptConfig.__new__(GraphOptConfig)
    for name in field_names():
        spec = GraphOptConfig.__dataclass_fields__[name]
        if name in values:
            setattr(cfg, name, _copy_value(values[name]))
        elif spec.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            setattr(cfg, name, spec.default_factory())  # type: ignore[misc]
        else:
            setattr(cfg, name, spec.default)
    cfg.sources = {name: sources.get(name, "default") for name in field_names()}
    cfg.__post_init__()
    return cfg


def with_env(cfg: GraphOptConfig, environ: Optional[Mapping[str, str]] = None) -> GraphOptConfig:
    """cfg with GRAPH_OPT_* overrides applied on top: the environment wins over code."""
    environ = os.environ if environ is None else environ
    env.apply_log_level(environ)
    overrides = env.config_overrides(environ)
    if not overrides:
        return cfg
    values = cfg.to_dict()
    sources = dict(cfg.sources)
    for key, (value, var) in overrides.items():
        values[key] = value
        sources[key] = f"env:{var}"
    return _build(values, sources)


def resolve(value) -> GraphOptConfig:
    """Accept what a user may pass as graph_opt_config=: a config, a dict, a YAML path or None."""
    if value is None:
        return load_config()
    if isinstance(value, GraphOptConfig):  # the model's own copy: a later change to value is not the model's
        return with_env(_build(value.to_dict(), value.sources))
    if isinstance(value, Mapping):
        return _load(None, None, _unwrap(value, NESTED_KEY), f"{NESTED_KEY} dict", "dict")
    if isinstance(value, (str, os.PathLike)):
        return load_config(os.fspath(value))
    raise GraphOptConfigError(
        f"graph_opt_config must be a GraphOptConfig, a dict or a YAML path (or JSON text), got {type(value).__name__}"
    )
