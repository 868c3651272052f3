"""The Paddle model of the soak and fault suite (tests/both/test_soak_and_faults.py), and what Paddle brings
to it (KIT): two batch-major arguments, two splitting ops."""
import numpy as np
import paddle

import graph_opt
import soak_support
from graph_opt.backends.paddle import sot
from graph_opt.benchmarks.paddle_demo import demo_attention
from soak_support import HIDDEN, MODES, SIZES


@graph_opt.splitting_op(name="soak_paddle_gate")
def soak_gate(h):
    """A second splitting op, where soak_kit injects its faults (soak_support.gate_fault)."""
    soak_support.gate_fault()
    return paddle.nn.functional.sigmoid(h)


class Net(paddle.nn.Layer):
    """Undecorated: the eager twin. Rows stay independent, so padding rows cannot leak."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(hidden)
        self.qkv = paddle.nn.Linear(hidden, 3 * hidden)
        self.proj = paddle.nn.Linear(hidden, hidden)
        self.gate = paddle.nn.Linear(hidden, hidden)

    def forward(self, x, g):
        a = demo_attention(self.qkv(self.norm(x)), 2)
        return x + self.proj(a) * soak_gate(self.gate(g))


GraphNet = graph_opt.support_graph_optimization(type("GraphNet", (Net,), {}))


def build(seed=0, **cfg):
    paddle.seed(seed)
    twin = Net()
    twin.eval()
    model = GraphNet(graph_opt_config=graph_opt.GraphOptConfig(
        cudagraph_capture_sizes=list(SIZES), program_passes=[], **cfg))
    model.set_state_dict(twin.state_dict())
    model.eval()
    return model, twin


def make_inputs(bs, rows_g=None, rng=None):
    rng = rng or np.random.default_rng(bs)
    x = rng.standard_normal((bs, HIDDEN), dtype=np.float32)
    g = rng.standard_normal((bs if rows_g is None else rows_g, HIDDEN), dtype=np.float32)
    return paddle.to_tensor(x), paddle.to_tensor(g)


def capture(model, **kwargs):
    return graph_opt.capture_model(model, lambda bs: dict(zip("xg", make_inputs(bs))), progress=False, **kwargs)


def diff(out, want) -> float:
    """Largest |out - want|; inf when the shapes differ, 0 for empty outputs of the same shape."""
    if out.shape != want.shape:
        return float("inf")
    return float(np.abs(out - want).max()) if out.size else 0.0


def leftover_state(model=None):
    from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

    return {
        "run_impl_hook": PartialProgramLayer.HOOKED_RUN_IMPL is not None,
        "eval_frame": paddle.framework.core.set_eval_frame(None) is not None,
    }


# Part of the soak's RSS growth is Paddle's own: its SOT (paddle.jit.sot.symbolic_translate, what
# to_static(full_graph=False) runs) keeps one small Python memory block per frame it runs translated
# code for, about 90 bytes of RSS with the C++ side (bare SOT, no plugin: +1 block per call of this Net,
# +3 per call of a function with two graph breaks, +1.8 MiB per 20,000 calls). So Python's allocated
# blocks may grow by one per SOT frame run and by at most BLOCK_GROWTH_BOUND more: a leak of one object
# per call anywhere else adds 9,000. (Before the fix in sot.py, the static path also leaked one
# eval-frame closure per call: about 450 bytes and 4 objects.)
# SOT frames one call runs at level >= 1: the forward, plus, with piecewise graphs, the two resume
# functions after the graph breaks at the splitting ops (without graphs nothing splits).
SOT_FRAMES = {name: 0 if cfg["graph_opt_level"] == 0 else 3 if cfg["use_cudagraph"] and not cfg["full_cuda_graph"]
              else 1 for name, cfg in MODES.items()}


# Where a call's path runs the same kernels as the twin on the same rows, it must be bitwise equal:
# level 0 (the eager forward, replayed or not) at captured sizes and above the max (no padding); and,
# as measured on this build, the piecewise graphs of levels 1-2, whose SOT programs hold only the
# linear and norm layers (the attention and the gate run eagerly between them). A whole-forward SOT
# program may run other kernels than dygraph (last-bit differences, up to 5e-7 here), and a padded
# size multiplies more rows: those are checked within ROW_TOLERANCE. (Level 2 is level 1 on this CPU
# build: no CINN.)
BITWISE = frozenset((name, kind) for name in MODES for kind in ("captured", "above max")
                    if name.startswith("L0") or name.endswith("graphs-piecewise") and "nographs" not in name)


KIT = soak_support.SoakKit(
    name="paddle", build=build, capture=capture, rng=np.random.default_rng, make_inputs=make_inputs,
    read=lambda out: out.numpy(), diff=diff, equal=np.array_equal, no_grad=paddle.no_grad,
    strategy=sot.SotStrategy, translation=(sot, "eval_frame_callback", "injected failure in SOT's translation"),
    leftover_state=leftover_state, compile_count=sot.translate_count,
    recompile_message="SOT translated again after warm-up",
    eager_error=ValueError, eager_error_match="Broadcast dimension mismatch", bitwise=BITWISE,
    busy_mode="L1-graphs-full", frames_per_call=SOT_FRAMES,
)
