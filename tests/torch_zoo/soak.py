"""The torch model of the soak and fault suite (tests/both/test_soak_and_faults.py), and what torch brings to
it (KIT): two batch-major arguments, two splitting ops."""
import torch

import graph_opt
import soak_support
from graph_opt.backends.torch.dynamo import DynamoStrategy, graphs_compiled
from soak_support import HIDDEN, MODES, SIZES


@graph_opt.splitting_op(name="soak_torch_mix")
def soak_mix(h):
    """Attention stand-in: a splitting op (level 0 cuts the capture here; level >= 1 the FX graph)."""
    return torch.tanh(h) * 0.5 + h


@graph_opt.splitting_op(name="soak_torch_gate")
def soak_gate(h):
    """A second splitting op, where soak_kit injects its faults (soak_support.gate_fault)."""
    soak_support.gate_fault()
    return torch.sigmoid(h)


class Net(torch.nn.Module):
    """Undecorated: the eager twin. Rows stay independent, so padding rows cannot leak."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.inp = torch.nn.Linear(hidden, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.gate = torch.nn.Linear(hidden, hidden)

    def forward(self, x, g):
        a = soak_mix(self.inp(self.norm(x)))
        return x + self.proj(a) * soak_gate(self.gate(g))


GraphNet = graph_opt.support_graph_optimization(type("GraphNet", (Net,), {}))


def build(seed=0, **cfg):
    torch.manual_seed(seed)
    twin = Net().eval()
    model = GraphNet(graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=list(SIZES), **cfg)).eval()
    model.load_state_dict(twin.state_dict())
    return model, twin


def generator(seed):
    return torch.Generator().manual_seed(seed)


def make_inputs(bs, rows_g=None, rng=None):
    generator = rng or torch.Generator().manual_seed(bs)
    x = torch.randn(bs, HIDDEN, generator=generator)
    g = torch.randn(bs if rows_g is None else rows_g, HIDDEN, generator=generator)
    return x, g


def capture(model, **kwargs):
    return graph_opt.capture_model(model, make_inputs, progress=False, **kwargs)


def diff(out, want) -> float:
    """Largest |out - want|; inf when the shapes differ, 0 for empty outputs of the same shape."""
    if out.shape != want.shape:
        return float("inf")
    return float((out - want).abs().max()) if out.numel() else 0.0


def leftover_state(model):
    from graph_opt.backends.torch.pieces import Mode

    strategy = model._graph_opt_state.runner.strategy
    return {"graph_state": isinstance(strategy, DynamoStrategy) and strategy.state.mode is not Mode.EAGER}


# Bitwise equal to the twin where the path runs eager's kernels on the same rows: levels 0 and 1 (the
# FX graph runs the same aten ops) at captured sizes and above the max. Inductor's kernels (level 2,
# slow to compile on CPU, fast to call: it gets its full share of the soak) and padded sizes: within
# ROW_TOLERANCE.
BITWISE = frozenset((name, kind) for name in MODES for kind in ("captured", "above max") if not name.startswith("L2"))


# Without graphs, levels 1-2 run torch.compile as it is: a call whose batch dims disagree fails inside
# Dynamo's trace, is traced again on every such call (failures are not cached), and each failed trace
# keeps its ShapeEnv alive in a functools.lru_cache of torch: measured with a bare torch.compile of Net,
# 280 KiB and 200 ms per failing call. That is torch's, not the plugin's, and would swamp the RSS
# measurement, so those calls are not in the soak: test_a_static_call_whose_batch_dims_disagree_...
# below checks their error.
RETRACING = frozenset(name for name, cfg in MODES.items() if cfg["graph_opt_level"] >= 1 and not cfg["use_cudagraph"])


KIT = soak_support.SoakKit(
    name="torch", build=build, capture=capture, rng=generator, make_inputs=make_inputs,
    read=lambda out: out.clone(), diff=diff, equal=torch.equal, no_grad=torch.no_grad,
    strategy=DynamoStrategy, translation=(DynamoStrategy, "_backend", "injected failure in the Dynamo backend"),
    leftover_state=leftover_state, compile_count=graphs_compiled,
    recompile_message="Dynamo compiled again after warm-up",
    eager_error=RuntimeError, eager_error_match="must match the size", bitwise=BITWISE,
    busy_mode="L1-graphs-piecewise", no_mismatch=RETRACING,
)
