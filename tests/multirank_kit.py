"""Tensor-parallel scenarios on 2 or 4 ranks (any world size that divides the heads), each rank in a
process of its own.

On CPU (tests/multirank): gloo, simulated graphs, and BufferAllReduce as the custom all-reduce (its
registered path is a gloo all_reduce into a preallocated buffer). On GPUs (tests/gpu): NCCL, real CUDA
graphs, and SymmMemAllReduce (symmetric memory, one_shot_all_reduce).

run_ranks() starts every rank once and runs every scenario in order in each; a scenario returns a
dict (what the parent compares across ranks) or fails with an assertion, recorded with its
traceback. The whole run has a hard deadline: a rank still running then is killed and the run
fails, naming it. Ranks write their results after every scenario, so a hang still shows which
scenarios finished.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

from rank_harness import read_rank_results, record_captures

WORLD = 2  # the default world size; run_ranks(world=4) for four
SIZES = [1, 2, 4, 8]
REALS = [1, 3, 5, 8]  # 3 and 5 are padded to 4 and 8
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32; the sharded sums add in another order than the reference's


def dims():
    from graph_opt.benchmarks.tp_model import TPDims

    return TPDims(hidden=32, heads=4, mlp=64, layers=2, cache_len=4, max_batch=8)


# -- modes: (level, full graph, splitting ops, communicator, all-reduce as a splitting op) -----------
@dataclass(frozen=True)
class Mode:
    level: int
    full: bool
    comm: str  # "custom": BufferAllReduce / SymmMemAllReduce, registered; "dist": torch.distributed.all_reduce
    splitting_ops: Optional[tuple] = None
    split_all_reduce: bool = False
    graphs: int = 1  # graphs per size


LAYERS = 2
MODES = {
    "level0-full-custom": Mode(0, True, "custom"),
    "level0-full-dist": Mode(0, True, "dist"),
    # all-reduce inside the pieces, cut at attention only
    "level0-piecewise-custom": Mode(0, False, "custom", ("tp_attention",), graphs=LAYERS + 1),
    # every splitting op: attention and the all-reduce, which then runs eagerly between pieces
    "level0-piecewise-split-allreduce": Mode(0, False, "custom", None, True, graphs=3 * LAYERS + 1),
    "level1-full-custom": Mode(1, True, "custom"),
    "level1-full-dist": Mode(1, True, "dist"),
    "level1-piecewise-custom": Mode(1, False, "custom", ("tp_attention",), graphs=LAYERS + 1),
    "level1-piecewise-split-allreduce": Mode(1, False, "custom", ("tp_attention", "tp_all_reduce"), True,
                                             graphs=3 * LAYERS + 1),
    "level2-full-custom": Mode(2, True, "custom"),
    "level2-piecewise-custom": Mode(2, False, "custom", ("tp_attention",), graphs=LAYERS + 1),
}


@dataclass
class Rank:
    """What a scenario gets: this rank, its device, its communicators and the graph_opt warnings."""

    rank: int
    world: int
    device: torch.device
    real_graphs: bool
    dist_comm: object
    custom: object = None  # BufferAllReduce (CPU) or SymmMemAllReduce (GPUs), one per process
    warnings: List[str] = field(default_factory=list)

    def tokens(self, n: int, seed: int = 0):
        from graph_opt.benchmarks.tp_model import make_tokens

        return make_tokens(n, dims(), seed=seed, device=self.device)

    def reference(self):
        from graph_opt.benchmarks.tp_model import build_reference

        return build_reference(dims(), device=self.device)

    def new_custom(self):
        """A custom all-reduce of its own (a collective: every rank makes one at the same point)."""
        from graph_opt.backends.torch.symm_mem_allreduce import BufferAllReduce, SymmMemAllReduce

        kind = SymmMemAllReduce if self.real_graphs else BufferAllReduce
        return kind(max_bytes=1 << 20, dtype=torch.float32, device=self.device)

    def model(self, mode: Mode, sizes=SIZES, comm=None):
        import graph_opt
        from graph_opt.benchmarks.tp_model import build_tp_decoder

        cfg = graph_opt.GraphOptConfig(graph_opt_level=mode.level, full_cuda_graph=mode.full,
                                       cudagraph_splitting_ops=list(mode.splitting_ops) if mode.splitting_ops else None,
                                       cudagraph_capture_sizes=sizes)
        if comm is None:
            comm = self.custom if mode.comm == "custom" else self.dist_comm
        return build_tp_decoder(dims(), self.rank, self.world, comm, cfg, device=self.device,
                                split_all_reduce=mode.split_all_reduce)


class _Warnings(logging.Handler):
    def __init__(self, sink: List[str]):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record):
        self.sink.append(record.getMessage())


@contextlib.contextmanager
def registered(comm):
    import graph_opt

    graph_opt.register_custom_allreduce(comm)
    comm.reset_counters()
    try:
        yield comm
    finally:
        graph_opt.unregister_custom_allreduce(comm)


def _replay_and_compare(r: Rank, m, ref) -> None:
    with torch.no_grad():
        for real in REALS:
            x = r.tokens(real, seed=7)
            torch.testing.assert_close(m(x), ref(x), **TOL, msg=lambda s: f"batch {real}: {s}")


# -- scenarios -------------------------------------------------------------------------------------
def scenario_mode(r: Rank, name: str) -> dict:
    """Every rank captures the same sizes largest first; replays equal the unsharded model; no
    translation after capture."""
    import graph_opt

    mode = MODES[name]
    ref = r.reference()
    with registered(r.custom):
        m = r.model(mode)
        order = record_captures(m)
        report = graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), progress=False)
        assert report.failed is None, report.failed
        assert (report.rank, report.world_size) == (r.rank, r.world)
        translations = graph_opt.stats(m).translations
        _replay_and_compare(r, m, ref)
        s = graph_opt.stats(m)
    assert s.replays == len(REALS) and s.fallbacks == 0, s
    assert s.translations == translations, f"{s.translations - translations} translations after capture"
    assert s.graphs == {size: mode.graphs for size in SIZES}, s.graphs
    return {"order": order, "report": [sz.size for sz in report.sizes]}


def scenario_size_mismatch(r: Rank) -> dict:
    import graph_opt

    m = r.model(MODES["level0-full-dist"])
    sizes = SIZES if r.rank == 0 else SIZES[:-1]
    try:
        graph_opt.capture_model(m, lambda n: r.tokens(n), sizes=sizes, progress=False)
    except graph_opt.GraphOptConfigError as exc:
        assert graph_opt.stats(m).captures == 0
        return {"error": str(exc)}
    raise AssertionError("capture_model with other sizes than the peer's did not raise")


def scenario_capture_fault(r: Rank, name: str) -> dict:
    """Rank 1's capture of size 4 fails (after size 8 captured on both): every rank drops its graphs."""
    import graph_opt

    ref = r.reference()
    with registered(r.custom) as comm:
        m = r.model(MODES[name])
        record_captures(m, fail_on_rank=1, fail_at=4, rank=r.rank)
        before = len(r.warnings)
        report = graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), progress=False)
        warnings = r.warnings[before:]
        comm.reset_counters()
        _replay_and_compare(r, m, ref)
        s = graph_opt.stats(m)
        counters = (comm.registered_calls, comm.fallback_calls)
    assert s.captured_sizes == [] and s.replays == 0 and s.fallbacks == len(REALS), s
    assert s.capture_failures == 1
    return {"failed": report.failed, "warnings": warnings, "disabled": s.disabled_reason, "counters": counters}


