"""Small torch models shared by the CPU tests: row-independent, so padding rows never leak into real rows."""
import contextlib

import torch

import graph_opt

HIDDEN = 16
SIZES = [1, 2, 4, 8]


@torch.library.custom_op("graph_opt_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Attention stand-in that reads host metadata: each row scaled by its sequence length (a CPU tensor)."""
    scale = torch.tensor([float(n) for n in lens.tolist()], dtype=x.dtype, device=x.device)
    return x * scale.unsqueeze(1)


@row_scale.register_fake
def _(x, lens):
    return torch.empty_like(x)


@graph_opt.splitting_op(name="scale_rows")
def scale_rows(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The custom op behind a Python splitting op, so that level 0 can cut there too."""
    return torch.ops.graph_opt_test.row_scale(x, lens)


@graph_opt.splitting_op(name="test_mix")
def mix(x: torch.Tensor) -> torch.Tensor:
    """A Python splitting op: level 0 cuts the eager capture here; level >= 1 puts it in the graph as one node."""
    return torch.tanh(x) * 0.5 + x


class Layer(torch.nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = mix(self.proj(self.norm(x)))
        return x + self.out(torch.relu(h))


@graph_opt.support_graph_optimization
class Stack(torch.nn.Module):
    """Two layers; each calls the Python splitting op `mix`."""

    def __init__(self, hidden=HIDDEN, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@graph_opt.support_graph_optimization(dynamic_arg_dims={"x": 0, "lens": 0})
class HostMeta(torch.nn.Module):
    """Calls a torch.library custom op (through a splitting op) that reads a host tensor of sequence lengths."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x, lens):
        h = scale_rows(self.inp(x), lens)
        return self.out(h)


class FakeComm:
    """A custom all-reduce with the vLLM/FastDeploy protocol: capture() is a context manager.

    The reduction takes one path while graphs are captured (x * 2, the "registered buffer" kernel)
    and another otherwise (x * 3, the "NCCL" kernel), so a test can see which one a replay ran.
    """

    def __init__(self):
        self.captures_entered = 0

    @contextlib.contextmanager
    def capture(self):
        self.captures_entered += 1
        yield

    def all_reduce(self, x):
        if graph_opt.is_capturing():
            return x * 2
        return x * 3


COMM = FakeComm()


@graph_opt.support_graph_optimization
class Reduced(torch.nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return COMM.all_reduce(self.proj(x))


def padded(x, sizes=SIZES, value=0):
    """x as the replay of a call of its rows runs it: rows of `value` (the pad value: 0 unless pad_values
    says) appended up to the smallest captured size that holds it. A replay's real rows equal eager on this
    bitwise; eager on x alone may round otherwise (BLAS blocks a product of 3 rows otherwise than one of 4)."""
    size = min(s for s in sizes if s >= x.shape[0])
    return torch.cat([x, x.new_full((size - x.shape[0], *x.shape[1:]), value)])


def make_x(size, hidden=HIDDEN, seed=0):
    g = torch.Generator().manual_seed(seed + size)
    return torch.randn(size, hidden, generator=g)


def make_lens(size, seed=0):
    return torch.arange(1, size + 1, dtype=torch.int64) + seed
