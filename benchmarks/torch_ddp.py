"""Benchmark of data-parallel training steps (torch): DistributedDataParallel with graph_opt.autocudagraph,
against eager DDP and torch.compile(mode="reduce-overhead") under DDP, one process per GPU (NCCL).

    python -m graph_opt bench ddp [--world 2] [--quick] [--out results]
    python -m graph_opt bench ddp --smoke      # CPU, gloo, simulated graphs, tiny blocks: the code runs

Model: benchmarks/torch_training.py's block stack (12 blocks, hidden 1024, 16 heads, bf16; --quick: 4
blocks), DDP around it, each rank on data of its own: [micro-batch, 128, 1024]. A step: zero_grad,
forward, loss = out.float().pow(2).mean(), backward (DDP's all-reduce of the gradients), SGD step.
Variants, each on a model built with the same initial weights:
- eager DDP;
- autocudagraph: graph_opt.autocudagraph(DDP(model)) graphs the wrapped stack (default level, one
  warm-up step); DDP's forward and its reducer's all-reduce hooks run outside the graphs, as in eager;
- reduce-overhead: torch.compile(DDP(model), mode="reduce-overhead") (Dynamo splits the graph at DDP's
  buckets); a failure is reported in the table, not raised.
Per variant and micro-batch (1 and 8): 5 warm-up steps, then 20 timed steps between CUDA events, the
median on rank 0 (the ranks step in lockstep). After the steps every rank's parameters are summed and
the sums compared across ranks: replicas that drifted apart are a failure.

Writes <out>/ddp_bench.json (ddp_bench_world<N>.json for another world size; the world size, device, ms per
step, the ratios) and prints the table last. Runs
under a hard timeout: a rank that hangs ends the run with exit 1. Exits 0 with fewer CUDA devices than
ranks (nothing to measure); 1 where eager DDP or autocudagraph failed or the replicas disagree.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List

from .ranks import spawn_ranks
from .report import write_json

WORLD = 2
MICRO_BATCHES, SMOKE_MICRO_BATCHES = [1, 8], [2]
WARMUP, STEPS, SMOKE_STEPS = 5, 20, 3
TIMEOUT_S = 600
EAGER, AUTO, COMPILE = "eager DDP", "autocudagraph(DDP)", "reduce-overhead DDP"


def _rank_main(rank: int, world: int, folder: str, quick: bool, smoke: bool) -> None:
    try:
        result = _measure(rank, world, folder, quick, smoke)
        if rank == 0:
            with open(os.path.join(folder, "result.json.tmp"), "w", encoding="utf-8") as fh:
                json.dump(result, fh)
            os.replace(os.path.join(folder, "result.json.tmp"), os.path.join(folder, "result.json"))
    except BaseException:  # noqa: BLE001 - the parent reports a rank that exits 1
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no teardown: destroying a process group can hang


def _measure(rank: int, world: int, folder: str, quick: bool, smoke: bool) -> dict:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import graph_opt
    from . import torch_training as tt

    cuda = not smoke
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    hidden, layers, heads, mlp, seq = (32, 2, 4, 64, 8) if smoke else (tt.HIDDEN, 4 if quick else tt.LAYERS,
                                                                       tt.HEADS, tt.MLP, tt.SEQ)
    dtype = torch.float32 if smoke else tt.DTYPE
    micro_batches = SMOKE_MICRO_BATCHES if smoke else MICRO_BATCHES
    steps = SMOKE_STEPS if smoke else STEPS
    ddp_options = {"device_ids": [rank]} if cuda else {}

    def build():
        torch.manual_seed(tt.SEED)
        return torch.nn.Sequential(*(tt.Block(hidden, heads, mlp) for _ in range(layers))).to(device, dtype)

    def eager():
        ddp = DDP(build(), **ddp_options)
        return ddp, ddp

    def auto():
        ddp = DDP(build(), **ddp_options)
        return ddp, graph_opt.autocudagraph(ddp)

    def reduce_overhead():
        ddp = DDP(build(), **ddp_options)
        compiled = torch.compile(ddp, mode="reduce-overhead", dynamic=False)

        def forward(x):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(x)
        return ddp, forward

    variants = {EAGER: eager, AUTO: auto}
    if cuda:
        variants[COMPILE] = reduce_overhead

    def sync():
        if cuda:
            torch.cuda.synchronize()

    ms: Dict[str, Dict[str, float]] = {}
    failed: Dict[str, str] = {}
    agree: Dict[str, bool] = {}
    stats: Dict[str, dict] = {}
    simulate = contextlib.nullcontext() if cuda else graph_opt.testing.simulate_cuda_graphs()
    with simulate:
        for name, make in variants.items():
            try:
                model, forward = make()
                opt = torch.optim.SGD(model.parameters(), lr=tt.LR)

                def step(x):
                    opt.zero_grad(set_to_none=True)
                    forward(x).float().pow(2).mean().backward()
                    opt.step()

                ms[name] = {}
                for mb in micro_batches:
                    g = torch.Generator().manual_seed(1000 * rank + mb)
                    x = torch.randn(mb, seq, hidden, generator=g).to(device, dtype)
                    for _ in range(WARMUP):
                        step(x)
                    sync()
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step(x)
                        sync()
                        times.append((time.perf_counter() - t0) * 1e3)
                    ms[name][str(mb)] = statistics.median(times)
                total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
                sums = [torch.zeros_like(total) for _ in range(world)]
                dist.all_gather(sums, total)
                agree[name] = all(bool(s == sums[0]) for s in sums)
                if name == AUTO:
                    s = graph_opt.stats(model)
                    stats[name] = {k: getattr(s, k) for k in ("replays", "backward_replays", "fallbacks",
                                                              "fallback_reasons", "captures", "key_levels")}
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                ms.pop(name, None)
            dist.barrier()
            if cuda:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    return {"world_size": world, "device": torch.cuda.get_device_name() if cuda else "cpu (--smoke)",
            "torch": torch.__version__, "dims": {"hidden": hidden, "layers": layers, "seq": seq, "dtype": str(dtype)},
            "micro_batches": micro_batches, "ms": ms, "failed": failed, "ranks_agree": agree, "stats": stats}


def run(out_dir: str, world: int, quick: bool, smoke: bool) -> int:
    import torch

    if not smoke and torch.cuda.device_count() < world:
        print(f"needs {world} CUDA devices, found {torch.cuda.device_count()}: nothing to measure (--smoke runs "
              "the code on CPU)")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        hung, exits = spawn_ranks(_rank_main, lambda r: (r, world, folder, quick, smoke), world, TIMEOUT_S)
        path = os.path.join(folder, "result.json")
        if hung or any(exits) or not os.path.exists(path):
            print(f"FAILED: ranks {hung} hung (killed after {TIMEOUT_S} s); exit codes {exits}")
            return 1
        with open(path, encoding="utf-8") as fh:
            result = json.load(fh)
    result["problems"] = problems(result)
    write_json(out_dir, "ddp_bench.json" if world == WORLD else f"ddp_bench_world{world}.json", result)
    print_table(result)
    for line in result["problems"]:
        print(f"FAILED: {line}")
    return 1 if result["problems"] else 0


def problems(result) -> List[str]:
    out = [f"{name}: {why}" for name, why in result["failed"].items() if name != COMPILE]
    out += [f"{name}: the ranks' parameters differ after the steps" for name, ok in result["ranks_agree"].items()
            if not ok]
    s = result["stats"].get(AUTO)
    if s is not None and (s["fallbacks"] or not s["replays"]):
        out.append(f"{AUTO}: {s['replays']} replays, {s['fallbacks']} eager fallbacks {s['fallback_reasons']}")
    return out


def print_table(result) -> None:
    mbs = [str(mb) for mb in result["micro_batches"]]
    ms = result["ms"]
    print(f"\nDDP training step on {result['world_size']} ranks, {result['device']}, torch {result['torch']}, "
          f"{result['dims']}; ms per step (median on rank 0), and eager DDP's / reduce-overhead's over the variant's:")
    print("| variant | " + " | ".join(f"mb {mb} ms | x eager | x reduce-overhead" for mb in mbs) + " |")
    print("|---|" + "---|---|---|" * len(mbs))
    for name in (EAGER, AUTO, COMPILE):
        if name in result["failed"]:
            print(f"| {name} | failed: {result['failed'][name]} |")
        elif name in ms:
            cells = []
            for mb in mbs:
                t = ms[name][mb]
                eager, ro = ms.get(EAGER, {}).get(mb), ms.get(COMPILE, {}).get(mb)
                cells.append(f"{t:.2f} | " + (f"{eager / t:.2f}x" if eager else "-") + " | "
                             + (f"{ro / t:.2f}x" if ro else "-"))
            print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None, prog=None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="folder for ddp_bench.json (default results)")
    parser.add_argument("--world", type=int, default=WORLD, help="ranks, one GPU each (default 2)")
    parser.add_argument("--quick", action="store_true", help="4 blocks instead of 12")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, simulated graphs, tiny blocks: the code runs")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world {args.world}: expected 1 or more ranks")
    return run(args.out, args.world, args.quick, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
