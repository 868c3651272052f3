"""The default level's second try: a model whose graph_opt_level is the default (0), whose eager forward
could not be captured for a cause tracing removes, is traced at level 1 instead, with one warning.

The cause is a tensor the forward makes from host data (`torch.tensor(0.0, device=x.device)`, as
transformers' eager attention mask does): a copy from pageable host memory, which a capture refuses,
and which torch's tracer makes once when it traces (backends/torch/host_constants.py). A level the user
set, 0 included (a YAML file, a keyword, GRAPH_OPT_LEVEL), is kept; with several ranks the usual
fallback holds (the ranks would have to agree on the switch); Paddle keeps level 0 (its adapter's
static_folds_host_constants). If level 1 fails too, its failure is the usual one: no graphs, one warning.
"""
from __future__ import annotations

import logging

from .. import config as config_mod
from .failures import describe, made_from_host_data

logger = logging.getLogger("graph_opt")

TRACED_LEVEL = 1


def may_trace_instead(cfg, adapter) -> bool:
    """Whether a failed level-0 capture may move the model to level 1: the user left the level at its
    default, and the framework's tracer makes tensors of host numbers once."""
    return (cfg.graph_opt_level == 0 and cfg.sources.get("graph_opt_level", "default") == "default"
            and adapter.static_folds_host_constants)


def trace_instead(state, runner, exc: BaseException, size: int) -> bool:
    """A level-0 runner's capture of `size` failed with exc: where the cause is host data, `state` (the
    model's GraphOptState) runs at level 1 from now on and True is returned. The failed runner is dropped
    whole (graphs, buffers, the model's watch); a call in flight on it is answered by the plain forward.
    The sizes are captured again at level 1: by capture_model in the same call, or at the next calls."""
    if not made_from_host_data(exc):
        return False
    cause = f"capture of size {size} failed: {describe(exc, traced=True)}"
    runner.disable(f"{cause}; traced at level 1 (graph_opt_level=1) instead")
    message = (f"the eager forward (graph_opt_level 0, the default) could not be captured: {cause}. The model is "
               f"traced at level 1 (graph_opt_level=1) instead, which makes such a tensor once when it traces. "
               "Set graph_opt_level: 1 in graph_opt_config to choose this yourself (then without this warning), "
               "or graph_opt_level: 0 to keep the eager forward, which then runs without graphs")
    values = state.config.to_dict()
    values["graph_opt_level"] = TRACED_LEVEL
    sources = dict(state.config.sources, graph_opt_level="chosen automatically: the eager forward could not be "
                                                         "captured (stats().retraced_reason)")
    state.use_config(config_mod._build(values, sources))
    state.retraced_reason = message
    logger.warning("%s: %s", state.name, message)
    return True
