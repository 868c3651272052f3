"""Paddle ranks on CPU (gloo, paddle.distributed.spawn; two by default, run_ranks(world=4) for four), for the
rank agreement of graph_opt.capture.ranks, and autocudagraph inside paddle.DataParallel.

The model all-reduces in its forward, so ranks that captured different graphs would mismatch their
collectives. Every rank runs every scenario in order; each returns a dict or fails with its
traceback. Results are written after every scenario; the parent kills both ranks at a deadline.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
import traceback

from rank_harness import read_rank_results, record_captures

WORLD = 2  # the default world size
SIZES = [1, 2, 4, 8]
REALS = [1, 3, 5, 8]
HIDDEN = 8


def _model(sizes=SIZES):
    import paddle
    import paddle.distributed as dist

    import graph_opt

    @graph_opt.support_graph_optimization
    class Reduced(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.proj = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            y = self.proj(x)
            dist.all_reduce(y)
            return y

    paddle.seed(0)  # the same weights on every rank: the sum is the world size times one rank's projection
    return Reduced(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=sizes))


def _x(n, seed=0):
    import numpy as np
    import paddle

    return paddle.to_tensor(np.random.default_rng(seed * 1000 + n).standard_normal((n, HIDDEN)).astype("float32"))


def _compare(m):
    import numpy as np
    import paddle
    import paddle.distributed as dist

    world = dist.get_world_size()
    with paddle.no_grad():
        for real in REALS:
            x = _x(real, seed=7)
            np.testing.assert_allclose(m(x).numpy(), world * m.proj(x).numpy(), rtol=1e-5, atol=1e-5)


def scenario_capture(rank, warnings):
    import paddle.distributed as dist

    import graph_opt

    m = _model()
    order = record_captures(m, rank=rank)
    report = graph_opt.capture_model(m, _x, progress=False)
    assert report.failed is None and (report.rank, report.world_size) == (rank, dist.get_world_size()), report
    _compare(m)
    s = graph_opt.stats(m)
    assert s.replays == len(REALS) and s.fallbacks == 0, s
    return {"order": order}


def scenario_size_mismatch(rank, warnings):
    import graph_opt

    try:
        graph_opt.capture_model(_model(), _x, sizes=SIZES if rank == 0 else SIZES[:-1], progress=False)
    except graph_opt.GraphOptConfigError as exc:
        return {"error": str(exc)}
    raise AssertionError("capture_model with other sizes than the peer's did not raise")


def scenario_capture_fault(rank, warnings):
    import graph_opt

    m = _model()
    record_captures(m, fail_on_rank=1, fail_at=4, rank=rank)
    before = len(warnings)
    report = graph_opt.capture_model(m, _x, progress=False)
    new = warnings[before:]
    _compare(m)
    s = graph_opt.stats(m)
    assert s.captured_sizes == [] and s.fallbacks == len(REALS), s
    return {"failed": report.failed, "warnings": new}


def scenario_lazy(rank, warnings):
    import graph_opt

    m = _model()
    order = record_captures(m, fail_on_rank=1, fail_at=2, rank=rank)
    graph_opt.capture_model(m, _x, sizes=[8], progress=False)
    import paddle

    with paddle.no_grad():
        m(_x(3))  # padded to 4: captured now, on both ranks
        lazy = graph_opt.stats(m)
        before = len(warnings)
        m(_x(2))  # size 2 fails on rank 1
    new = warnings[before:]
    _compare(m)
    s = graph_opt.stats(m)
    assert lazy.lazy_captures == 1 and lazy.captured_sizes == [4, 8], lazy
    assert s.captured_sizes == [], s
    return {"order": order, "warnings": new}


def scenario_replay_agreement(rank, warnings):
    """Rank 1's model changes training mode after capture: every rank runs those calls without graphs."""
    import graph_opt

    m = _model()
    graph_opt.capture_model(m, _x, progress=False)
    if rank == 1:
        m.eval()  # captured in training mode (a Layer's default)
    before = len(warnings)
    _compare(m)
    disagreed = graph_opt.stats(m)
    new = warnings[before:]
    if rank == 1:
        m.train()
    _compare(m)
    agreed = graph_opt.stats(m)
    return {"replays": disagreed.replays, "reasons": disagreed.fallback_reasons, "warnings": new,
            "replays_after": agreed.replays - disagreed.replays}


