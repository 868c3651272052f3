"""FastDeploy's graph optimization config, read as graph_opt's.

A model FastDeploy builds takes an `fd_config` whose `graph_opt_config` (FastDeploy's
GraphOptimizationConfig: an object, a mapping, or JSON text) says how it is optimized. A decorated class
whose __init__ takes `fd_config` reads it there (decorator.py) when no `graph_opt_config=` is given.
FastDeploy's keys keep their meaning here (docs/fastdeploy.md has the table): the same names mean the same
things; an empty cudagraph_splitting_ops with full_cuda_graph false splits at the default ops; its keys
for its own scheduler (prefill sizes, the size maps it precomputes) are not needed here and are skipped.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Optional

from . import config as config_mod
from .errors import GraphOptConfigError

logger = logging.getLogger("graph_opt")

SOURCE = "fd_config.graph_opt_config"

def graph_opt_config_of(fd_config: Any) -> Optional[Any]:
    """fd_config's graph_opt_config (an attribute, or a key of a mapping), or None."""
    if fd_config is None:
        return None
    if isinstance(fd_config, Mapping):
        return fd_config.get("graph_opt_config")
    return getattr(fd_config, "graph_opt_config", None)


def from_fastdeploy(value: Any) -> config_mod.GraphOptConfig:
    """graph_opt's config from FastDeploy's: a GraphOptimizationConfig object (its public attributes), a
    mapping of its keys, JSON text or a YAML path, or a GraphOptConfig. A mapping's unknown key is an
    error naming the allowed ones; an object's attributes that neither knows are skipped (FastDeploy adds
    fields of its own between versions)."""
    if isinstance(value, config_mod.GraphOptConfig):
        return config_mod.resolve(value)
    if isinstance(value, str):  # its keys over GRAPH_OPT_CONFIG's, as a mapping's (docs/fastdeploy.md's precedence)
        value = config_mod.read_text_or_file(value)[0]
    if isinstance(value, Mapping):  # nested under graph_opt_config: too, as in every other mapping source
        values = dict(config_mod._unwrap(value, SOURCE))
    elif hasattr(value, "__dict__"):
        known = set(config_mod.field_names())
        values = {k: v for k, v in vars(value).items() if k in known}
    else:
        raise GraphOptConfigError(
            f"{SOURCE}: expected FastDeploy's GraphOptimizationConfig, a mapping of its keys, JSON text or a YAML "
            f"path, got {type(value).__name__}")
    return config_mod.load_values(values, SOURCE)


_UNUSED_OPS_SAID: set = set()


def warn_unused_splitting_ops(name: str, cfg) -> None:
    """Splitting ops named with a full graph, which captures them inside (FastDeploy documents the two as
    exclusive): a warning once per class and list, not an error, since a preset may name the ops a switch
    to piecewise uses (GRAPH_OPT_SPLITTING_OPS beside a YAML that picks the mode)."""
    key = (name, tuple(cfg.cudagraph_splitting_ops))
    if key in _UNUSED_OPS_SAID:
        return
    _UNUSED_OPS_SAID.add(key)
    logger.warning("%s: cudagraph_splitting_ops=%r%s is unused: the graph is full (full_cuda_graph true / "
                   "cudagraph_mode 'full') and captures those ops inside. Set full_cuda_graph: false (cudagraph_mode: "
                   "piecewise) to split at them", name, cfg.cudagraph_splitting_ops,
                   config_mod._origin(cfg, "cudagraph_splitting_ops"))


def fd_config_position(init, cls: Optional[type] = None) -> Optional[int]:
    """Where __init__ takes FastDeploy's `fd_config`: its position after self (-1: by keyword only, or
    through **kwargs), or None where it takes none. An __init__(self, *args, **kwargs) that names nothing
    forwards to its base's (super().__init__(*args, **kwargs)): the base's position is the one."""
    try:
        params = list(inspect.signature(init).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "fd_config":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else -1
    if cls is not None and params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        owner = next((k for k in cls.__mro__ if "__init__" in k.__dict__), None)
        later = cls.__mro__[cls.__mro__.index(owner) + 1:] if owner is not None else ()
        base = next((k for k in later if "__init__" in k.__dict__), None)
        if base is not None and base is not object:
            found = fd_config_position(base.__dict__["__init__"], base)
            if found is not None:
                return found
    return -1 if any(p.kind == p.VAR_KEYWORD for p in params) else None
