"""Every GRAPH_OPT_* environment variable, in one table.

Environment values override YAML and keyword arguments (see config.load_config). A value that does
not parse is an error that names the variable and what it accepts.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .cudagraph_modes import CUDAGRAPH_MODES
from .errors import GraphOptConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if not value:  # a setting left empty is more likely a mistake than "false"
        raise GraphOptConfigError(f"{name} is set but empty: expected a boolean (1/0, true/false, yes/no, on/off), "
                                  "or unset it for the config's value")
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise GraphOptConfigError(f"{name}={raw!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


def parse_switch(name: str, raw: str) -> bool:
    """A process-wide switch: empty means off, as for an unset one."""
    return bool(raw.strip()) and parse_bool(name, raw)


def parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        var = ENV_BY_NAME.get(name)
        accepts = f" ({var.doc})" if var is not None else ""
        raise GraphOptConfigError(f"{name}={raw!r}: expected an integer{accepts}") from None


def parse_int_list(name: str, raw: str) -> list:
    items = [item.strip() for item in raw.split(",")]
    if not raw.strip() or any(not item for item in items):
        raise GraphOptConfigError(f"{name}={raw!r}: expected a comma-separated list of integers, e.g. '1,2,4,8'")
    try:
        return [int(item) for item in items]
    except ValueError:
        raise GraphOptConfigError(
            f"{name}={raw!r}: expected a comma-separated list of integers, e.g. '1,2,4,8'"
        ) from None


def parse_str_list(name: str, raw: str) -> list:
    items = [item.strip() for item in raw.split(",")]
    if not raw.strip():
        raise GraphOptConfigError(f"{name} is set but empty: expected a comma-separated list of names, or unset "
                                  "it for the config's value")
    if any(not item for item in items):
        raise GraphOptConfigError(f"{name}={raw!r}: expected a comma-separated list of names with no empty entries")
    return [item for item in items if item]


def parse_mode(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in CUDAGRAPH_MODES:
        raise GraphOptConfigError(f"{name}={raw!r}: expected one of {', '.join(CUDAGRAPH_MODES)}")
    return value


def parse_log_level(name: str, raw: str) -> str:
    value = raw.strip().upper()
    if value not in LOG_LEVELS:
        raise GraphOptConfigError(f"{name}={raw!r}: expected one of {', '.join(LOG_LEVELS)}")
    return value


def parse_path(name: str, raw: str) -> str:
    if not raw.strip():
        raise GraphOptConfigError(f"{name} is set but empty: expected the path of a YAML file")
    return raw.strip()


@dataclass(frozen=True)
class EnvVar:
    name: str
    field: Optional[str]  # the GraphOptConfig field it overrides, or None for process-wide switches
    parse: Callable[[str, str], Any]
    doc: str


ENV_VARS = (
    EnvVar("GRAPH_OPT_CONFIG", None, parse_path, "YAML file with the graph_opt_config (bare or nested)"),
    EnvVar("GRAPH_OPT_DISABLE", None, parse_switch, "kill switch: models run plain eager, nothing is captured"),
    EnvVar("GRAPH_OPT_LEVEL", "graph_opt_level", parse_int, "graph_opt_level: 0, 1 or 2 for eager, static, static+compiler"),
    EnvVar("GRAPH_OPT_USE_CUDAGRAPH", "use_cudagraph", parse_bool, "use_cudagraph"),
    EnvVar("GRAPH_OPT_FULL_CUDA_GRAPH", "full_cuda_graph", parse_bool, "full_cuda_graph"),
    EnvVar("GRAPH_OPT_CUDAGRAPH_MODE", "cudagraph_mode", parse_mode, "cudagraph_mode: full, piecewise or "
           "full_and_piecewise"),
    EnvVar("GRAPH_OPT_CAPTURE_SIZES", "cudagraph_capture_sizes", parse_int_list, "capture sizes, e.g. '1,2,4,8'"),
    EnvVar("GRAPH_OPT_MAX_CAPTURE_SIZE", "max_capture_size", parse_int, "max_capture_size, a positive integer"),
    EnvVar("GRAPH_OPT_NUM_WARMUPS", "cudagraph_num_of_warmups", parse_int, "cudagraph_num_of_warmups, an integer >= 0"),
    EnvVar("GRAPH_OPT_SPLITTING_OPS", "cudagraph_splitting_ops", parse_str_list, "splitting ops, comma list"),
    EnvVar("GRAPH_OPT_USE_UNIQUE_MEMORY_POOL", "use_unique_memory_pool", parse_bool, "use_unique_memory_pool"),
    EnvVar("GRAPH_OPT_COPY_INPUTS", "cudagraph_copy_inputs", parse_bool, "cudagraph_copy_inputs"),
    EnvVar("GRAPH_OPT_MAX_SIGNATURES", "cudagraph_max_signatures", parse_int,
           "cudagraph_max_signatures, a positive integer"),
    EnvVar("GRAPH_OPT_GUARDED_REPLAYS", "guarded_replays", parse_bool, "guarded_replays"),
    EnvVar("GRAPH_OPT_KEEP_OUTPUTS", "keep_outputs", parse_bool, "keep_outputs"),
    EnvVar("GRAPH_OPT_LOG_LEVEL", None, parse_log_level, "level of the 'graph_opt' logger (DEBUG..CRITICAL)"),
    EnvVar("GRAPH_OPT_SIMULATE_CUDAGRAPH", None, parse_switch, "replay host stand-in graphs where CUDA graphs are unavailable"),
)
ENV_BY_NAME = {var.name: var for var in ENV_VARS}


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of one variable, or None when it is unset."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None:
        return None
    return ENV_BY_NAME[name].parse(name, raw)


def config_overrides(environ: Optional[Mapping[str, str]] = None) -> dict:
    """{field: (value, variable name)} for every set variable that overrides a config field.

    Every set GRAPH_OPT_* variable is parsed here, the process-wide switches too, so a bad value of
    GRAPH_OPT_DISABLE or GRAPH_OPT_SIMULATE_CUDAGRAPH is an error when the config is loaded, not at
    some later call that happens to read it."""
    environ = os.environ if environ is None else environ
    found = {}
    for var in ENV_VARS:
        if var.name in environ:
            value = var.parse(var.name, environ[var.name])
            if var.field is not None:
                found[var.field] = (value, var.name)
    unknown = sorted(k for k in environ if k.startswith("GRAPH_OPT_") and k not in ENV_BY_NAME)
    if unknown:
        raise GraphOptConfigError(
            f"unknown environment variable {unknown[0]}; graph_opt reads {', '.join(ENV_BY_NAME)}"
        )
    return found


def disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    return bool(read("GRAPH_OPT_DISABLE", environ))


def simulate_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    return bool(read("GRAPH_OPT_SIMULATE_CUDAGRAPH", environ))


def apply_log_level(environ: Optional[Mapping[str, str]] = None) -> None:
    level = read("GRAPH_OPT_LOG_LEVEL", environ)
    if level is not None:
        logging.getLogger("graph_opt").setLevel(level)