def scenario_lazy(r: Rank) -> dict:
    """A size first seen at call time is captured on both ranks; a lazy capture that fails on rank 1
    drops the graphs on both."""
    import graph_opt

    ref = r.reference()
    m = r.model(MODES["level0-full-dist"])
    order = record_captures(m, fail_on_rank=1, fail_at=2, rank=r.rank)
    graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), sizes=[8], progress=False)
    with torch.no_grad():
        x = r.tokens(3, seed=5)
        torch.testing.assert_close(m(x), ref(x), **TOL)  # padded to 4: captured now
        lazy = graph_opt.stats(m)
        before = len(r.warnings)
        x = r.tokens(2, seed=5)
        torch.testing.assert_close(m(x), ref(x), **TOL)  # size 2 fails on rank 1
        warnings = r.warnings[before:]
        _replay_and_compare(r, m, ref)
    s = graph_opt.stats(m)
    assert lazy.lazy_captures == 1 and lazy.captured_sizes == [4, 8], lazy
    assert s.captured_sizes == [] and s.capture_failures == 1, s
    return {"order": order, "warnings": warnings, "disabled": s.disabled_reason}


def scenario_seed(r: Rank) -> dict:
    """Seed 001 for real: registered, the level-1 replay runs the capture branch (the registered
    buffer); traced before the capture phase, it would run the fallback; unregistered, the fallback."""
    import graph_opt

    comm = r.custom
    ref = r.reference()
    mode = MODES["level1-full-custom"]
    out = {}
    with registered(comm):
        m = r.model(mode)
        graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), progress=False)
        out["registered"] = _paths_of_replays(r, m, ref, comm)
        out["traced_before_capture"] = _traced_by_hand(r, r.model(mode), comm, in_capture_phase=False)
        out["traced_in_capture"] = _traced_by_hand(r, r.model(mode), comm, in_capture_phase=True)
    # A communicator that never took part in a capture phase (one that did keeps its registered
    # path wherever is_capturing() is true; see BufferAllReduce.in_capture).
    fresh = r.new_custom()
    try:
        m = r.model(mode, comm=fresh)
        graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), progress=False)
        out["unregistered"] = _paths_of_replays(r, m, ref, fresh)
    finally:
        fresh.close()
    return out


