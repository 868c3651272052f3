"""A Paddle model through SOT (graph_opt_level 1) with CUDA graphs, configured by YAML, code and environment.

    python examples/paddle_sot_level1.py [--smoke]
    GRAPH_OPT_CAPTURE_SIZES=1,2,4,8,16 python examples/paddle_sot_level1.py

The config comes from examples/paddle_level1.yaml, then a keyword argument in code, then GRAPH_OPT_*
variables (this script sets GRAPH_OPT_CAPTURE_SIZES unless the shell did): each layer overrides the one
before, and the effective config is printed with where each value came from. SOT translates the forward
once, during capture (symbolic in the batch dimension: one program serves every size); calls after capture
translate nothing. The eager reference is the undecorated class with the same weights.

Real CUDA graphs need a Paddle 3.2+ CUDA build (that path is written against Paddle's API but has not been
run: no Paddle GPU build was available). On a CPU build the graphs are graph_opt's host stand-in: the check
is real, the timing shows the plugin's overhead, not a speed-up.
"""
import argparse
import contextlib
import os
import statistics
import time

import numpy as np
import paddle

import graph_opt

YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddle_level1.yaml")


class MLP(paddle.nn.Layer):
    def __init__(self, hidden, layers):
        super().__init__()
        self.blocks = paddle.nn.LayerList(
            paddle.nn.Sequential(paddle.nn.LayerNorm(hidden), paddle.nn.Linear(hidden, 4 * hidden), paddle.nn.GELU(),
                                 paddle.nn.Linear(4 * hidden, hidden)) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@graph_opt.support_graph_optimization  # patches this subclass: MLP stays the eager twin
class GraphedMLP(MLP):
    pass


def median_ms(fn, calls, gpu):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        if gpu:
            paddle.device.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiniest model, fewest calls (CI)")
    smoke = parser.parse_args().smoke
    gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    hidden, layers, calls = (16, 1, 3) if smoke else (256, 4, 30) if gpu else (64, 2, 30)
    os.environ.setdefault("GRAPH_OPT_CAPTURE_SIZES", "1,2,4" if smoke else "1,2,4,8")  # as a deployment would
    # the YAML file, then code (a keyword argument), then GRAPH_OPT_* variables: each wins over the one before
    config = graph_opt.load_config(os.path.relpath(YAML), cudagraph_num_of_warmups=2)
    print("effective config (value, then where it came from):\n" + config.describe())
    print(f"device {'gpu' if gpu else 'cpu'}" + ("" if gpu else ": no CUDA build, graphs simulated on the host"))
    paddle.seed(0)
    eager = MLP(hidden, layers)
    m = GraphedMLP(hidden, layers, graph_opt_config=config)
    m.set_state_dict(eager.state_dict())
    eager.eval()
    m.eval()

    sizes = config.capture_sizes
    simulated = contextlib.nullcontext() if gpu else graph_opt.testing.simulate_cuda_graphs()
    with simulated, paddle.no_grad():
        print(graph_opt.capture_model(m, make_inputs=lambda n: {"x": paddle.randn([n, hidden])}, progress=False))
        worst, batches = 0.0, sorted({1, 3, sizes[-1]})  # 3 is padded to 4
        for n in batches:
            x = paddle.randn([n, hidden])
            worst = max(worst, float(np.abs(m(x).numpy() - eager(x).numpy()).max()))
        ok = worst <= 1e-5
        print(f"correctness: {'matched' if ok else 'MISMATCH against'} eager at batches {batches} "
              f"(max diff {worst:.1e}, tolerance 1e-05)")
        x = paddle.randn([sizes[-1], hidden])
        t_eager, t_graph = median_ms(lambda: eager(x), calls, gpu), median_ms(lambda: m(x), calls, gpu)
        print(f"batch {sizes[-1]}: eager {t_eager:.2f} ms, graph_opt {t_graph:.2f} ms per call "
              f"({t_eager / t_graph:.2f}x)")
    s = graph_opt.stats(m)
    print(f"stats: mode={s.mode!r} captured_sizes={s.captured_sizes} translations={s.translations} "
          f"replays={s.replays} fallbacks={s.fallbacks} {dict(s.fallback_reasons)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
