"""GPU benchmark of CUDA-graphed training steps on PyTorch (one NVIDIA GPU).

    python -m graph_opt.benchmarks.torch_training [--quick] [--out results]
    python -m graph_opt bench training [--quick] [--out results]

Model: 12 transformer-like blocks, hidden 1024, 16 heads. Parameters are plain bf16, no autocast: every
variant then runs the same kernels, and torch.cuda.make_graphed_callables graphs it as is (under
autocast it would need cache_enabled=False). Each block: LayerNorm, QKV Linear, causal
F.scaled_dot_product_attention, out projection, residual, LayerNorm, MLP 1024 -> 4096 -> 1024 (GELU),
residual. Input [micro_batch, 128, 1024], no gradient.

A training step: zero_grad(set_to_none=True), forward through the blocks, loss =
out.float().pow(2).mean(), backward, torch.optim.SGD(lr=1e-3, foreach=True).step(). Only the blocks are
graphed; the loss and the optimizer run eagerly in every variant.

Variants, each on a freshly built model with the same initial weights:
- eager;
- autocudagraph (per block): every block wrapped, graph_opt.autocudagraph(block, warmup_steps=2);
- autocudagraph (whole stack): one wrap around the nn.Sequential of the 12 blocks;
- make_graphed_callables: torch.cuda.make_graphed_callables over the 12 blocks, num_warmup_iters=3. It
  captures one shape per call, so each micro-batch size gets its own model and its own call;
- torch.compile(mode="reduce-overhead", dynamic=False) on the Sequential: one compile per size (with
  --quick, micro-batch 8 only). A failure is reported in the table, not raised.

Per variant and micro-batch size: 5 warm-up steps (autocudagraph's 2 eager calls, its capture, replays),
then back-to-back timed steps, each between two CUDA events; the median is reported.
Capture: autocudagraph's capture_seconds summed over its blocks; make_graphed_callables' wall time;
for torch.compile, the wall time of the warm-up steps (compile and record). Memory, from the point where
the variant's model(s) are built to the end of its steps, all sizes: the private graph pools' segments
that appeared (graph memory), memory_reserved()'s growth and max_memory_allocated()'s growth
(activations, gradients and allocator cache included); for autocudagraph also its stats'
graph_memory_bytes. Step times in the ratio columns are divided by eager's and by
make_graphed_callables' at micro-batch 8 (below 1: faster).

Correctness, at micro-batch 8 after the timed steps: the initial weights are copied back into each
variant's parameters (in place, addresses kept) and one forward and backward runs on one input; the loss
and the gradients are compared with eager's (autocudagraph replays eager's kernels: 0 expected). Eager run
twice gives the floor.

Writes <out>/training_bench.json and, with matplotlib, <out>/training_step_time.png; prints the table last.
Exits 1 if eager or an autocudagraph variant failed, 0 otherwise (also without a CUDA device).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .report import new_figure, save_figure, write_json

HIDDEN, LAYERS, HEADS, SEQ, MLP = 1024, 12, 16, 128, 4096
DTYPE = torch.bfloat16
LR = 1e-3
MICRO_BATCHES, QUICK_MICRO_BATCHES = [1, 2, 4, 8], [1, 8]
CHECK_MB = 8  # the micro-batch of the correctness check, the ratio columns and, with --quick, torch.compile
WARMUP_STEPS = 5
AUTO_WARMUP = 2
SEED = 0

EAGER, AUTO_BLOCKS, AUTO_STACK = "eager", "autocudagraph (per block)", "autocudagraph (whole stack)"
MGC, COMPILE = "make_graphed_callables", "torch.compile reduce-overhead"


class Block(torch.nn.Module):
    def __init__(self, hidden=HIDDEN, heads=HEADS, mlp=MLP):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, mlp)
        self.fc2 = torch.nn.Linear(mlp, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def build() -> torch.nn.Sequential:
    """The block stack on the GPU in bf16, in training mode; every call has the same weights."""
    torch.manual_seed(SEED)
    return torch.nn.Sequential(*(Block() for _ in range(LAYERS))).to(device="cuda", dtype=DTYPE)


def make_input(mb: int, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + mb)
    x = torch.randn(mb, SEQ, HIDDEN, generator=g, device="cuda", dtype=torch.float32).to(DTYPE)
    return x.requires_grad_(requires_grad)


class Trainer:
    """A model, the callable its step runs forward through (the model itself, or a compiled wrapper) and
    its optimizer."""

    def __init__(self, model: torch.nn.Module, forward: Optional[Callable] = None):
        self.model = model
        self.forward = forward or model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)

    def loss(self, x) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(x).float().pow(2).mean()
        loss.backward()
        return loss

    def step(self, x) -> None:
        self.loss(x)
        self.opt.step()


# -- variants ---------------------------------------------------------------------------------------
class Variant:
    """One way of running the step. trainer(mb) is called once per micro-batch size, before its warm-up."""

    sizes: Optional[List[int]] = None  # None: every size of the run

    def trainer(self, mb: int) -> Trainer:
        raise NotImplementedError

    def capture_seconds(self, warmup_wall: Dict[int, float]) -> Optional[float]:
        return None

    def extra(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Eager(Variant):
    def __init__(self):
        self.t = Trainer(build())

    def trainer(self, mb):
        return self.t


class AutoCudaGraph(Variant):
    def __init__(self, whole_stack: bool):
        import graph_opt

        self.graph_opt = graph_opt
        model = build()
        if whole_stack:
            self.graphed = [graph_opt.autocudagraph(model, warmup_steps=AUTO_WARMUP)]
        else:
            for i in range(len(model)):
                model[i] = graph_opt.autocudagraph(model[i], warmup_steps=AUTO_WARMUP)
            self.graphed = list(model)
        self.t = Trainer(model)

    def trainer(self, mb):
        return self.t

    def summed_stats(self) -> dict:
        stats = [self.graph_opt.stats(m) for m in self.graphed]
        out = {f: sum(getattr(s, f) for s in stats)
               for f in ("graphs", "warmups", "captures", "replays", "backward_replays", "fallbacks",
                         "capture_failures", "recaptures", "capture_seconds")}
        memory = [s.graph_memory_bytes for s in stats if s.graph_memory_bytes is not None]
        out["graph_memory_bytes"] = sum(memory) if memory else None
        reasons: Dict[str, int] = {}
        for s in stats:
            for k, v in s.fallback_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
        out["fallback_reasons"] = reasons
        out["disabled_reasons"] = sorted({s.disabled_reason for s in stats if s.disabled_reason})
        out["mode"] = stats[0].mode
        return out

    def capture_seconds(self, warmup_wall):
        return self.summed_stats()["capture_seconds"]

    def extra(self):
        return {"stats": self.summed_stats()}

    def close(self):
        for m in self.graphed:
            self.graph_opt.clear_graphs(m)


class GraphedCallables(Variant):
    def __init__(self, sizes: List[int]):
        self.models = {mb: build() for mb in sizes}  # built up front: their weights are not graph memory
        self.seconds: Dict[int, float] = {}

    def trainer(self, mb):
        model = self.models[mb]
        # The data input needs no gradient; every later block's input does, as in the real step.
        samples = tuple((make_input(mb, requires_grad=i > 0),) for i in range(LAYERS))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda.make_graphed_callables(tuple(model), samples, num_warmup_iters=3)
        torch.cuda.synchronize()
        self.seconds[mb] = time.perf_counter() - t0
        return Trainer(model)

    def capture_seconds(self, warmup_wall):
        return sum(self.seconds.values())

    def extra(self):
        return {"capture_seconds_per_size": self.seconds}


class Compiled(Variant):
    def __init__(self, sizes: Optional[List[int]]):
        self.sizes = sizes
        self.model = build()
        compiled = torch.compile(self.model, mode="reduce-overhead", dynamic=False)

        def forward(x):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(x)

        self.t = Trainer(self.model, forward)

    def trainer(self, mb):
        return self.t

    def capture_seconds(self, warmup_wall):
        return sum(warmup_wall.values()) if warmup_wall else None

    def extra(self):
        from torch._dynamo.utils import counters

        return {"cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
                "capture_note": "capture_seconds: wall time of the warm-up steps, compile and record included"}

    def close(self):
        torch._dynamo.reset()


# -- measuring --------------------------------------------------------------------------------------
def pool_ids() -> set:
    return {tuple(seg.get("segment_pool_id", (0, 0))) for seg in torch.cuda.memory_snapshot()} - {(0, 0)}


def pool_bytes(exclude: set) -> int:
    """Bytes of the segments of private (graph) pools not in `exclude`."""
    total = 0
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid != (0, 0) and pid not in exclude:
            total += seg["total_size"]
    return total


def settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def step_times_ms(t: Trainer, x, steps: int) -> List[float]:
    """Per-step time of back-to-back steps: the device's time when it is the bottleneck, else the host's."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    for s, e in zip(starts, ends):
        s.record()
        t.step(x)
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