def scenario_replay_agreement(r: Rank, name: str) -> dict:
    """A check before the replay fails on rank 1 only (its model is put in training mode): every rank
    runs those calls without graphs (NCCL on both, matched); once rank 1 is back in eval mode both replay."""
    import graph_opt

    ref = r.reference()
    with registered(r.custom):
        m = r.model(MODES[name])
        graph_opt.capture_model(m, lambda n: r.tokens(n, seed=1), progress=False)
        if r.rank == 1:
            m.train()
        before = len(r.warnings)
        _replay_and_compare(r, m, ref)
        disagreed = graph_opt.stats(m)
        warnings = r.warnings[before:]
        if r.rank == 1:
            m.eval()
        _replay_and_compare(r, m, ref)
        agreed = graph_opt.stats(m)
    return {"replays": disagreed.replays, "reasons": disagreed.fallback_reasons, "warnings": warnings,
            "replays_after": agreed.replays - disagreed.replays}


def _paths_of_replays(r: Rank, m, ref, comm) -> dict:
    """Which all-reduce path the replays ran: counted on the host (simulated graphs), or seen in the
    registered buffer, which only that path writes (real graphs run no Python)."""
    import graph_opt

    comm.reset_counters()
    _poison(comm)
    _replay_and_compare(r, m, ref)
    assert graph_opt.stats(m).replays == len(REALS)
    return {"registered": comm.registered_calls, "fallback": comm.fallback_calls, "buffer_written": _written(comm)}


def _traced_by_hand(r: Rank, m, comm, in_capture_phase: bool) -> dict:
    """Trace, warm up and capture size 4 through the Dynamo strategy directly, inside the capture
    phase or before it, as test_torch_seed.py does; then replay it once."""
    import graph_opt
    from graph_opt.backends.torch.adapter import ADAPTER
    from graph_opt.backends.torch.dynamo import DynamoStrategy
    from graph_opt.replay.signature import Signature
    from graph_opt.decorator import state_of

    state = state_of(m)
    strategy = DynamoStrategy(m, type(m).forward, state.config, ADAPTER, None)
    args = (r.tokens(4, seed=3),)
    sig = Signature(1, None, [0], (args, {}))
    phase = _capture_phase() if in_capture_phase else contextlib.nullcontext()
    pool = ADAPTER.new_pool()  # None on CPU
    with phase, torch.no_grad(), ADAPTER.capture_stream():
        strategy.warmup(args, {}, 4, sig)
        captured = strategy.capture(args, {}, 4, sig, pool)
        ADAPTER.synchronize()
    comm.reset_counters()
    _poison(comm)
    with torch.no_grad():
        y = captured.replay()
        if r.real_graphs:
            torch.cuda.synchronize()
        torch.testing.assert_close(y if y is not None else captured.outputs, r.reference()(args[0]), **TOL)
    return {"registered": comm.registered_calls, "fallback": comm.fallback_calls, "buffer_written": _written(comm)}


@contextlib.contextmanager
def _capture_phase():
    import graph_opt

    with graph_opt.sot_warmup_guard(True), graph_opt.capture_custom_allreduce():
        yield


def _poison(comm) -> None:
    comm.buffer.fill_(float("nan"))
    if comm.buffer.is_cuda:
        torch.cuda.synchronize()


def _written(comm) -> bool:
    if comm.buffer.is_cuda:
        torch.cuda.synchronize()
    return not bool(torch.isnan(comm.buffer[: dims().hidden]).all())


