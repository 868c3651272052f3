"""The demo model for Paddle: a small decoder whose attention is a splitting op."""
from __future__ import annotations

import math

import numpy as np
import paddle

import graph_opt

from .demo import MixedKey

name = "paddle"


@graph_opt.splitting_op(name="demo_attention")
def demo_attention(qkv, heads: int):
    """Attention across heads within each row: rows stay independent, so padding rows cannot leak."""
    bs, width = qkv.shape[0], qkv.shape[1]
    dh = width // (3 * heads)
    q, k, v = paddle.split(qkv.reshape([bs, heads, 3 * dh]), 3, axis=-1)
    scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(dh)
    return paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), v).reshape([bs, heads * dh])


class Block(paddle.nn.Layer):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = paddle.nn.LayerNorm(hidden)
        self.qkv = paddle.nn.Linear(hidden, 3 * hidden)
        self.proj = paddle.nn.Linear(hidden, hidden)
        self.norm2 = paddle.nn.LayerNorm(hidden)
        self.up = paddle.nn.Linear(hidden, 2 * hidden)
        self.down = paddle.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        x = x + self.proj(demo_attention(self.qkv(self.norm1(x)), self.heads))
        return x + self.down(paddle.nn.functional.gelu(self.up(self.norm2(x))))


class DemoDecoder(paddle.nn.Layer):
    def __init__(self, hidden: int = 64, layers: int = 4, heads: int = 4):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(hidden, heads) for _ in range(layers)])
        self.norm = paddle.nn.LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


GraphDecoder = graph_opt.support_graph_optimization(type("GraphDecoder", (DemoDecoder,), {}))


# The demo's full-and-piecewise mode: every other call replays the pieces.
DispatchedDecoder = graph_opt.support_graph_optimization(type("DispatchedDecoder", (DemoDecoder,), {}),
                                                         dispatch_key_fn=MixedKey(every=2))


def device() -> str:
    return "gpu" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "cpu"


def build(config, hidden: int = 64, layers: int = 4, seed: int = 0, cls=None):
    """(model under graph_opt with `config`, plain reference model with the same weights). cls: a
    decorated subclass of DemoDecoder to build instead of GraphDecoder."""
    paddle.seed(seed)
    reference = DemoDecoder(hidden, layers)
    reference.eval()
    model = (cls or GraphDecoder)(hidden, layers, graph_opt_config=config)
    model.set_state_dict(reference.state_dict())
    model.eval()
    return model, reference


def make_inputs(bs: int, hidden: int = 64, seed: int = None):
    if seed is not None:
        paddle.seed(seed)
    return {"x": paddle.randn([bs, hidden])}


def no_grad():
    return paddle.no_grad()


def synchronize() -> None:
    graph_opt.backends.load("paddle").ADAPTER.synchronize()


def compare(a, b):
    """(bitwise equal, max abs difference)."""
    x, y = np.asarray(a.numpy()), np.asarray(b.numpy())
    return bool(np.array_equal(x, y)), float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))


def rows(t, n):
    return t[:n]