class Checker:
    """Loss and gradients of one step from the initial weights, compared with eager's."""

    def __init__(self):
        self.initial = [p.detach().clone() for p in build().parameters()]
        self.x = make_input(CHECK_MB)
        self.ref_loss: Optional[torch.Tensor] = None
        self.ref_grads: List[torch.Tensor] = []
        self.results: Dict[str, dict] = {}

    def run(self, t: Trainer):
        params = list(t.model.parameters())
        with torch.no_grad():
            for p, init in zip(params, self.initial):
                p.copy_(init)
        loss = t.loss(self.x).detach().clone()
        grads = [p.grad.detach().clone() for p in params]
        t.opt.zero_grad(set_to_none=True)
        return loss, grads

    def check(self, name: str, t: Trainer) -> None:
        loss, grads = self.run(t)
        if self.ref_loss is None:
            self.ref_loss, self.ref_grads = loss, grads
            loss, grads = self.run(t)
            name = "eager (repeat)"
        diffs = [(g.float() - r.float()).abs().max().item() for g, r in zip(grads, self.ref_grads)]
        self.results[name] = {"loss": loss.item(), "loss_diff": abs(loss.item() - self.ref_loss.item()),
                              "block0_qkv_weight_grad_diff": diffs[first_qkv_index(t.model)],
                              "max_grad_diff": max(diffs)}


