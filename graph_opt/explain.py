"""graph_opt.explain(model, *args, **kwargs): what a call with these arguments would do, and why, without
making it; graph_opt.config_of(model): the config a model runs with.

explain follows GraphRunner._dispatch (replay/runner.py) step by step, reading what a call reads: the
signature, the padded size, the captured entry, the model's state and the framework's guards. It runs no
forward, copies nothing, captures nothing, and moves no counter of stats(). What only a replay itself finds
(an argument that shares memory with another, a host tensor holding other values than at capture, another
address with cudagraph_copy_inputs false) it does not see; the call then says it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Optional

from . import config as config_mod
from .decorator import GraphOptState, state_of
from .pytree import flatten
from .replay import dispatch
from .replay.runner import _GRAD, _NO_BATCH, GraphRunner, _all_tensors_spec
from .replay.signature import Signature, forward_params
from .training import api as training
from .watch.fallbacks import FIXES, Fallback, Reason

REPLAY = "replay"
CAPTURE = "capture at this call, then replay"
WITHOUT = "run without graphs"
RAISE = "raise GraphOptInputError"


@dataclass
class Explanation:
    """What a call would do (action), at which padded size, and why; reason is the fallback's
    (stats().fallback_reasons' key, docs/fallbacks.md) where it runs without graphs for one."""

    model: str
    mode: str
    action: str
    why: str
    fix: str = ""
    rows: Optional[int] = None
    padded_size: Optional[int] = None
    reason: Optional[Reason] = None
    captured_sizes: List[int] = field(default_factory=list)

    def __str__(self) -> str:
        size = ""
        if self.padded_size and self.action in (REPLAY, CAPTURE):
            size = f": padded size {self.padded_size} for a call of {self.rows} rows"
        elif self.rows:
            size = f" (a call of {self.rows} rows)"
        lines = [f"{self.model} [{self.mode}]: {self.action}{size}",
                 f"  why: {self.why}" + (f" (reason {self.reason.value!r})" if self.reason is not None else "")]
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        lines.append(f"  captured sizes: {self.captured_sizes or 'none yet'}")
        return "\n".join(lines)


_ACCEPTS = "an instance of a class decorated with @graph_opt.support_graph_optimization"


def _state(model, what: str) -> GraphOptState:
    if training.state_of_training(model) is not None:
        raise TypeError(f"graph_opt.{what} takes {_ACCEPTS}; got a block made by graph_opt.autocudagraph, whose "
                        "calls warm up, capture and replay per key on their own (graph_opt.stats(block) counts them)")
    try:
        return state_of(model)
    except TypeError:
        if isinstance(model, type):
            raise TypeError(f"graph_opt.{what} takes {_ACCEPTS}; got the class {model.__name__}: pass an instance")
        raise TypeError(f"graph_opt.{what} takes {_ACCEPTS}; got a {type(model).__name__}, whose class is not "
                        "decorated") from None


def config_of(model) -> config_mod.GraphOptConfig:
    """A copy of the GraphOptConfig a decorated model runs with: `.sources` says where each value came
    from (default, YAML, kwargs, env), `.describe()` prints both. Changing the copy changes nothing."""
    return copy.deepcopy(_state(model, "config_of").config)


def explain(model, *args, **kwargs) -> Explanation:
    """What `model(*args, **kwargs)` would do now: replay a padded size, capture one at the call, run
    without graphs (the reason and its fix), or raise (what is wrong with an argument). Nothing runs."""
    state = _state(model, "explain")
    cfg = state.config
    runner = state.runner

    def answer(action, why, fix="", **more) -> Explanation:
        sizes = runner.captured_sizes() if runner is not None and hasattr(runner, "captured_sizes") else []
        return Explanation(state.name, state.mode, action, why, fix, captured_sizes=sizes, **more)

    if state.disabled:
        return answer(WITHOUT, "GRAPH_OPT_DISABLE is set: every call runs the plain forward",
                      "unset GRAPH_OPT_DISABLE")
    if not cfg.use_cudagraph:
        path = "the eager forward" if cfg.graph_opt_level == 0 else f"the static path (level {cfg.graph_opt_level})"
        return answer(WITHOUT, f"use_cudagraph is false{config_mod._origin(cfg, 'use_cudagraph')}: calls run {path}",
                      "use_cudagraph: true to capture graphs")
    if runner is None and not state.graphs_available():
        return answer(WITHOUT, f"CUDA graphs are unavailable here ({state.adapter.name} has no CUDA graph support)",
                      FIXES[Reason.NO_GRAPHS])  # not counted as a fallback: the model has no graphs to fall from
    if isinstance(runner, dispatch.KindDispatch):
        kind = runner.key_fn(*args, **kwargs)
        if kind not in runner.kinds:
            return answer(RAISE, f"dispatch_key_fn returned {kind!r}", "return 'full' or 'piecewise' from it")
        runner = runner.kinds[kind]
    if runner is None:  # nothing captured yet, no runner made: a probe with the model's signatures' rules
        probe = GraphRunner(adapter=state.adapter, config=cfg, strategy=None, eager=None,
                            dynamic_arg_dims=state.dynamic_arg_dims, params=forward_params(state.forward_fn),
                            name=state.name)
        return _walk(probe, state, args, kwargs, answer)
    return _walk(runner, state, args, kwargs, answer)


def _without(answer, why: Fallback, **more) -> Explanation:
    fix = FIXES.get(why.reason, "")
    if why.reason is Reason.OUTPUTS and " in training mode" in why.message:  # the capture check named the cause
        fix = "call model.eval() before capture_model()"
    return answer(WITHOUT, why.message, fix, reason=why.reason, **more)


def _misfit(answer, misfit, sizes) -> Explanation:
    """Another non-batch shape runs without graphs; another device, rank or dtype is the caller's error."""
    if misfit[0] == "shape":
        return _without(answer, Fallback(Reason.MISMATCH, misfit[1]), **sizes)
    return answer(RAISE, misfit[1], **sizes)


def _walk(runner: GraphRunner, state: GraphOptState, args, kwargs, answer) -> Explanation:
    """GraphRunner._dispatch's decisions for this call, read, not made."""
    if runner.disabled_reason is not None:
        return answer(WITHOUT, runner.disabled_reason, FIXES[Reason.DISABLED], reason=Reason.DISABLED)
    adapter, table = runner.adapter, runner.signatures
    if not kwargs and len(args) == len(runner.params) and all(map(adapter.is_tensor, args)):
        leaves, spec = list(args), _all_tensors_spec(len(args))
    else:
        if kwargs or len(args) < len(runner.params):
            args, kwargs = table.canonical(args, kwargs)
        leaves, spec = flatten((args, kwargs), adapter.is_tensor)
    sig = table.get(spec)
    known = sig is not None
    if not known:
        refusal = table.refusal(spec, runner.capture_model_done)
        if refusal is not None:
            return _without(answer, refusal)
        dims = table.dynamic_dims(spec, leaves)
        if not any(d is not None for d in dims):
            return _without(answer, _NO_BATCH)
        sig = Signature(0, spec, dims, (args, kwargs))
    try:
        real = sig.batch_size(adapter, leaves)
    except IndexError:
        real = -1
    padded = runner.table.padded_size(real) if real > 0 else 0
    if not padded:
        if real < 0:
            misfit = table.misfit(sig, leaves, "argument") if known else None
            return answer(RAISE, table.bad_call(sig, leaves, misfit).args[0], "pass arguments as the message says")
        if real == 0:
            return answer(WITHOUT, "a batch of 0 rows runs without graphs (expected; counted under no reason)")
        return answer(WITHOUT, f"a call of {real} rows is above the largest capture size, {runner.max_size}",
                      FIXES[Reason.ABOVE_MAX], rows=real, reason=Reason.ABOVE_MAX)
    sizes = dict(rows=real, padded_size=padded)
    if adapter.grad_enabled():
        return _without(answer, _GRAD, **sizes)
    model_state = runner.model_state
    blocked = model_state.check() if model_state.captured else None
    if blocked is not None:
        return _without(answer, blocked, **sizes)
    misfit = table.misfit(sig, leaves, "argument") if known else None
    entry = sig.entries.get(padded) if known else None
    if entry is None:
        if misfit is not None:
            return _misfit(answer, misfit, sizes)
        refusal = runner.at_calls.refusal() if runner.strategy is not None else None
        if refusal is not None:
            return _without(answer, refusal, **sizes)
        nothing = not runner.captured_sizes()
        why = ("nothing is captured yet" if nothing else f"padded size {padded} is not captured yet") + \
            ": the call captures it (warmups, the capture and its check run the forward), then replays it"
        return answer(CAPTURE, why, "capture_model() captures every size ahead, so that no call pays for a capture",
                      **sizes)
    check = entry.captured.check
    blocked = check() if check is not None else None
    if blocked is None and real != padded and sig.layout.exact_only:
        blocked = Fallback(Reason.OUTPUTS, sig.layout.why_exact_only())
    if blocked is not None:
        return _without(answer, blocked, **sizes)
    if misfit is not None:
        return _misfit(answer, misfit, sizes)
    return answer(REPLAY, f"padded size {padded} is captured and nothing a replay checks has changed since", **sizes)
