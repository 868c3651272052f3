"""A tensor-parallel decoder for tests and benchmarks, and the unsharded model it must equal.

Each layer: LayerNorm; column-parallel QKV (each rank computes its heads); one decode-attention
step over a read-only KV cache (a torch.library custom op behind the splitting op "tp_attention");
row-parallel out projection, then the all-reduce; LayerNorm; column-parallel up projection, GELU,
row-parallel down projection, then the all-reduce. A final LayerNorm. One token per sequence; the
batch is the dynamic dimension, and rows never mix, so padding rows cannot leak into real ones.

    dims = TPDims(hidden=256, heads=8, layers=4)
    m = build_tp_decoder(dims, rank, world_size, comm, graph_opt_config=cfg, device="cuda")
    ref = build_reference(dims, device="cuda")   # world size 1, the same weights, no collective

Weights are drawn in float32 from generators seeded per layer, on the device the model is built for
(the same numbers on every device of a type), so every rank draws the same full tensors of a layer
and keeps its shard; the sharded model on N ranks equals the reference built on the same kind of
device up to the order of the sums. One layer's full tensors exist at a time.

The all-reduce is the `comm` given, anything with all_reduce(x) -> the sum over ranks:
- DistAllReduce: torch.distributed.all_reduce (NCCL, gloo); Dynamo traces it as a functional collective;
- BufferAllReduce / SymmMemAllReduce (symm_mem_allreduce.py): the custom all-reduce protocol;
- split_all_reduce=True routes each all-reduce through the splitting op "tp_all_reduce", so a
  piecewise config can cut the graphs there and run it eagerly between pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from graph_opt import support_graph_optimization
from graph_opt.capture.split import splitting_op


@dataclass(frozen=True)
class TPDims:
    hidden: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 2
    cache_len: int = 8  # tokens already in the KV cache
    max_batch: int = 16  # rows of the KV cache: the largest batch the model takes


class DistAllReduce:
    """torch.distributed.all_reduce over `group` (default: the world)."""

    def __init__(self, group=None):
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


_REDUCERS: Dict[int, Any] = {}  # id -> communicator, for the splitting op (it takes no objects)


@splitting_op(name="tp_all_reduce")
def tp_all_reduce(x: torch.Tensor, comm_id: int) -> torch.Tensor:
    return _REDUCERS[comm_id].all_reduce(x)


@torch.library.custom_op("graph_opt_tp::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q, k, v: [batch, heads, head_dim], the new token; caches: [max_batch, heads, cache_len, head_dim].
    Each row attends over its cache rows and its own new key/value."""
    bs = q.shape[0]
    keys = torch.cat([k_cache[:bs], k.unsqueeze(2)], dim=2)
    values = torch.cat([v_cache[:bs], v.unsqueeze(2)], dim=2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values).squeeze(2).contiguous()


@decode_attention_op.register_fake
def _(q, k, v, k_cache, v_cache):
    return q.new_empty(q.shape)


@splitting_op(name="tp_attention")
def tp_attention(q, k, v, k_cache, v_cache):
    return torch.ops.graph_opt_tp.decode_attention.default(q, k, v, k_cache, v_cache)


