"""Small Paddle models the Paddle tests share. Imported only after pytest.importorskip("paddle")."""
import numpy as np
import paddle

import graph_opt
from graph_opt.benchmarks.paddle_demo import DemoDecoder, demo_attention  # noqa: F401

HIDDEN = 16
SIZES = [1, 2, 4, 8]


def config(**overrides):
    base = dict(cudagraph_capture_sizes=list(SIZES), program_passes=[])
    base.update(overrides)
    return graph_opt.GraphOptConfig(**base)


def decoder(cfg, hidden=HIDDEN, layers=2, seed=0):
    """(graph-optimized decoder, plain eager decoder with the same weights)."""
    from graph_opt.benchmarks.paddle_demo import build

    return build(cfg, hidden=hidden, layers=layers, seed=seed)


def inputs(bs, hidden=HIDDEN, seed=None):
    if seed is not None:
        paddle.seed(seed)
    return paddle.randn([bs, hidden])


def same(a, b) -> bool:
    return bool(np.array_equal(a.numpy(), b.numpy()))


def max_diff(a, b) -> float:
    return float(np.max(np.abs(a.numpy().astype(np.float64) - b.numpy().astype(np.float64))))


def capture(model, hidden=HIDDEN, **kwargs):
    return graph_opt.capture_model(model, lambda bs: {"x": inputs(bs, hidden)}, progress=False, **kwargs)