SCENARIOS: Dict[str, Callable] = {
    **{f"mode:{name}": (lambda r, name=name: scenario_mode(r, name)) for name in MODES},
    "size_mismatch": scenario_size_mismatch,
    "capture_fault:level0": lambda r: scenario_capture_fault(r, "level0-full-custom"),
    "capture_fault:level1": lambda r: scenario_capture_fault(r, "level1-full-custom"),
    "lazy": scenario_lazy,
    "seed": scenario_seed,
    "replay_agreement:level0": lambda r: scenario_replay_agreement(r, "level0-full-custom"),
    "replay_agreement:level1": lambda r: scenario_replay_agreement(r, "level1-full-custom"),
}


# -- processes -------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, device: str, names: List[str], folder: str, timeout: float) -> None:
    import torch.distributed as dist

    out_path = os.path.join(folder, f"rank{rank}.pkl")
    results: Dict[str, dict] = {}
    try:
        import graph_opt
        from graph_opt.benchmarks.tp_model import DistAllReduce

        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        between = dist.new_group(backend="gloo")
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        r = Rank(rank, world, dev, cuda, DistAllReduce())
        r.custom = r.new_custom()
        logging.getLogger("graph_opt").addHandler(_Warnings(r.warnings))
        simulate = graph_opt.testing.simulate_cuda_graphs() if not cuda else contextlib.nullcontext()
        with simulate:
            for name in names:
                start = time.perf_counter()
                torch._dynamo.reset()
                try:
                    results[name] = {"ok": True, **SCENARIOS[name](r)}
                except BaseException:  # noqa: BLE001 - reported to the parent
                    results[name] = {"ok": False, "error": traceback.format_exc()}
                results[name]["seconds"] = time.perf_counter() - start
                _write(out_path, results)
                dist.barrier(group=between)  # the next scenario starts together on every rank
    except BaseException:  # noqa: BLE001
        results["<setup>"] = {"ok": False, "error": traceback.format_exc()}
        _write(out_path, results)
        os._exit(1)
    _write(out_path, results)
    os._exit(0)  # no teardown: destroying process groups can hang, and nothing is left to flush


