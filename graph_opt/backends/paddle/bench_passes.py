"""Benchmark remove_loop_carried_copies on a while loop that carries its state through copies.

    python -m graph_opt.backends.paddle.bench_passes [--mb 64] [--iters 64] [--repeats 3]

The loop carries a counter i and two float32 tensors c and h (together --mb MB), each updated
with ``paddle.assign(new, output=var)``. The same program is built twice, one copy is rewritten,
and both run in this process, alternating, on the CPU executor. Exit status 1 when the outputs
are not bit-identical.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import numpy as np
import paddle

from .passes import remove_loop_carried_copies


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
        prog="python -m graph_opt.backends.paddle.bench_passes", description=__doc__.split("\n")[0]
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

        ref_prog, ref_fetch = _build(numel, args.iters)
        opt_prog, opt_fetch = _build(numel, args.iters)
        removed = remove_loop_carried_copies(opt_prog)

        exe = paddle.static.Executor(paddle.CPUPlace())
        # The first run of each program builds its interpreter; it is checked but not timed.
        _, ref_out = _timed_run(exe, ref_prog, ref_fetch, feed)
        _, opt_out = _timed_run(exe, opt_prog, opt_fetch, feed)
        identical = all(np.array_equal(a, b) for a, b in zip(ref_out, opt_out))

        before, after = [], []
        for _ in range(args.repeats):
            t, out = _timed_run(exe, ref_prog, ref_fetch, feed)
            before.append(t)
            t, out2 = _timed_run(exe, opt_prog, opt_fetch, feed)
            after.append(t)
            identical = identical and all(np.array_equal(a, b) for a, b in zip(out, out2))
    finally:
        if was_dynamic:
            paddle.disable_static()

    t_before, t_after = statistics.median(before), statistics.median(after)
    state_mb = 2 * numel * 4 / 2**20
    rows = [
        ("loop state", f"{state_mb:.1f} MB float32 + int64 counter, {args.iters} iterations"),
        ("copies removed", f"{removed}"),
        ("copies removed per iteration", f"{removed} ({removed * args.iters} per run)"),
        (f"median before, s ({args.repeats} runs)", f"{t_before:.3f}"),
        (f"median after, s ({args.repeats} runs)", f"{t_after:.3f}"),
        ("speedup (before / after)", f"{t_before / t_after:.2f}x"),
        ("outputs bit-identical", "yes" if identical else "NO"),
    ]
    width = max(len(name) for name, _ in rows)
    print("remove_loop_carried_copies benchmark (CPU executor)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
