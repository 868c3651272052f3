"""FastDeploy's graph optimization config, read as graph_opt's.

A model FastDeploy builds takes an `fd_config` whose `graph_opt_config` (FastDeploy's
GraphOptimizationConfig: an object, a mapping, or JSON text) says how it is optimized. A decorated class
whose __init__ takes `fd_config` reads it there (decorator.py) when no `graph_opt_config=` is given.
FastDeploy's keys keep their meaning here (docs/fastdeploy.md has the table): the same names mean the same
things; an empty cudagraph_splitting_ops with full_cuda_graph false splits at the default ops; its keys
for its own scheduler (prefill sizes, the size maps it precomputes) are not needed here and are skipped.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from . import config as config_mod
from .errors import GraphOptConfigError

SOURCE = "fd_config.graph_opt_config"

FASTDEPLOY_ONLY = config_mod.FASTDEPLOY_ONLY


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
        value = config_mod.read_json_text(value) if config_mod.is_json_text(value) else config_mod.read_yaml(value)
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