def _write(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(results, f)
    os.replace(tmp, path)


def spawn_ranks(target, args_of, world: int, deadline_s: float) -> Tuple[List[int], List[Optional[int]]]:
    """Run target(*args_of(rank)) in `world` spawned processes; (the ranks still running at the deadline,
    all of them killed: a process group's teardown can hang, and a hang is a failure, never a wait;
    each rank's exit code)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank), daemon=True) for rank in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(max(0.0, deadline_s - (time.monotonic() - start)))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return hung, [p.exitcode for p in procs]


def run_ranks(device: str, names: List[str], folder: str, deadline_s: float,
              world: int = WORLD) -> Dict[str, List[dict]]:
    """Run the scenarios `names` on `world` ranks; {name: [result of rank 0, rank 1, ...]}. AssertionError
    when a rank is still running after deadline_s (all are killed) or died outside a scenario."""
    hung, exits = spawn_ranks(_rank_main, lambda rank: (rank, world, device, names, folder, deadline_s), world,
                              deadline_s)
    results = read_rank_results(folder, world)
    if hung:
        done = {rank: sorted(res) for rank, res in enumerate(results)}
        raise AssertionError(f"rank(s) {hung} still running after {deadline_s:.0f} s (a hang), killed; "
                             f"scenarios finished per rank: {done}")
    for rank, res in enumerate(results):
        if "<setup>" in res:
            raise AssertionError(f"rank {rank} failed outside the scenarios:\n{res['<setup>']['error']}")
        if exits[rank] != 0:
            raise AssertionError(f"rank {rank} exited with {exits[rank]}; finished: {sorted(res)}")
    return {name: [results[rank].get(name, {"ok": False, "error": "not run"}) for rank in range(world)]
            for name in names}


def passed(results: Dict[str, List[dict]], name: str) -> List[dict]:
    """Every rank's results of scenario `name`; AssertionError with the tracebacks where one failed."""
    per_rank = results[name]
    errors = [f"rank {rank}:\n{res['error']}" for rank, res in enumerate(per_rank) if not res["ok"]]
    assert not errors, f"scenario {name} failed\n" + "\n".join(errors)
    return per_rank


# -- what every rank's results must show (shared by the CPU and GPU test files) ---------------------
ALL_REDUCES = 2 * LAYERS  # per forward: after attention's out projection and after the MLP


def check_mode(results, name: str) -> None:
    ranks = passed(results, f"mode:{name}")
    largest_first = sorted(SIZES, reverse=True)
    assert all(res["order"] == largest_first for res in ranks), [res["order"] for res in ranks]
    assert all(res["report"] == largest_first for res in ranks), [res["report"] for res in ranks]


def check_size_mismatch(results) -> None:
    ranks = passed(results, "size_mismatch")
    for res in ranks:
        assert "rank 0: [8, 4, 2, 1]" in res["error"], res["error"]
        assert all(f"rank {k}: [4, 2, 1]" in res["error"] for k in range(1, len(ranks))), res["error"]


def check_capture_fault(results, name: str) -> None:
    ranks = passed(results, name)
    assert all(res["failed"] == ranks[0]["failed"] for res in ranks), [res["failed"] for res in ranks]
    # The failing rank's error, with the line that raised it, reaches every rank
    assert ("capture of size 4 failed on rank 1 (RuntimeError: injected capture fault on rank 1 at size 4; "
            "raised at " in ranks[0]["failed"] and "rank_harness.py" in ranks[0]["failed"]), ranks[0]["failed"]
    for res in ranks:
        assert len(res["warnings"]) == 1 and res["failed"] in res["warnings"][0], res["warnings"]
        assert res["disabled"] == res["failed"]
        # without graphs the forward runs eagerly, outside the capture phase: the fallback path
        assert res["counters"] == (0, ALL_REDUCES * len(REALS)), res["counters"]


def check_lazy(results) -> None:
    ranks = passed(results, "lazy")
    assert all(res["order"] == [8, 4, 2] for res in ranks), [res["order"] for res in ranks]
    for res in ranks:
        assert len(res["warnings"]) == 1, res["warnings"]
        assert "capture of size 2 failed on rank 1 (RuntimeError: injected capture fault" in res["warnings"][0]
        assert res["disabled"] in res["warnings"][0]


def check_replay_agreement(results, name: str) -> None:
    """Rank 1 is put in training mode: it names the reason, every other rank runs without graphs as its peer."""
    ranks = passed(results, name)
    assert all(res["replays"] == 0 for res in ranks), ranks
    r1 = ranks[1]
    assert r1["reasons"] == {"training": len(REALS)}, r1
    assert len(r1["warnings"]) == 1 and "training mode" in r1["warnings"][0], r1["warnings"]
    for rank, res in enumerate(ranks):
        if rank != 1:
            assert res["reasons"] == {"peer": len(REALS)}, (rank, res)
            assert len(res["warnings"]) == 1 and "rank 1 cannot replay this call" in res["warnings"][0], res["warnings"]
    assert all(res["replays_after"] == len(REALS) for res in ranks), ranks


def check_seed(results, real_graphs: bool) -> None:
    """Which path each replay ran. Simulated graphs run the path's Python, so the counters show it;
    real graphs run none, so only the registered buffer, which only that path writes, shows it."""
    for res in passed(results, "seed"):
        def expect(registered: bool, forwards: int):
            calls = 0 if real_graphs else ALL_REDUCES * forwards
            return {"registered": calls if registered else 0, "fallback": 0 if registered else calls,
                    "buffer_written": registered}

        assert res["registered"] == expect(True, len(REALS)), res["registered"]
        assert res["traced_in_capture"] == expect(True, 1), res["traced_in_capture"]
        assert res["traced_before_capture"] == expect(False, 1), res["traced_before_capture"]  # seed 001's graph
        assert res["unregistered"] == expect(False, len(REALS)), res["unregistered"]


# -- the tests: collected by tests/multirank (CPU) and tests/gpu (two GPUs), each of which defines the
# fixtures `results` (run_ranks' output) and `real_graphs` ------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_ranks_capture_the_same_sizes_largest_first_and_replay_the_unsharded_model(results, mode):
    check_mode(results, mode)


def test_different_capture_sizes_raise_on_every_rank_naming_each_ranks_sizes(results):
    check_size_mismatch(results)


@pytest.mark.parametrize("level", [0, 1])
def test_a_capture_fault_on_rank_1_drops_the_graphs_of_every_rank(results, level):
    check_capture_fault(results, f"capture_fault:level{level}")


def test_lazy_captures_are_agreed_and_a_lazy_fault_on_rank_1_drops_every_ranks_graphs(results):
    check_lazy(results)


@pytest.mark.parametrize("level", [0, 1])
def test_a_check_that_fails_on_one_rank_makes_every_rank_run_without_graphs(results, level):
    check_replay_agreement(results, f"replay_agreement:level{level}")


def test_seed_001_replays_run_the_branch_traced_in_the_capture_phase(results, real_graphs):
    check_seed(results, real_graphs=real_graphs)
