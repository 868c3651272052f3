"""python -m graph_opt {demo, bench, config}"""
from __future__ import annotations

import argparse
import sys


def _sizes(text: str):
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: expected a comma list of integers, e.g. 1,2,4,8") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: sizes must be positive integers")
    return sizes


def main(argv=None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="python -m graph_opt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"graph_opt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a small decoder in every mode, checked against eager")
    demo.add_argument("--framework", choices=["auto", "paddle", "torch"], default="auto",
                      help="auto runs every installed framework (default)")
    demo.add_argument("--sizes", type=_sizes, default=[1, 2, 4, 8], help="capture sizes (default 1,2,4,8)")
    demo.add_argument("--calls", type=int, default=50, help="timed calls per mode (default 50)")
    demo.add_argument("--hidden", type=int, default=64, help="the decoder's hidden size (default 64)")
    demo.add_argument("--layers", type=int, default=4, help="the decoder's layers (default 4)")

    bench = sub.add_parser("bench", help="benchmarks: the hook's overhead per call or program passes (CPU), "
                                         "graphed training steps, a decode loop's host reads, the checks before a replay, "
                                         "Hugging Face models' inference and training steps (GPU, torch), a "
                                         "tensor-parallel decode step or data-parallel training (GPUs, torch)")
    bench.add_argument("what", choices=["overhead", "passes", "training", "decode", "tp", "guards", "models", "ddp"],
                       help="which benchmark: overhead (the hook per call, CPU), passes (Paddle program passes, CPU), "
                            "training, decode, guards, models (GPU, torch), tp, ddp (two or more GPUs, torch)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")

    config = sub.add_parser("config", help="print the effective config and where each value came from")
    config.add_argument("--config", default=None, help="YAML file (else GRAPH_OPT_CONFIG, else defaults)")

    args = parser.parse_args(argv)
    if args.command == "config":
        from .config import load_config
        from .errors import GraphOptConfigError

        try:
            cfg = load_config(args.config)
        except GraphOptConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(cfg.describe())
        return 0
    if args.command == "demo":
        from .benchmarks import demo as demo_mod

        frameworks = demo_mod.available_frameworks() if args.framework == "auto" else [args.framework]
        return demo_mod.main(frameworks, args.sizes, args.calls, args.hidden, args.layers)
    if args.what == "training":
        from .benchmarks import torch_training

        return torch_training.main(args.rest, prog="python -m graph_opt bench training")
    if args.what == "decode":
        from .benchmarks import torch_decode

        return torch_decode.main(args.rest, prog="python -m graph_opt bench decode")
    if args.what == "guards":
        from .benchmarks import torch_guards

        return torch_guards.main(args.rest, prog="python -m graph_opt bench guards")
    if args.what == "models":
        from .benchmarks import torch_models

        return torch_models.main(args.rest, prog="python -m graph_opt bench models")
    if args.what == "ddp":
        from .benchmarks import torch_ddp

        return torch_ddp.main(args.rest, prog="python -m graph_opt bench ddp")
    if args.what == "tp":
        from .benchmarks import torch_tp

        return torch_tp.main(args.rest, prog="python -m graph_opt bench tp")
    if args.what == "passes":
        from .benchmarks import paddle_passes

        return paddle_passes.main(args.rest)
    from .benchmarks import paddle_overhead

    return paddle_overhead.main(args.rest)


if __name__ == "__main__":
    sys.exit(main())
