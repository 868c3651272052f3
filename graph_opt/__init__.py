"""graph_opt: CUDA-graph capture and replay, one graph per padded batch size, for Paddle and PyTorch.

    cfg = graph_opt.GraphOptConfig.from_yaml("decode_piecewise")  # a preset, or a YAML path

    @graph_opt.support_graph_optimization
    class Decoder(paddle.nn.Layer): ...

    m = Decoder(hidden=256, graph_opt_config=cfg)
    report = graph_opt.capture_model(m, make_inputs=lambda bs: {"x": paddle.randn([bs, 256])})
    y = m(x)  # any batch size

Importing graph_opt imports neither paddle nor torch.
"""
from ._layout import mount_checkout_folders

mount_checkout_folders()  # graph_opt.backends / graph_opt.benchmarks from a plain checkout

from . import testing  # noqa: E402
from .config import GraphOptConfig, load_config
from .decorator import support_graph_optimization
from .errors import CaptureError, GraphOptConfigError, GraphOptError, GraphOptInputError, GuardFailed, ReplayDivergence
from .guards import (
    capture_custom_allreduce,
    in_sot_warmup_mode,
    is_capturing,
    register_custom_allreduce,
    sot_warmup_guard,
    unregister_custom_allreduce,
)
from .replay.host_outputs import HostFuture, to_host_async
from .lifecycle import capture_model, clear_graphs, stats
from .explain import Explanation, config_of, explain
from .capture.passes import optimize_program
from .capture.split import splitting_op
from .replay.static_address import mark_static_address
from .stats import CaptureReport, Stats, TrainingStats
from .training.api import autocudagraph

from . import log  # noqa: E402

log.install()
__version__ = "0.1.0"

__all__ = [
    "GraphOptConfig",
    "load_config",
    "support_graph_optimization",
    "autocudagraph",
    "to_host_async",
    "HostFuture",
    "capture_model",
    "clear_graphs",
    "stats",
    "explain",
    "Explanation",
    "config_of",
    "Stats",
    "TrainingStats",
    "CaptureReport",
    "sot_warmup_guard",
    "in_sot_warmup_mode",
    "register_custom_allreduce",
    "unregister_custom_allreduce",
    "capture_custom_allreduce",
    "is_capturing",
    "splitting_op",
    "mark_static_address",
    "optimize_program",
    "testing",
    "GraphOptError",
    "GraphOptConfigError",
    "GraphOptInputError",
    "CaptureError",
    "ReplayDivergence",
    "GuardFailed",
]
