"""The PyTorch backend: adapter, version check, and the static (Dynamo) paths."""
from __future__ import annotations

import torch

from .. import version_tuple
from .adapter import ADAPTER  # noqa: F401  (part of the backend interface)

MIN_VERSION = (2, 4)


def check_version(version: str = None) -> None:
    version = torch.__version__ if version is None else version
    parts = version_tuple(version)
    if tuple(parts) < MIN_VERSION:
        raise RuntimeError(
            f"graph_opt needs torch >= {MIN_VERSION[0]}.{MIN_VERSION[1]} (Dynamo's bytecode hook and "
            f"torch.library custom ops), found {version}; install torch>={MIN_VERSION[0]}.{MIN_VERSION[1]}"
        )


def static_strategy(model, forward_fn, config, selection):
    from .dynamo import DynamoStrategy

    return DynamoStrategy(model, forward_fn, config, ADAPTER, selection)



def rank_group():
    """The job's ranks for graph_opt.capture.ranks, or None in a single process."""
    from .ranks import rank_group as find

    return find()


def autograd_bridge():
    from .autograd_bridge import BRIDGE

    return BRIDGE


def tracing_hooks(fn):
    """(is Dynamo tracing now, fn hidden from it): a graphed block called inside code torch.compile traces
    breaks the graph there and runs as itself."""
    return torch.compiler.is_compiling, torch.compiler.disable(fn)


def wrapped_module(model):
    """(the module, its attribute) of a wrapper whose own forward and hooks must stay outside the graphs
    (DistributedDataParallel: its forward syncs buffers and prepares the reducer, whose hooks all-reduce
    the gradients as autograd accumulates them), or None."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp is not None and isinstance(model, ddp):
        return model.module, "module"
    return None
