"""Benchmark the program passes on a while loop that carries its state through copies.

    python -m graph_opt bench passes [--mb 64] [--iters 64] [--repeats 3]

The loop carries a counter i and two float32 tensors c and h (together --mb MB), each updated
with ``paddle.assign(new, output=var)``. The same program is built three times: as written, after
the safety pass alone (protect_inplace_writes, which copies each operand the loop writes, since any
of them may be fetched), and after both default passes. All three run in this process,
alternating, on the CPU executor. Exit status 1 when the outputs are not bit-identical.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import paddle

from graph_opt.backends.paddle.passes import run_passes


def _build(numel: int, iters: int):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        c = paddle.static.data("c", [numel], "float32")
        h = paddle.static.data("h", [numel], "float32")
        n = paddle.full([1], iters, "int64")

        def cond(i, c, h):
            return i < n

        def body(i, c, h):
            return [
                paddle.assign(i + 1, output=i),
                paddle.assign(c * 1.0001 + 0.5, output=c),
                paddle.assign(paddle.tanh(h), output=h),
            ]

        out = paddle.static.nn.while_loop(cond, body, [paddle.full([1], 0, "int64"), c, h])
    return main, list(out)


def _timed_run(exe, program, fetch, feed) -> tuple:
    start = time.perf_counter()
    out = exe.run(program, feed=feed, fetch_list=fetch)
    return time.perf_counter() - start, out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graph_opt bench passes", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--mb", type=float, default=64.0, help="MB of float32 state in c and h (default 64)")
    parser.add_argument("--iters", type=int, default=64, help="loop iterations (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each program (default 3)")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.iters < 1 or args.repeats < 1:
        parser.error("--mb must be > 0, --iters and --repeats >= 1")

    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        numel = max(1, int(args.mb * 2**20 / 4 / 2))
        rng = np.random.default_rng(0)
        feed = {name: rng.standard_normal(numel, dtype=np.float32) for name in ("c", "h")}

        variants = {"as written": [], "safety pass": ["protect_inplace_writes"],
                    "both passes": ["protect_inplace_writes", "remove_loop_carried_copies"]}
        built, done = {}, {}
        for name, passes in variants.items():
            built[name] = _build(numel, args.iters)
            done[name] = run_passes(built[name][0], passes)

        exe = paddle.static.Executor(paddle.CPUPlace())
        # The first run of each program builds its interpreter; it is checked but not timed.
        first = {name: _timed_run(exe, prog, fetch, feed)[1] for name, (prog, fetch) in built.items()}
        reference = first["as written"]
        identical = all(_same(out, reference) for out in first.values())
        times: Dict[str, List[float]] = {name: [] for name in built}
        for _ in range(args.repeats):
            for name, (prog, fetch) in built.items():
                t, out = _timed_run(exe, prog, fetch, feed)
                times[name].append(t)
                identical = identical and _same(out, reference)
    finally:
        if was_dynamic:
            paddle.disable_static()

    state_mb = 2 * numel * 4 / 2**20
    base = statistics.median(times["as written"])
    print(f"program passes on a while loop: {state_mb:.1f} MB float32 state + int64 counter, "
          f"{args.iters} iterations, CPU executor, median of {args.repeats} runs")
    print(f"  {'program':<12} {'copies inserted':>15} {'copies removed':>14} {'median s':>9} {'vs as written':>13}")
    for name in built:
        t = statistics.median(times[name])
        print(f"  {name:<12} {done[name].copies_inserted:>15} {done[name].copies_removed:>14} "
              f"{t:>9.3f} {base / t:>12.2f}x")
    print(f"  outputs bit-identical: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def _same(out, reference) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(out, reference))


if __name__ == "__main__":
    sys.exit(main())