class ColumnParallelLinear(torch.nn.Module):
    """y = x W_r^T + b_r: this rank's block of output features, from the full weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, rank: int, world_size: int):
        super().__init__()
        rows = _shard(weight.shape[0], rank, world_size)
        self.weight = torch.nn.Parameter(weight[rows].clone())
        self.bias = torch.nn.Parameter(bias[rows].clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_r W_r^T) + b: x_r is this rank's block of input features; the bias is added
    once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, rank: int, world_size: int, reduce):
        super().__init__()
        cols = _shard(weight.shape[1], rank, world_size)
        self.weight = torch.nn.Parameter(weight[:, cols].clone())
        self.bias = torch.nn.Parameter(bias.clone())
        self.reduce = reduce  # None on one rank

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.reduce is not None:
            y = self.reduce(y)
        return y + self.bias


class TPLayer(torch.nn.Module):
    def __init__(self, w: Dict[str, torch.Tensor], dims: TPDims, rank: int, world_size: int, reduce):
        super().__init__()
        self.heads = dims.heads // world_size
        self.head_dim = dims.hidden // dims.heads
        self.ln1 = _layer_norm(w["ln1.weight"], w["ln1.bias"])
        self.qkv = ColumnParallelLinear(w["qkv.weight"], w["qkv.bias"], rank, world_size)
        self.out = RowParallelLinear(w["out.weight"], w["out.bias"], rank, world_size, reduce)
        self.ln2 = _layer_norm(w["ln2.weight"], w["ln2.bias"])
        self.up = ColumnParallelLinear(w["up.weight"], w["up.bias"], rank, world_size)
        self.down = RowParallelLinear(w["down.weight"], w["down.bias"], rank, world_size, reduce)
        heads = _shard(dims.heads, rank, world_size)
        self.register_buffer("k_cache", w["k_cache"][:, heads].clone(), persistent=False)
        self.register_buffer("v_cache", w["v_cache"][:, heads].clone(), persistent=False)

    def forward(self, x):
        bs = x.shape[0]
        qkv = self.qkv(self.ln1(x)).view(bs, self.heads, 3, self.head_dim)  # the full weight is head-major
        a = tp_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.k_cache, self.v_cache)
        x = x + self.out(a.reshape(bs, self.heads * self.head_dim))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class TPDecoder(torch.nn.Module):
    """The decoder's shard on `rank` of `world_size`, undecorated: the reference, and the base of
    GraphedTPDecoder. Build them with build_reference / build_tp_decoder."""

    def __init__(self, dims: TPDims, rank: int = 0, world_size: int = 1, comm=None, seed: int = 0,
                 split_all_reduce: bool = False, init_device="cpu"):
        super().__init__()
        if dims.heads % world_size or dims.mlp % world_size or dims.hidden % dims.heads:
            raise ValueError(f"{dims}: heads and mlp must divide by the world size {world_size}, "
                             "hidden by heads")
        if world_size > 1 and comm is None:
            raise ValueError(f"a TPDecoder on {world_size} ranks needs a comm with all_reduce(x)")
        reduce = None
        if comm is not None and split_all_reduce:
            comm_id = id(comm)
            _REDUCERS[comm_id] = comm  # held for good: the id stays this communicator's

            def reduce(x):
                return tp_all_reduce(x, comm_id)
        elif comm is not None:
            reduce = comm.all_reduce
        self.layers = torch.nn.ModuleList(
            TPLayer(layer_weights(dims, i, seed, init_device), dims, rank, world_size, reduce)
            for i in range(dims.layers))
        g = _generator(seed, dims.layers, init_device)
        self.norm = _layer_norm(1 + _rand(g, dims.hidden, scale=0.1), _rand(g, dims.hidden, scale=0.1))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


@support_graph_optimization
class GraphedTPDecoder(TPDecoder):
    """TPDecoder through graph_opt (graph_opt_config= in the constructor)."""


def layer_weights(dims: TPDims, layer: int, seed: int = 0, device="cpu") -> Dict[str, torch.Tensor]:
    """The full (unsharded) float32 tensors of one layer, the same for a seed on every device of a type.
    qkv's output features are head-major: [heads, (q, k, v), head_dim]."""
    g = _generator(seed, layer, device)
    h, m = dims.hidden, dims.mlp
    cache = (dims.max_batch, dims.heads, dims.cache_len, h // dims.heads)
    names_shapes = [
        ("ln1.weight", (h,), None), ("ln1.bias", (h,), 0.1),
        ("qkv.weight", (3 * h, h), 1 / math.sqrt(h)), ("qkv.bias", (3 * h,), 0.02),
        ("out.weight", (h, h), 1 / math.sqrt(h)), ("out.bias", (h,), 0.02),
        ("ln2.weight", (h,), None), ("ln2.bias", (h,), 0.1),
        ("up.weight", (m, h), 1 / math.sqrt(h)), ("up.bias", (m,), 0.02),
        ("down.weight", (h, m), 1 / math.sqrt(m)), ("down.bias", (h,), 0.02),
        ("k_cache", cache, 1.0), ("v_cache", cache, 1.0),
    ]
    # scale None: a norm's weight, 1 + noise
    return {name: (1 + _rand(g, *shape, scale=0.1)) if scale is None else _rand(g, *shape, scale=scale)
            for name, shape, scale in names_shapes}


def _generator(seed: int, index: int, device) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed * 1_000_003 + index)


def _rand(g: torch.Generator, *shape, scale: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=g.device) * scale


def build_tp_decoder(dims: TPDims, rank: int, world_size: int, comm, graph_opt_config=None, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device="cpu", split_all_reduce: bool = False
                     ) -> GraphedTPDecoder:
    """This rank's shard, in eval mode on `device`. graph_opt_config: a GraphOptConfig, dict or YAML path."""
    m = GraphedTPDecoder(dims, rank, world_size, comm, seed, split_all_reduce, init_device=device,
                  graph_opt_config=graph_opt_config)
    return m.to(device=device, dtype=dtype).eval()


def build_reference(dims: TPDims, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> TPDecoder:
    """The unsharded model (world size 1, no collective, no graphs) with the same weights."""
    m = TPDecoder(dims, 0, 1, None, seed, init_device=device)
    return m.to(device=device, dtype=dtype).eval()


def make_tokens(size: int, dims: TPDims, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A decode step's input: [size, hidden], the same on every rank for a seed and size."""
    g = torch.Generator().manual_seed(seed * 100003 + size)
    return torch.randn(size, dims.hidden, generator=g).to(device=device, dtype=dtype)


def _shard(n: int, rank: int, world_size: int) -> slice:
    step = n // world_size
    return slice(rank * step, (rank + 1) * step)


def _layer_norm(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(weight.shape[0])
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    return norm
