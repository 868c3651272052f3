"""The demo model for PyTorch: the same small decoder as the Paddle demo, attention a splitting op."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

import graph_opt

from .demo import MixedKey

name = "torch"


@graph_opt.splitting_op(name="demo_attention_torch")
def demo_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Attention across heads within each row: rows stay independent, so padding rows cannot leak."""
    bs, width = qkv.shape
    dh = width // (3 * heads)
    q, k, v = qkv.reshape(bs, heads, 3 * dh).chunk(3, dim=-1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(dh)
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(bs, heads * dh)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        x = x + self.proj(demo_attention(self.qkv(self.norm1(x)), self.heads))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class DemoDecoder(torch.nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 4, heads: int = 4):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


GraphDecoder = graph_opt.support_graph_optimization(type("GraphDecoder", (DemoDecoder,), {}))


# The demo's full-and-piecewise mode: every other call replays the pieces.
DispatchedDecoder = graph_opt.support_graph_optimization(type("DispatchedDecoder", (DemoDecoder,), {}),
                                                         dispatch_key_fn=MixedKey(every=2))


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build(config, hidden: int = 64, layers: int = 4, seed: int = 0, cls=None):
    """(model under graph_opt with `config`, plain reference model with the same weights). cls: a
    decorated subclass of DemoDecoder to build instead of GraphDecoder."""
    torch.manual_seed(seed)
    reference = DemoDecoder(hidden, layers).to(device()).eval()
    model = (cls or GraphDecoder)(hidden, layers, graph_opt_config=config).to(device()).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


def make_inputs(bs: int, hidden: int = 64, seed: int = None):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return {"x": torch.randn(bs, hidden, generator=generator).to(device())}


def no_grad():
    return torch.no_grad()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare(a, b):
    """(bitwise equal, max abs difference)."""
    x, y = a.detach().float().cpu().numpy(), b.detach().float().cpu().numpy()
    return bool(np.array_equal(x, y)), float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