def first_qkv_index(model: torch.nn.Module) -> int:
    names = [n for n, _ in model.named_parameters()]
    return names.index("0.qkv.weight")


def failure(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def time_size(variant: Variant, name: str, mb: int, steps: int, res: dict) -> Trainer:
    x = make_input(mb)
    t0 = time.perf_counter()
    t = variant.trainer(mb)
    for _ in range(WARMUP_STEPS):
        t.step(x)
    torch.cuda.synchronize()
    res["warmup_seconds"][mb] = time.perf_counter() - t0
    samples = step_times_ms(t, x, steps)
    res["step_ms_samples"][mb] = samples
    res["step_ms"][mb] = statistics.median(samples)
    t.opt.zero_grad(set_to_none=True)
    print(f"{name:>30}: micro-batch {mb}: {res['step_ms'][mb]:.2f} ms per step", flush=True)
    return t


def measure(make_variant: Callable[[], Variant], name: str, sizes: List[int], steps: int, checker: Checker) -> dict:
    """Build, warm up and time one variant at every size; its capture time, memory, check and failure."""
    res: dict = {"step_ms": {}, "step_ms_samples": {}, "warmup_seconds": {}, "capture_seconds": None,
                 "memory_mib": {}, "failed": None}
    variant, trainers = None, {}
    try:
        variant = make_variant()
        settle()
        torch.cuda.reset_peak_memory_stats()
        reserved0, allocated0, pools0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), pool_ids()
        for mb in sizes:
            if variant.sizes is None or mb in variant.sizes:
                trainers[mb] = time_size(variant, name, mb, steps, res)
        torch.cuda.synchronize()
        res["capture_seconds"] = variant.capture_seconds(res["warmup_seconds"])
        res["memory_mib"] = {"graph_pools": pool_bytes(pools0) / 2**20,
                             "reserved_growth": (torch.cuda.memory_reserved() - reserved0) / 2**20,
                             "peak_allocated_growth": (torch.cuda.max_memory_allocated() - allocated0) / 2**20}
        res.update(variant.extra())
        if CHECK_MB in trainers:
            checker.check(name, trainers[CHECK_MB])
    except Exception as exc:  # noqa: BLE001 - reported in the table; the other variants still run
        res["failed"] = failure(exc)
        print(f"{name}: failed: {res['failed']}", flush=True)
    finally:
        trainers.clear()
        if variant is not None:
            variant.close()
        variant = None
        settle()
    return res


def run(out_dir: str, quick: bool) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    sizes = QUICK_MICRO_BATCHES if quick else MICRO_BATCHES
    steps = 15 if quick else 30
    checker = Checker()
    variants = {
        EAGER: Eager,
        AUTO_BLOCKS: lambda: AutoCudaGraph(whole_stack=False),
        AUTO_STACK: lambda: AutoCudaGraph(whole_stack=True),
        MGC: lambda: GraphedCallables(sizes),
        COMPILE: lambda: Compiled([CHECK_MB] if quick else None),
    }
    results = {name: measure(make, name, sizes, steps, checker) for name, make in variants.items()}
    device = torch.cuda.get_device_name()
    write_results(out_dir, sizes, steps, results, checker.results, device)
    print_table(sizes, results, checker.results, device)
    return 1 if any(results[n]["failed"] for n in (EAGER, AUTO_BLOCKS, AUTO_STACK)) else 0


