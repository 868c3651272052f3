"""A model built and run FastDeploy's way: Model(fd_config), SOT warm-up and capture in the runner.

    python examples/fastdeploy_style.py [--smoke] [--graph-optimization-config '{"graph_opt_level": 1, ...}']

FastDeploy builds each model with an `fd_config` whose `graph_opt_config` (its GraphOptimizationConfig)
says how the model is optimized; a model class decorated with @support_graph_optimization reads it there.
The runner below does what FastDeploy's does: it builds the config from the command line's JSON text
(FastDeploy's --graph-optimization-config), builds the model from fd_config, and captures inside
capture_custom_allreduce() (a custom all-reduce, where there is one, records into the graphs) with
SOT's warm-up under sot_warmup_guard(True) (capture_model runs it there, and runs the sizes in
sot_warmup_sizes above the largest captured one once). The eager reference is the undecorated class.

Real CUDA graphs need a Paddle 3.2+ CUDA build (that path is written against Paddle's API but has not been
run: no Paddle GPU build was available). On a CPU build the graphs are graph_opt's host stand-in.
"""
import argparse
import contextlib
import json

import numpy as np
import paddle

import graph_opt


class FDConfig:
    """The part of FastDeploy's FDConfig a model reads here: its graph_opt_config and the model's sizes."""

    def __init__(self, graph_opt_config, hidden, layers):
        self.graph_opt_config = graph_opt_config
        self.model_config = argparse.Namespace(hidden_size=hidden, num_hidden_layers=layers)


class GraphOptimizationConfig:
    """FastDeploy's GraphOptimizationConfig: its defaults, then the args given (as FastDeploy builds it)."""

    def __init__(self, args):
        self.graph_opt_level = 0
        self.use_cudagraph = True
        self.cudagraph_capture_sizes = None
        self.cudagraph_num_of_warmups = 2
        self.cudagraph_copy_inputs = False
        self.cudagraph_splitting_ops = []
        self.full_cuda_graph = True
        self.use_unique_memory_pool = True
        self.sot_warmup_sizes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128]
        self.cudagraph_capture_sizes_prefill = [1, 2, 4, 8]  # FastDeploy's scheduler's: not needed here
        for key, value in args.items():
            if hasattr(self, key):
                setattr(self, key, value)


class DecoderStack(paddle.nn.Layer):
    """A FastDeploy-style model: everything it needs comes from fd_config."""

    def __init__(self, fd_config):
        super().__init__()
        hidden = fd_config.model_config.hidden_size
        self.blocks = paddle.nn.LayerList(
            paddle.nn.Sequential(paddle.nn.LayerNorm(hidden), paddle.nn.Linear(hidden, 2 * hidden), paddle.nn.GELU(),
                                 paddle.nn.Linear(2 * hidden, hidden))
            for _ in range(fd_config.model_config.num_hidden_layers))

    def forward(self, hidden_states):
        for block in self.blocks:
            hidden_states = hidden_states + block(hidden_states)
        return hidden_states


@graph_opt.support_graph_optimization  # patches this subclass: DecoderStack stays the eager twin
class GraphedDecoderStack(DecoderStack):
    pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few calls (the tests run it so)")
    parser.add_argument("--graph-optimization-config", default=None, metavar="JSON",
                        help="FastDeploy's JSON text (default: level 1, capture sizes 1, 2, 4, 8)")
    args = parser.parse_args()
    hidden, layers = (16, 2) if args.smoke else (256, 4)
    text = args.graph_optimization_config or json.dumps(
        {"graph_opt_level": 1, "use_cudagraph": True, "cudagraph_capture_sizes": [1, 2, 4, 8],
         "sot_warmup_sizes": [16]})
    fd_config = FDConfig(GraphOptimizationConfig(json.loads(text)), hidden, layers)

    gpu = paddle.device.cuda.graphs.is_cuda_graph_supported() if paddle.is_compiled_with_cuda() else False
    stand_in = contextlib.nullcontext() if gpu else graph_opt.testing.simulate_cuda_graphs()
    print("CUDA graphs:", "on the GPU" if gpu else "host stand-in (no Paddle CUDA build here)")
    paddle.seed(0)
    eager = DecoderStack(fd_config)
    eager.eval()
    model = GraphedDecoderStack(fd_config)  # FastDeploy's constructor: the config comes with fd_config
    model.set_state_dict(eager.state_dict())
    model.eval()
    print(graph_opt.decorator.state_of(model).config.describe())

    # FastDeploy's runner keeps the model's inputs in buffers of its own (share_inputs) and passes views of
    # them at every call, so the graphs read them in place (cudagraph_copy_inputs false, its default)
    largest = max(fd_config.graph_opt_config.sot_warmup_sizes + (fd_config.graph_opt_config.cudagraph_capture_sizes
                                                                 or [8]))
    share_inputs = paddle.zeros([largest, hidden], dtype="float32")

    def make_inputs(size):
        return (share_inputs[:size],)

    with stand_in:
        with graph_opt.capture_custom_allreduce():
            report = graph_opt.capture_model(model, make_inputs, progress=False)
        print(report)
        worst = 0.0
        with paddle.no_grad():
            for size in (1, 3, 8, 16):
                x = paddle.to_tensor(np.random.default_rng(size).standard_normal((size, hidden)).astype("float32"))
                share_inputs[:size] = x  # the runner's copy into its buffer
                worst = max(worst, float((model(share_inputs[:size]) - eager(x)).abs().max()))
        print(graph_opt.stats(model))
    ok = report.failed is None and worst <= 1e-5
    print(f"correctness: {'matched' if ok else 'MISMATCH'} (largest difference from eager {worst:.2e}, "
          "tolerance 1e-5 on the real rows)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
