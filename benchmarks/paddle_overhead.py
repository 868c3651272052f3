"""python -m graph_opt bench: the plugin's cost per call on Paddle's static path, on CPU.

Compares, in one run and at one batch size:
- bare:      paddle.jit.to_static(model, full_graph=False), SOT with its guards;
- static:    the plugin at level 1 without graphs (its SOT path, hook installed);
- replay:    the plugin at level 1 with (simulated) graphs: dispatch, pad, copy, replay;
- raw:       the captured subgraphs replayed directly, no plugin around them.
Overhead per call is reported against bare to_static and against raw replay, as medians over
interleaved rounds, plus the SOT translations that happened after capture (the goal is 0).
"""
from __future__ import annotations

import argparse
import statistics
import time

import paddle

import graph_opt
from graph_opt.benchmarks import paddle_demo as kit
from graph_opt.backends.paddle.sot import translate_count


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graph_opt bench overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="rows per call (default 8)")
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (default 2)")
    parser.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    args = parser.parse_args(argv)

    sizes = sorted({1, 2, 4, 8, args.batch})
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        plugin, reference = kit.build(graph_opt.GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=sizes),
                                      hidden=args.hidden, layers=args.layers)
        static, _ = kit.build(graph_opt.GraphOptConfig(graph_opt_level=1, use_cudagraph=False),
                              hidden=args.hidden, layers=args.layers)
        bare = paddle.jit.to_static(reference, full_graph=False)
        graph_opt.capture_model(plugin, lambda bs: kit.make_inputs(bs, args.hidden), progress=False)
        x = kit.make_inputs(args.batch, args.hidden, seed=1)["x"]
        entry = plugin._graph_opt_state.runner.signatures
        entry = next(iter(entry.values())).entries[args.batch]
        raw = entry.captured.replay
        for fn in (lambda: bare(x), lambda: static(x), lambda: plugin(x), raw):
            for _ in range(20):
                fn()
        samples = {"bare": [], "static": [], "replay": [], "raw": []}
        for _ in range(args.rounds):
            samples["bare"].append(_per_call_us(lambda: bare(x), args.calls))
            samples["static"].append(_per_call_us(lambda: static(x), args.calls))
            samples["replay"].append(_per_call_us(lambda: plugin(x), args.calls))
            samples["raw"].append(_per_call_us(raw, args.calls))
        before = translate_count()
        for n in range(1, max(sizes) + 1):
            plugin(kit.make_inputs(n, args.hidden)["x"])
        after_capture = translate_count() - before
        same = bool((plugin(x) == reference(x)).all())

    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"Paddle {paddle.__version__} on CPU, decoder hidden={args.hidden} layers={args.layers}, batch {args.batch}, "
          f"medians of {args.rounds} rounds x {args.calls} calls (graphs simulated on the host)")
    print(f"{'path':<34} {'us/call':>9} {'vs bare':>8}")
    for key, label in (("bare", "bare to_static (SOT)"), ("static", "plugin level 1, no graphs"),
                       ("replay", "plugin level 1, replay"), ("raw", "raw replay (no plugin)")):
        print(f"{label:<34} {med[key]:>9.1f} {med[key] / med['bare']:>7.2f}x")
    overhead_bare = med["replay"] - med["bare"]
    overhead_raw = med["replay"] - med["raw"]
    print(f"plugin replay overhead vs bare to_static: {overhead_bare:+.1f} us/call ({med['replay'] / med['bare']:.2f}x)")
    print(f"plugin replay overhead vs raw replay:     {overhead_raw:+.1f} us/call")
    print(f"plugin static-path overhead vs bare:      {med['static'] - med['bare']:+.1f} us/call")
    print(f"SOT translations after capture (sizes 1..{max(sizes)}): {after_capture}")
    print(f"replayed output equals eager: {same}")
    ok = overhead_bare <= 20.0 and after_capture == 0 and same
    print("goal (<= 20 us over bare to_static, 0 translations):", "met" if ok else "MISSED")
    return 0 if after_capture == 0 and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