# -- output -----------------------------------------------------------------------------------------
def write_results(out_dir, sizes, steps, results, checks, device) -> None:
    summary = {
        "device": device, "torch": torch.__version__,
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "seq": SEQ, "mlp": MLP, "dtype": "bfloat16",
                  "optimizer": f"SGD lr {LR} foreach", "loss": "out.float().pow(2).mean()"},
        "micro_batches": sizes, "warmup_steps": WARMUP_STEPS, "timed_steps": steps,
        "autocudagraph_warmup_steps": AUTO_WARMUP, "variants": results, "correctness": checks,
    }
    write_json(out_dir, "training_bench.json", summary)
    plot(out_dir, sizes, results, device)


def plot(out_dir, sizes, results, device) -> None:
    figure = new_figure()
    if figure is None:
        return
    fig, ax = figure
    for name, res in results.items():
        mbs = [mb for mb in sizes if mb in res["step_ms"]]
        if mbs:
            ax.plot(mbs, [res["step_ms"][mb] for mb in mbs], marker="o", label=name,
                    linestyle="-" if name.startswith("autocudagraph") else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(mb) for mb in sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"micro-batch (x {SEQ} tokens)")
    ax.set_ylabel("ms per training step (median)")
    ax.grid(True, alpha=0.3)
    save_figure(fig, ax, out_dir, "training_step_time.png",
                f"training step, {LAYERS} blocks, hidden {HIDDEN}, bf16, {device}")


def print_table(sizes, results, checks, device) -> None:
    print(f"\nCorrectness at micro-batch {CHECK_MB}, one step from the initial weights, max abs difference vs eager:")
    for name, c in checks.items():
        print(f"  {name:>30}: loss {c['loss_diff']:.3g}, block 0 qkv.weight grad "
              f"{c['block0_qkv_weight_grad_diff']:.3g}, any grad {c['max_grad_diff']:.3g}")
    for name in (AUTO_BLOCKS, AUTO_STACK):
        s = results[name].get("stats")
        if s:
            memory = "n/a" if s["graph_memory_bytes"] is None else f"{s['graph_memory_bytes'] / 2**20:.0f} MiB"
            reasons = f" {s['fallback_reasons']}" if s["fallback_reasons"] else ""
            print(f"{name}: {s['graphs']} graphs, {s['replays']} replays, {s['backward_replays']} backward replays, "
                  f"{s['warmups']} warm-up calls, {s['fallbacks']} fallbacks{reasons}, "
                  f"graph_memory_bytes {memory}")
    skips = results[COMPILE].get("cudagraph_skips")
    if skips:
        print(f"{COMPILE}: Inductor skipped CUDA graphs {skips} times (its rows are then not graphed)")

    def ratio(name, ref):
        a, b = results[name]["step_ms"].get(CHECK_MB), results[ref]["step_ms"].get(CHECK_MB)
        return f"{a / b:.2f}x" if a and b else "-"

    head = [f"mb {mb} ms" for mb in sizes] + [f"vs eager @{CHECK_MB}", f"vs mgc @{CHECK_MB}", "capture s",
                                               "graph MiB", "reserved +MiB"]
    rows = []
    for name, res in results.items():
        if res["failed"] and not res["step_ms"]:
            rows.append([name, f"failed: {res['failed']}"])
            continue
        mem = res["memory_mib"]
        cells = [f"{res['step_ms'][mb]:.2f}" if mb in res["step_ms"] else "-" for mb in sizes]
        cells += [ratio(name, EAGER), ratio(name, MGC),
                  "-" if res["capture_seconds"] is None else f"{res['capture_seconds']:.2f}",
                  f"{mem['graph_pools']:.0f}" if mem else "-", f"{mem['reserved_growth']:.0f}" if mem else "-"]
        if res["failed"]:
            cells.append(f"failed: {res['failed']}")
        rows.append([name] + cells)
    print(f"\nTraining step, {LAYERS} blocks x hidden {HIDDEN}, seq {SEQ}, bf16, {device}, torch {torch.__version__}")
    print("| variant | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 1) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"Ratios: step time at micro-batch {CHECK_MB} over eager's / make_graphed_callables' (below 1: faster). "
          "graph MiB: private graph pools, all sizes.", flush=True)


def main(argv: Optional[List[str]] = None, prog: str = "python -m graph_opt.benchmarks.torch_training") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results", help="folder for training_bench.json and the plot (default results)")
    parser.add_argument("--quick", action="store_true",
                        help=f"micro-batches {QUICK_MICRO_BATCHES}, 15 timed steps, torch.compile at {CHECK_MB} only")
    args = parser.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
