"""graph_opt.autocudagraph: the forward and the backward of a training block, each a CUDA graph.

    block = graph_opt.autocudagraph(layer)   # the same Layer / Module, its calls now graphed
    y = block(x); y.sum().backward()          # forward graph replayed, then backward graph replayed

Per dispatch key (shapes, dtypes and requires-grad flags of the tensor leaves, the non-tensor values,
autocast state): `warmup_steps` eager calls, then one capture of the forward and one of the backward
(the backward is `autograd.grad` of the forward's outputs, into static gradient buffers), then replay.
Under no_grad a key gets a forward graph alone. The replayed forward enters autograd through a
`torch.autograd.Function` / `paddle.autograd.PyLayer` whose backward replays the backward graph, so
gradients reach `.grad` through the framework's own accumulation, as in eager.

What a replay may rely on, and what this module guarantees instead of assuming:
- Outputs are copies: a caller may keep them across steps.
- A forward replay overwrites the activations the previous replay's backward reads. A call made while
  a backward is pending (its autograd graph alive and not yet run) replays a second set of graphs, in a
  memory pool of its own, captured at the first such call (slots.py): the two backwards run in either
  order or summed. A call while two are pending runs eagerly (counted in `fallbacks`, one warning). All
  keys share a slot's memory pool, so this holds across keys; a backward checks that no replay in its
  slot overwrote its activations.
- A data-parallel wrapper (DistributedDataParallel, paddle.DataParallel) passed in has its module
  graphed, and is returned: its forward and its all-reduce hooks stay outside the graphs, reached by
  autograd's accumulation of the gradients the backward replay hands out.
- Parameters and buffers are read by address. One replaced after capture (a new object, or `.data`
  swapped) is detected at the next call: the graphs are dropped and captured again.
- Gradients handed to leaves that have none yet are copies (autograd would otherwise keep the
  static buffer as `.grad`, and the next replay would overwrite it).
- A loss that leaves some outputs out gets a backward graph of the used ones alone (captured at the
  first such backward), never the full one with zeros: an unused output's backward may make NaN.
- Capture touches no `.grad` and leaves the random generators as eager would (snapshot and restore).

What it does not do: graph a block whose forward syncs with the host or changes shapes between calls
of one key (capture fails: the key runs eagerly, with one warning), or a second-order backward
(`create_graph=True`: an error says so).

Where the parts are: one block's state, call, capture and replay (block.py), what it watches of the
module after capture (watch.py), one key's graphs and how they are recorded (graphs.py), its capture
(key_capture.py), the slots of calls pending together (slots.py); its counters are in stats.py.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

from .. import backends
from ..errors import GraphOptInputError
from .block import GraphedBlock, _module_framework

logger = logging.getLogger("graph_opt")

_STATE_ATTR = "_graph_opt_training"


def _check_arguments(target, warmup_steps, dispatch_key_fn, max_graphs, level) -> None:
    if not callable(target):
        raise GraphOptInputError(
            f"autocudagraph(target): expected a function or a paddle.nn.Layer / torch.nn.Module instance, "
            f"got {type(target).__name__}")
    if isinstance(target, type):
        raise GraphOptInputError(
            f"autocudagraph(target): got the class {target.__name__}; pass an instance (autocudagraph(Model())) "
            "or a function")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise GraphOptInputError(f"autocudagraph(warmup_steps={warmup_steps!r}): expected an int >= 0")
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise GraphOptInputError(f"autocudagraph(max_graphs={max_graphs!r}): expected an int >= 1")
    if level is not None and (isinstance(level, bool) or level not in (0, 1, 2)):
        raise GraphOptInputError(
            f"autocudagraph(level={level!r}): expected 0 (capture the eager forward, bitwise eager), 1 (trace it "
            "with Dynamo and AOTAutograd, eager kernels), 2 (trace it and compile with Inductor), or None (the "
            "default: 0, and a key whose eager capture a tensor made from host data stops traced at 1)")
    if dispatch_key_fn is not None and not callable(dispatch_key_fn):
        raise GraphOptInputError(
            f"autocudagraph(dispatch_key_fn=...): expected a callable (*args, **kwargs) -> hashable or None, "
            f"got {type(dispatch_key_fn).__name__}")


_PADDLE_LEVEL = ("autocudagraph(level={level}): traced training graphs are torch's (Dynamo and AOTAutograd); "
                 "a Paddle block is captured from its eager forward: use level=0")


def autocudagraph(target=None, *, warmup_steps: int = 1, dispatch_key_fn: Optional[Callable] = None,
                  max_graphs: int = 8, level: Optional[int] = None):
    """Capture the forward and the backward of `target` as CUDA graphs and replay them every step.

    target: a function of tensors, or a paddle.nn.Layer / torch.nn.Module instance (that instance is
    returned, its forward graphed; `type(layer).forward(layer, ...)` stays the eager forward); for a
    DistributedDataParallel / paddle.DataParallel, its wrapped module is graphed and the wrapper
    returned. Also usable as `@autocudagraph` or `@autocudagraph(warmup_steps=2)`.
    warmup_steps: eager calls per dispatch key before its capture (0: capture on the first call).
    dispatch_key_fn(*args, **kwargs) -> hashable: picks the graph; the default key is the tensor
    leaves' shapes, dtypes and requires-grad flags plus the non-tensor values. No padding: shapes are
    replayed exactly.
    max_graphs: dispatch keys at most (a key counts from its first call); calls with further keys run
    eagerly (one warning).
    level: what is captured (torch; Paddle captures level 0). 0: the eager forward and its autograd
    backward, bitwise eager. 1: the forward traced by Dynamo and AOTAutograd into forward and backward
    graphs of eager kernels (constants a forward makes from Python numbers are folded in, so a forward
    that copies them to the device captures). 2: those graphs compiled by Inductor (fused kernels;
    gradients within rounding of eager's). At levels 1 and 2 a key's first call runs eagerly, then
    `warmup_steps` traced calls (the first compiles), then the capture. None (the default): level 0, and
    a key whose eager capture fails on a tensor made from host data (Hugging Face's eager attention mask)
    is traced at level 1, with one warning (graph_opt.training.levels).

    GRAPH_OPT_DISABLE=1 makes every call plain eager. See graph_opt.training.api for the guarantees.
    """
    if target is None:
        return lambda t: autocudagraph(t, warmup_steps=warmup_steps, dispatch_key_fn=dispatch_key_fn,
                                       max_graphs=max_graphs, level=level)
    _check_arguments(target, warmup_steps, dispatch_key_fn, max_graphs, level)
    framework = _module_framework(target)
    if framework == "paddle" and level:
        raise GraphOptInputError(_PADDLE_LEVEL.format(level=level))
    if framework is not None and _STATE_ATTR not in target.__dict__:
        wrapped = backends.load(framework).wrapped_module(target)
        if wrapped is not None:
            return _graph_wrapped(target, *wrapped, warmup_steps=warmup_steps, dispatch_key_fn=dispatch_key_fn,
                                  max_graphs=max_graphs, level=level)
    if framework is not None:
        if getattr(type(target), "__graph_opt_decorated__", False):
            raise GraphOptInputError(
                f"autocudagraph(target): {type(target).__qualname__} is decorated with @support_graph_optimization, "
                "whose calls go to its inference graphs and never reach the forward autocudagraph would graph. "
                "Wrap a submodule (autocudagraph(model.inner)), or an instance of an undecorated class")
        if _STATE_ATTR in target.__dict__:
            raise GraphOptInputError(
                f"autocudagraph(target): this {type(target).__name__} instance is already graphed; "
                "wrap it once (graph_opt.clear_graphs drops its graphs)")
        eager = type(target).forward.__get__(target)
        block = GraphedBlock(target, eager, target, framework, warmup_steps, dispatch_key_fn, max_graphs, level)
        object.__setattr__(target, _STATE_ATTR, block)
        if not block.disabled:
            object.__setattr__(target, "forward", block)  # Layer/Module __call__ reaches it through self.forward
        return target
    if state_of_training(target) is not None:
        raise GraphOptInputError("autocudagraph(target): this function is already graphed; wrap the original once")
    block = GraphedBlock(target, target, None, None, warmup_steps, dispatch_key_fn, max_graphs, level)

    @functools.wraps(target)
    def graphed(*args, **kwargs):
        return block(*args, **kwargs)

    setattr(graphed, _STATE_ATTR, block)
    return graphed


def _graph_wrapped(wrapper, inner, attr: str, **options):
    """A data-parallel wrapper (DistributedDataParallel, paddle.DataParallel): its module is graphed and
    the wrapper returned, so that its forward (buffer broadcast, the reducer's preparation) runs eagerly
    around the block's replay, and the gradients the backward replay hands to autograd reach the
    reducer's all-reduce hooks through autograd's own accumulation, as in eager."""
    autocudagraph(inner, **options)
    block = state_of_training(inner)
    if block is not None:
        framework = block.framework or _module_framework(inner)
        block.data_parallel = backends.load(framework).autograd_bridge().data_parallel(wrapper)
    object.__setattr__(wrapper, _STATE_ATTR, block)  # graph_opt.stats(wrapper) finds it
    logger.info("autocudagraph(%s): graphed its wrapped %s (.%s); the wrapper's forward and its gradient "
                "all-reduce stay outside the graphs", type(wrapper).__name__, type(inner).__name__, attr)
    return wrapper


def state_of_training(obj) -> Optional[GraphedBlock]:
    """The GraphedBlock behind an autocudagraph result, or None."""
    holder = getattr(obj, "__dict__", None)
    if not isinstance(holder, dict):
        return None
    state = holder.get(_STATE_ATTR)
    return state if isinstance(state, GraphedBlock) else None
