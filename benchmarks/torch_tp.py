"""GPU benchmark of a tensor-parallel decode step on 2 (or --world) GPUs (torch, NCCL): eager vs CUDA graphs.

    python -m graph_opt.benchmarks.torch_tp [--quick] [--world 4] [--out results]
    python -m graph_opt bench tp [--quick] [--world 4] [--out results]

Model: benchmarks/tp_model.py's TPDecoder, TP=2 by default (one process per GPU, NCCL), hidden 4096, 32 heads,
MLP 16384, 16 layers, bf16, one token per sequence attending over a 256-token KV cache (--quick: 4
layers). Per layer two all-reduces (after the row-parallel out and down projections). Batches 1, 8, 64;
the capture sizes are those batches. Variants, each its own model with the same weights:
- eager: the undecorated TPDecoder, NCCL all-reduce;
- full graph, NCCL: level 0, one CUDA graph per size with the NCCL all-reduces inside;
- full graph, custom all-reduce: the same with SymmMemAllReduce (torch symmetric memory,
  one_shot_all_reduce) registered, so the graphs hold its registered-buffer path;
- piecewise, all-reduce split: level 0, split at the splitting op "tp_all_reduce": the all-reduces
  run eagerly (NCCL) between the graph pieces.
Per variant and batch: 5 warm-up calls, then 15 timed rounds of 10 calls, each round between two
torch.cuda.synchronize(); the median of the rounds' µs per call on rank 0 (both ranks run the same
calls in lockstep). The variants take turns per round. One replay of the custom all-reduce variant
is profiled: the count of its kernels per step whose names contain "one_shot" (symmetric memory) and
"nccl" shows which path the graph holds.

Every output is compared with the eager one before timing (bf16, 16 layers: the largest difference
within 2% of the largest value; cuBLAS may pick other kernels inside a capture, and the custom
all-reduce sums in another order than NCCL).
Writes <out>/tp_bench.json and, with matplotlib, <out>/tp_step_time.png (world sizes other than 2:
tp_bench_world<N>.json, tp_step_time_world<N>.png; the json records its world size); prints the table last, with
the targets (full graph >= 3x eager at batches 1 and 8; the custom all-reduce in a graph vs NCCL in a
graph at batch 1: reported). Runs under a hard timeout: a rank that hangs ends the run with exit 1.
Exits 0 with fewer CUDA devices than ranks (nothing to measure).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Dict, List

from .ranks import spawn_ranks
from .report import grouped_bars, new_figure, save_figure, write_json

BATCHES = [1, 8, 64]
WORLD = 2
TIMEOUT_S = 300
EAGER, FULL_NCCL, FULL_CUSTOM, PIECEWISE = ("eager", "full graph, NCCL", "full graph, custom all-reduce",
                                            "piecewise, all-reduce split")
VARIANTS = [EAGER, FULL_NCCL, FULL_CUSTOM, PIECEWISE]
WARMUP, ROUNDS, CALLS = 5, 15, 10
TARGET_SPEEDUP = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, quick: bool, result_path: str) -> None:
    try:
        _measure(rank, world, port, quick, result_path)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no teardown: destroying a process group can hang, and nothing is left to flush


def _measure(rank: int, world: int, port: int, quick: bool, result_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import graph_opt
    from graph_opt.benchmarks import tp_model
    from graph_opt.backends.torch.symm_mem_allreduce import SymmMemAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=120))
    dims = tp_model.TPDims(hidden=4096, heads=32, mlp=16384, layers=4 if quick else 16, cache_len=256,
                           max_batch=max(BATCHES))
    dtype = torch.bfloat16
    cfg_full = {"graph_opt_level": 0, "full_cuda_graph": True, "cudagraph_capture_sizes": BATCHES}
    cfg_piece = {"graph_opt_level": 0, "full_cuda_graph": False, "cudagraph_capture_sizes": BATCHES,
                 "cudagraph_splitting_ops": ["tp_all_reduce"]}
    nccl = tp_model.DistAllReduce()
    custom = SymmMemAllReduce(max_bytes=max(BATCHES) * dims.hidden * 2, dtype=dtype)
    build = dict(rank=rank, world_size=world, dtype=dtype, device="cuda")
    models = {
        EAGER: tp_model.TPDecoder(dims, rank, world, nccl, init_device="cuda").to(device="cuda", dtype=dtype).eval(),
        FULL_NCCL: tp_model.build_tp_decoder(dims, comm=nccl, graph_opt_config=cfg_full, **build),
        FULL_CUSTOM: tp_model.build_tp_decoder(dims, comm=custom, graph_opt_config=cfg_full, **build),
        PIECEWISE: tp_model.build_tp_decoder(dims, comm=nccl, graph_opt_config=cfg_piece, split_all_reduce=True,
                                             **build),
    }

    def make(n):
        return tp_model.make_tokens(n, dims, seed=1, dtype=dtype, device="cuda")

    capture_s = {}
    with torch.no_grad():
        for name in (FULL_NCCL, FULL_CUSTOM, PIECEWISE):
            if name == FULL_CUSTOM:
                graph_opt.register_custom_allreduce(custom)
            t0 = time.perf_counter()
            report = graph_opt.capture_model(models[name], make, progress=False)
            capture_s[name] = time.perf_counter() - t0
            if name == FULL_CUSTOM:
                graph_opt.unregister_custom_allreduce(custom)
            if report.failed:
                raise RuntimeError(f"{name}: capture failed: {report.failed}")
        calls = dict(models)
        errors = {}
        for bs in BATCHES:
            x = make(bs)
            want = calls[EAGER](x).float()
            for name in (FULL_NCCL, FULL_CUSTOM, PIECEWISE):
                got = calls[name](x).float()
                errors[f"{name} bs {bs}"] = float((got - want).abs().max() / want.abs().max())
        bad = {k: v for k, v in errors.items() if not v <= 2e-2}
        if bad:
            raise RuntimeError(f"outputs differ from eager: {bad}")

        timings: Dict[int, Dict[str, float]] = {}
        for bs in BATCHES:
            x = make(bs)
            rounds: Dict[str, List[float]] = {name: [] for name in VARIANTS}
            for name in VARIANTS:
                for _ in range(WARMUP):
                    calls[name](x)
            for r in range(ROUNDS):
                for i in range(len(VARIANTS)):
                    name = VARIANTS[(r + i) % len(VARIANTS)]
                    fn = calls[name]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(CALLS):
                        fn(x)
                    torch.cuda.synchronize()
                    rounds[name].append((time.perf_counter() - t0) / CALLS * 1e6)
            timings[bs] = {name: statistics.median(v) for name, v in rounds.items()}
            if rank == 0:
                print(f"bs {bs:>3}: " + ", ".join(f"{n} {t:.1f} µs" for n, t in timings[bs].items()), flush=True)
        stats = {name: graph_opt.stats(models[name]).as_dict() for name in (FULL_NCCL, FULL_CUSTOM, PIECEWISE)}
        result = {"dims": dims.__dict__, "timings": {str(k): v for k, v in timings.items()},
                  "max_error_vs_eager_relative_to_max": errors, "capture_seconds": capture_s,
                  "custom_counters": {"registered_calls": custom.registered_calls,
                                      "fallback_calls": custom.fallback_calls},
                  "graphs": {n: s["graphs"] for n, s in stats.items()}, "kernels": None,
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__, "world_size": world}
        if rank == 0:
            _dump(result, result_path)
        print(f"rank {rank}: timed; profiling one replay", flush=True)
        result["kernels"] = _kernels_per_replay(calls[FULL_CUSTOM], make(1))
        if rank == 0:
            _dump(result, result_path)
        print(f"rank {rank}: done", flush=True)


def _dump(result, path: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)


def _kernels_per_replay(call, x) -> Dict[str, int]:
    """Device kernels of one call by kind: which all-reduce a replayed graph holds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(x)
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"one_shot": sum("one_shot" in n for n in names), "nccl": sum("nccl" in n for n in names),
            "all": len(names)}