def scenario_data_parallel(rank, warnings):
    """graph_opt.autocudagraph(paddle.DataParallel(block)) beside an eager DataParallel twin, 4 SGD steps
    on this rank's own data, the last over two micro-batches (the first under no_sync): the parameters of
    both, for the parent to compare with each other and across ranks."""
    import numpy as np
    import paddle

    import graph_opt

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.up = paddle.nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = paddle.nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x):
            return x + self.down(paddle.nn.functional.gelu(self.up(x)))

    paddle.seed(0)
    ref, twin = Block(), Block()
    twin.set_state_dict(ref.state_dict())
    models = {"eager": paddle.DataParallel(ref), "graphed": paddle.DataParallel(twin)}
    graph_opt.autocudagraph(models["graphed"], warmup_steps=0)
    params = {}
    for name, model in models.items():
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        for step in range(4):
            micro = 2 if step == 3 else 1
            for k in range(micro):
                x = paddle.to_tensor(np.random.default_rng(100 * rank + 10 * step + k)
                                     .standard_normal((4, 6, HIDDEN)).astype("float32"))
                if k < micro - 1:
                    with model.no_sync():
                        (model(x) ** 2).mean().backward()
                else:
                    (model(x) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
        params[name] = [p.numpy().copy() for p in model.parameters()]
    s = graph_opt.stats(models["graphed"])
    return {"params": params, "replays": s.replays, "backward_replays": s.backward_replays, "fallbacks": s.fallbacks,
            "warnings": list(warnings)}


SCENARIOS = {
    "capture": scenario_capture,
    "replay_agreement": scenario_replay_agreement,
    "size_mismatch": scenario_size_mismatch,
    "capture_fault": scenario_capture_fault,
    "lazy": scenario_lazy,
    "data_parallel": scenario_data_parallel,
}


class _Warnings(logging.Handler):
    def __init__(self, sink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record):
        self.sink.append(record.getMessage())


def rank_main(folder: str) -> None:
    """The function paddle.distributed.spawn runs on each rank."""
    results = {}
    rank = -1
    try:
        import paddle.distributed as dist

        import graph_opt

        dist.init_parallel_env()
        rank = dist.get_rank()
        warnings = []
        logging.getLogger("graph_opt").addHandler(_Warnings(warnings))
        with graph_opt.testing.simulate_cuda_graphs():
            for name, scenario in SCENARIOS.items():
                start = time.perf_counter()
                try:
                    results[name] = {"ok": True, **scenario(rank, warnings)}
                except BaseException:  # noqa: BLE001 - reported to the parent
                    results[name] = {"ok": False, "error": traceback.format_exc()}
                results[name]["seconds"] = time.perf_counter() - start
                _write(folder, rank, results)
                dist.barrier()
    except BaseException:  # noqa: BLE001
        results["<setup>"] = {"ok": False, "error": traceback.format_exc()}
        _write(folder, rank, results)
        os._exit(1)
    os._exit(0)  # no teardown: nothing is left to flush, and it can hang


def _write(folder, rank, results):
    path = os.path.join(folder, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(path + ".tmp", path)


def run_ranks(folder: str, deadline_s: float, world: int = WORLD):
    """{scenario: [rank 0's result, rank 1's, ...]}; AssertionError when a rank hangs past deadline_s
    (all are killed) or fails outside the scenarios."""
    import paddle.distributed as dist

    context = dist.spawn(rank_main, args=(folder,), nprocs=world, join=False, backend="gloo")
    start = time.monotonic()
    hung = False
    try:
        while True:
            left = deadline_s - (time.monotonic() - start)
            if left <= 0:
                hung = True
                break
            try:
                if context.join(timeout=left):
                    break
            except Exception:  # noqa: BLE001 - a rank exited non-zero: its results file says why
                break
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
    results = read_rank_results(folder, world)
    if hung:
        raise AssertionError(f"a rank was still running after {deadline_s:.0f} s (a hang), killed; finished: "
                             f"{[sorted(r) for r in results]}")
    for rank, res in enumerate(results):
        if "<setup>" in res or not res:
            raise AssertionError(f"rank {rank} failed outside the scenarios:\n"
                                 f"{res.get('<setup>', {}).get('error', 'no results written')}")
    return {name: [res.get(name, {"ok": False, "error": "not run"}) for res in results] for name in SCENARIOS}
