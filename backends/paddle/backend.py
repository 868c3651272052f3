"""The Paddle backend: adapter, version check, and the static (SOT) paths."""
from __future__ import annotations

import types

import paddle

from .. import version_tuple
from .adapter import ADAPTER  # noqa: F401  (part of the backend interface)

MIN_VERSION = (3, 2)


def check_version(version: str = None) -> None:
    version = paddle.__version__ if version is None else version
    parts = version_tuple(version)
    if tuple(parts) == (0, 0):  # a development build
        return
    if tuple(parts) < MIN_VERSION:
        raise RuntimeError(
            f"graph_opt needs PaddlePaddle >= {MIN_VERSION[0]}.{MIN_VERSION[1]}, found {version}; "
            f"install paddlepaddle>={MIN_VERSION[0]}.{MIN_VERSION[1]} (or paddlepaddle-gpu>={MIN_VERSION[0]}.{MIN_VERSION[1]})"
        )


def static_strategy(model, forward_fn, config, selection):
    from .sot import SotStrategy

    return SotStrategy(model, forward_fn, config, ADAPTER, selection)



def rank_group():
    """The job's ranks for graph_opt.capture.ranks, or None in a single process."""
    from .ranks import rank_group as find

    return find()


def autograd_bridge():
    from .autograd_bridge import BRIDGE, _install_partial_grad_watch

    _install_partial_grad_watch()  # again after patches.remove_all()
    return BRIDGE


def tracing_hooks(fn):
    """No compiler traces around a graphed Paddle block: (None, fn)."""
    return None, fn


def wrapped_module(model):
    """(the layer, its attribute) of paddle.DataParallel, whose forward prepares the reducer that
    all-reduces the gradients as autograd accumulates them: it stays outside the graphs. Else None."""
    data_parallel = getattr(paddle, "DataParallel", None)
    if data_parallel is not None and isinstance(model, data_parallel):
        return model._layers, "_layers"
    return None