def run(out_dir: str, quick: bool, world: int = WORLD) -> int:
    import torch

    if torch.cuda.device_count() < world:
        print(f"needs {world} CUDA devices, found {torch.cuda.device_count()}: nothing to measure")
        return 0
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank0.json")
        hung, exits = spawn_ranks(_rank_main, lambda r: (r, world, port, quick, result_path), world, TIMEOUT_S)
        failed = [r for r, code in enumerate(exits) if code != 0 and r not in hung]
        if not os.path.exists(result_path):
            print(f"no results: ranks {hung} hung (killed after {TIMEOUT_S} s), ranks {failed} failed "
                  f"(exit codes {exits})")
            return 1
        with open(result_path, encoding="utf-8") as fh:
            result = json.load(fh)
    problem = None
    if hung or failed:  # a hang is a failure; the timings taken before it are still shown
        problem = (f"ranks {hung} still running after {TIMEOUT_S} s: killed" if hung else
                   f"ranks {failed} failed (exit codes {exits})")
    result["batches"] = BATCHES
    result["method"] = (f"{WARMUP} warm-up calls, then {ROUNDS} rounds of {CALLS} calls per variant in rotating "
                        "order, each round between two synchronizes; median µs per call on rank 0")
    result["targets"] = targets(result)
    result["problem"] = problem
    write_json(out_dir, "tp_bench.json" if world == WORLD else f"tp_bench_world{world}.json", result)
    plot(out_dir, result)
    print_table(result)
    if problem:
        print(f"FAILED: {problem}")
        return 1
    return 0


def targets(result) -> List[str]:
    t = result["timings"]
    lines = []
    sp = {bs: t[str(bs)][EAGER] / t[str(bs)][FULL_NCCL] for bs in (1, 8)}
    ok = all(v >= TARGET_SPEEDUP for v in sp.values())
    lines.append(f"- full graph (NCCL) >= {TARGET_SPEEDUP:.0f}x eager at batches 1, 8: {'met' if ok else 'NOT met'} ("
                 + ", ".join(f"bs {bs}: {v:.2f}x" for bs, v in sp.items()) + ")")
    ratio = t["1"][FULL_NCCL] / t["1"][FULL_CUSTOM]
    lines.append(f"- custom all-reduce in a graph vs NCCL in a graph at batch 1: {ratio:.2f}x "
                 f"({'faster' if ratio > 1 else 'not faster'})")
    return lines


def plot(out_dir: str, result) -> None:
    figure = new_figure()
    if figure is None:
        return
    fig, ax = figure
    grouped_bars(ax, BATCHES, {name: [result["timings"][str(bs)][name] for bs in BATCHES] for name in VARIANTS})
    ax.set_xlabel("batch (sequences, one token each)")
    ax.set_ylabel("µs per decode step (median)")
    ax.grid(True, axis="y", alpha=0.3)
    d = result["dims"]
    world = result.get("world_size", WORLD)
    save_figure(fig, ax, out_dir, "tp_step_time.png" if world == WORLD else f"tp_step_time_world{world}.png",
                f"TP={world} decode step, hidden {d['hidden']} x {d['layers']} layers, bf16, {result['device']}")


def print_table(result) -> None:
    t = result["timings"]
    d = result["dims"]
    print(f"\nTP={result.get('world_size', WORLD)} decode step: hidden {d['hidden']}, {d['layers']} layers, "
          f"MLP {d['mlp']}, bf16, "
          f"{result['device']}, torch {result['torch']}")
    print("| variant | batch | µs per step | vs eager | vs full graph NCCL |")
    print("|---|---|---|---|---|")
    for bs in BATCHES:
        row = t[str(bs)]
        for name in VARIANTS:
            print(f"| {name} | {bs} | {row[name]:.1f} | {row[EAGER] / row[name]:.2f}x | "
                  f"{row[FULL_NCCL] / row[name]:.2f}x |")
    k = result["kernels"] or {"one_shot": "?", "nccl": "?", "all": "?"}
    print(f"custom all-reduce graph, one replay at batch 1: {k['one_shot']} one_shot_all_reduce kernels, "
          f"{k['nccl']} NCCL kernels, {k['all']} kernels in all")
    print("capture s: " + ", ".join(f"{n} {s:.2f}" for n, s in result["capture_seconds"].items()))
    print("Targets (informational):")
    for line in result["targets"]:
        print(line)


def main(argv=None, prog=None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="folder for tp_bench.json and the plot (default results)")
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 16")
    parser.add_argument("--world", type=int, default=WORLD, choices=[2, 4, 8],
                        help="ranks, one GPU each (default 2; the heads, 32, divide among them)")
    args = parser.parse_args(argv)
    return run(args.out, args.quick, args.world)


if __name__ == "__main__":
    sys.exit(main())
