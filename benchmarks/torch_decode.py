"""GPU benchmark of a greedy decode loop on PyTorch: blocking host reads vs async host outputs (one NVIDIA GPU).

    python -m graph_opt.benchmarks.torch_decode [--quick] [--out results]
    python -m graph_opt bench decode [--quick] [--out results]

Model (DecodeStep): hidden 1024, 8 layers, vocab 32000, bf16, no KV cache. Each layer: LayerNorm, MLP
1024 -> 4096 -> 1024 (tanh GELU), residual. No token-mixing op: sequences are independent rows. The
head (32000 x 1024, no bias) is about a third of the weight bytes read per step, the 8 MLPs the rest.
Inputs: state [batch, 1024] bf16, step [batch] int32 (tokens generated so far), limits [batch] int32
(each sequence's max length). One step:

    h = norm(layers(state)); next_tokens = head(h).argmax(-1); step = step + 1
    stop = ((next_tokens == EOS) & (2 * step >= limits)) | (step >= limits)
    returns {"next_tokens", "stop", "state": embed(next_tokens) + h, "step"}

The limits are drawn per sequence from a seeded RNG, uniform in [max_steps / 2, max_steps] (128..256,
with --quick 64..128), so sequences stop at different steps; EOS (id 2) may stop one earlier, but not
before half its limit, so that no decode is a few steps long (the count of EOS stops is reported). A
sequence's tokens are those of its steps up to and including the one whose stop flag was first set.
The loop stops once every sequence has stopped, after max_steps at most (256; with --quick 128).
Batches 1, 8, 64 (--quick: 1, 8); the capture sizes are those batches, no padding. Level 0, full
graph: one CUDA graph per batch, captured by graph_opt.capture_model.

Variants, each a fresh model with the same weights (same seed), graphs captured:
- sync: launch step k, read out["next_tokens"].cpu() and out["stop"].cpu() (blocking), update the
  done flags, decide, launch step k+1;
- to_host_async, lag 1: launch step k, fut_k = graph_opt.to_host_async({"t": tokens, "s": stop}) at
  once; launch step k+1 and issue fut_k+1; then fut_k.result(), update, decide. The step launched after
  the last sequence stopped is discarded;
- host_outputs, lag 1: the model class decorated with host_outputs=["next_tokens", "stop"],
  host_ring_depth=2: the copies into pinned memory are the last nodes of each step's graph (one launch,
  one event per step); the same lagged loop reading out["next_tokens"].result() and out["stop"].result().
The host bookkeeping (numpy) is the same in all three. The three must give identical token sequences
(every sequence of every batch and every run is compared with sync's); a difference fails the run (exit 1).

Per variant and batch, one warm-up decode, then 21 timed decodes (--quick: 7), the variants
taking turns in a rotating order so that a drift of the host's speed hits all alike. From the timed
decodes (medians over runs, or over all their steps):
- tokens/s: useful tokens, i.e. the sum over sequences of their lengths (tokens after a sequence's stop
  are not counted), over the decode's wall time. The wall time runs from the first launch to the end of
  the loop plus a torch.cuda.synchronize() (the discarded extra step of the lagged loops is included);
  steps*batch/s is also in the JSON;
- step µs: the time between the moments the host has step k's and step k+1's tokens (median over steps);
- blocked µs/step: host time inside the blocking reads per step: both .cpu() calls for sync, result()
  for to_host_async, both result() calls for host_outputs (median and mean over steps).
A separate decode per variant and batch runs under torch.profiler (ProfilerActivity.CUDA only): its
device events (kernels, memcpys, memsets, every stream) are merged into busy intervals. The step
boundaries are the ends of each step's last device work: its device-to-host copies (sync, to_host_async)
or the kernel that advances the ring slot, the last node of the graph (host_outputs). Over a window of 30 steps from the middle of the decode: GPU idle µs/step = (window span -
busy) / 30, which also counts the gaps between the kernels inside a graph (the same in every variant);
and "between steps": from a step's last device-to-host copy to the next step's first device event.
GPU busy µs/step is in the JSON. The profiled decodes run after all timed ones, which run without it.

Writes <out>/decode_bench.json and, with matplotlib, <out>/decode_tokens_per_s.png; prints the table
last, with the targets (to_host_async >= 1.15x sync's tokens/s at batches 1 and 8; blocked <= 5 µs per
step; GPU idle between steps near zero: <= 5 µs) marked met or not; they do not change the exit status.
Exits 1 if the token sequences differ, 0 otherwise (also without a CUDA device).
"""
from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .report import grouped_bars, new_figure, save_figure, write_json

import graph_opt

HIDDEN, LAYERS, VOCAB, MLP = 1024, 8, 32000, 4096
DTYPE = torch.bfloat16
EOS = 2
BATCHES, QUICK_BATCHES = [1, 8, 64], [1, 8]
MAX_STEPS, QUICK_MAX_STEPS = 256, 128
RUNS, QUICK_RUNS = 21, 7
WINDOW = 30  # steps in the profiled window
SEED = 0

SYNC, ASYNC, HOST_OUT = "sync", "to_host_async, lag 1", "host_outputs, lag 1"
VARIANTS = [SYNC, ASYNC, HOST_OUT]
TARGET_SPEEDUP, TARGET_SPEEDUP_BATCHES, TARGET_BLOCKED_US, TARGET_IDLE_US = 1.15, (1, 8), 5.0, 5.0


# -- the model --------------------------------------------------------------------------------------
class Layer(torch.nn.Module):
    def __init__(self, hidden, mlp):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, mlp)
        self.fc2 = torch.nn.Linear(mlp, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class DecodeStep(torch.nn.Module):
    """One greedy decode step; see the module docstring. Undecorated: the variants decorate subclasses."""

    def __init__(self, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB, mlp=MLP, eos=EOS):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, mlp) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.eos = eos

    def forward(self, state, step, limits):
        x = state
        for layer in self.layers:
            x = layer(x)
        h = self.norm(x)
        next_tokens = self.head(h).argmax(-1)
        step = step + 1
        # EOS stops a sequence once it has half its max length (a minimum length, as min_new_tokens)
        stop = ((next_tokens == self.eos) & (2 * step >= limits)) | (step >= limits)
        return {"next_tokens": next_tokens, "stop": stop, "state": self.embed(next_tokens) + h, "step": step}


@graph_opt.support_graph_optimization
class Decoder(DecodeStep):
    pass


@graph_opt.support_graph_optimization(host_outputs=["next_tokens", "stop"], host_ring_depth=2)
class HostDecoder(DecodeStep):
    pass


def build(cls, batches: List[int], device: str = "cuda", dims: Optional[dict] = None):
    """A model of `cls` with graphs captured at `batches`; every call has the same weights."""
    dims = dims or {}
    torch.manual_seed(SEED)
    cfg = graph_opt.GraphOptConfig(use_cudagraph=True, graph_opt_level=0, cudagraph_capture_sizes=sorted(batches))
    m = cls(graph_opt_config=cfg, **dims).to(device=device, dtype=DTYPE).eval()
    hidden = m.norm.normalized_shape[0]

    def make_inputs(n):
        return {"state": torch.randn(n, hidden, device=device, dtype=DTYPE),
                "step": torch.zeros(n, device=device, dtype=torch.int32),
                "limits": torch.full((n,), 1 << 30, device=device, dtype=torch.int32)}

    report = graph_opt.capture_model(m, make_inputs=make_inputs, progress=False)
    if report.failed:
        raise RuntimeError(f"{cls.__name__}: capture failed: {report.failed}")
    return m


def decode_inputs(batch: int, max_steps: int, device: str = "cuda", hidden: int = HIDDEN):
    """The first step's inputs of a decode at `batch`: seeded, the same for every variant and run."""
    g = torch.Generator().manual_seed(SEED + 1000 + batch)
    state = torch.randn(batch, hidden, generator=g, dtype=torch.float32).to(device=device, dtype=DTYPE)
    rng = np.random.default_rng(SEED + batch)
    limits = rng.integers(max_steps // 2, max_steps, size=batch, endpoint=True).astype(np.int32)
    return (state, torch.zeros(batch, device=device, dtype=torch.int32),
            torch.from_numpy(limits).to(device))


# -- the decode loops -------------------------------------------------------------------------------
def wait_device(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class Book:
    """The host side of a decode: each step's tokens, the done flags and each sequence's length."""

    def __init__(self, batch: int, max_steps: int):
        self.tokens = np.zeros((max_steps, batch), dtype=np.int64)
        self.done = np.zeros(batch, dtype=bool)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.eos_stops = 0
        self.steps = 0  # steps whose tokens the host has read

    def add(self, k: int, tokens, stop) -> bool:
        """Step k's tokens and stop flags; True once every sequence has stopped."""
        self.tokens[k] = tokens
        newly = stop & ~self.done
        self.lengths[newly] = k + 1
        self.eos_stops += int(np.count_nonzero(newly & (tokens == EOS)))
        self.done |= stop
        self.steps = k + 1
        return bool(self.done.all())

    def finish(self) -> None:
        self.lengths[~self.done] = self.steps  # max_steps reached first (not with limits <= max_steps)


class Run:
    """One decode's timings and tokens."""

    def __init__(self, book: Book, launched: int, wall_s: float, step_s: List[float], blocked_s: List[float]):
        self.book, self.launched, self.wall_s = book, launched, wall_s
        self.step_s, self.blocked_s = step_s, blocked_s

    @property
    def useful_tokens(self) -> int:
        return int(self.book.lengths.sum())


def decode_sync(m, inputs, max_steps: int) -> Run:
    state, step, limits = inputs
    book = Book(state.shape[0], max_steps)
    steps_s, blocked = [], []
    clock = time.perf_counter
    t0 = last = clock()
    launched = 0
    for k in range(max_steps):
        out = m(state, step, limits)
        launched += 1
        b = clock()
        tokens = out["next_tokens"].cpu()
        stop = out["stop"].cpu()
        blocked.append(clock() - b)
        all_done = book.add(k, tokens.numpy(), stop.numpy())
        now = clock()
        steps_s.append(now - last)
        last = now
        if all_done:
            break
        state, step = out["state"], out["step"]
    wait_device(state)
    wall = clock() - t0
    book.finish()
    return Run(book, launched, wall, steps_s, blocked)


def decode_lagged(m, inputs, max_steps: int, issue: Callable, read: Callable) -> Run:
    """Launch step k+1, then read step k: issue(out) starts step k's host copy right after its launch
    (before the next launch rewrites its outputs); read(handle) -> (tokens, stop) as numpy."""
    state, step, limits = inputs
    book = Book(state.shape[0], max_steps)
    steps_s, blocked = [], []
    clock = time.perf_counter
    t0 = last = clock()
    out = m(state, step, limits)
    handle = issue(out)
    launched = 1
    nxt = nhandle = None
    for k in range(max_steps):
        nxt = nhandle = None
        if k + 1 < max_steps:
            nxt = m(out["state"], out["step"], limits)  # launch step k+1 while step k may still run
            nhandle = issue(nxt)
            launched += 1
        b = clock()
        tokens, stop = read(handle)  # step k's values
        blocked.append(clock() - b)
        all_done = book.add(k, tokens, stop)
        now = clock()
        steps_s.append(now - last)
        last = now
        if all_done:
            break  # nxt and its copy (one extra step) are discarded
        out, handle = nxt, nhandle
    del nxt, nhandle, handle, out
    wait_device(state)
    wall = clock() - t0
    book.finish()
    return Run(book, launched, wall, steps_s, blocked)


def _read_tree(fut):
    host = fut.result()
    return host["t"], host["s"]


def decode_to_host_async(m, inputs, max_steps: int) -> Run:
    issue = lambda out: graph_opt.to_host_async({"t": out["next_tokens"], "s": out["stop"]})  # noqa: E731
    return decode_lagged(m, inputs, max_steps, issue, _read_tree)


def decode_host_outputs(m, inputs, max_steps: int) -> Run:
    """The model's host_outputs are HostFutures already, issued right after each launch."""
    return decode_lagged(m, inputs, max_steps, issue=lambda out: out,
                         read=lambda out: (out["next_tokens"].result(), out["stop"].result()))


LOOPS: Dict[str, Callable] = {SYNC: decode_sync, ASYNC: decode_to_host_async, HOST_OUT: decode_host_outputs}
CLASSES = {SYNC: Decoder, ASYNC: Decoder, HOST_OUT: HostDecoder}


def same_tokens(a: Book, b: Book) -> Optional[str]:
    """None when both decodes gave the same sequences, else where they first differ."""
    if not np.array_equal(a.lengths, b.lengths):
        i = int(np.nonzero(a.lengths != b.lengths)[0][0])
        return f"sequence {i}: length {a.lengths[i]} vs {b.lengths[i]}"
    for i, n in enumerate(a.lengths):
        diff = np.nonzero(a.tokens[:n, i] != b.tokens[:n, i])[0]
        if diff.size:
            k = int(diff[0])
            return f"sequence {i}, step {k}: token {a.tokens[k, i]} vs {b.tokens[k, i]}"
    return None


# -- GPU idle time from the profiler ----------------------------------------------------------------
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> List[dict]:
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "ts" in e and "dur" in e]


def busy_us(intervals, lo: float, hi: float) -> float:
    """Length of the union of the intervals, clipped to [lo, hi]."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def ends_with_host_copy(e: dict) -> bool:
    return e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")


def ends_with_slot_advance(e: dict) -> bool:
    """The host_outputs graph's last node: the ring slot counter's remainder_ (the model has no other)."""
    return e.get("cat") == "kernel" and "remainder" in e.get("name", "")


STEP_END = {SYNC: ends_with_host_copy, ASYNC: ends_with_host_copy, HOST_OUT: ends_with_slot_advance}


def gpu_idle(events: List[dict], launched: int, read: int, window: int = WINDOW,
             step_end: Callable[[dict], bool] = ends_with_host_copy) -> dict:
    """Idle and busy µs per step over a window of steps from the middle of a profiled decode.

    events: the decode's device events; launched: steps launched; read: steps whose tokens were read.
    Step k ends with the events step_end picks: the same number per step."""
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    res = {"events": len(events), "window_steps": None, "idle_us_per_step": None,
           "between_steps_us_per_step": None, "busy_us_per_step": None, "note": None}
    if not intervals:
        res["note"] = "no device events in the trace"
        return res
    d2h = sorted((e for e in events if step_end(e)), key=lambda e: float(e["ts"]))
    per = len(d2h) // launched if launched else 0
    if per == 0 or per * launched != len(d2h) or read < 3:
        lo, hi = min(s for s, _ in intervals), max(e for _, e in intervals)
        busy = busy_us(intervals, lo, hi)
        res.update(window_steps=launched, idle_us_per_step=(hi - lo - busy) / launched,
                   busy_us_per_step=busy / launched,
                   note=f"{len(d2h)} step-end events for {launched} steps: no step boundaries; "
                        "whole decode, first to last device event")
        return res
    ends = [max(float(e["ts"]) + float(e["dur"]) for e in d2h[k * per:(k + 1) * per]) for k in range(launched)]
    w = min(window, read - 2)
    a = max(1, (read - w) // 2)
    lo, hi = ends[a - 1], ends[a + w - 1]
    busy = busy_us(intervals, lo, hi)
    starts = sorted(s for s, _ in intervals)
    between = []
    for k in range(a, a + w):
        i = bisect.bisect_left(starts, ends[k - 1])  # step k's first device event
        if i < len(starts):
            between.append(starts[i] - ends[k - 1])
    res.update(window_steps=w, window_first_step=a, idle_us_per_step=(hi - lo - busy) / w,
               between_steps_us_per_step=statistics.mean(between) if between else None,
               busy_us_per_step=busy / w)
    return res


def profiled_idle(loop: Callable, m, inputs, max_steps: int, step_end=ends_with_host_copy) -> dict:
    from torch.profiler import ProfilerActivity, profile

    wait_device(inputs[0])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = loop(m, inputs, max_steps)
        wait_device(inputs[0])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)
    return gpu_idle(device_events(trace), run.launched, run.book.steps, step_end=step_end)


# -- measuring --------------------------------------------------------------------------------------
def summarize(runs: List[Run]) -> dict:
    step_us = [s * 1e6 for r in runs for s in r.step_s]
    blocked_us = [s * 1e6 for r in runs for s in r.blocked_s]
    return {
        "runs": len(runs),
        "tokens_per_s": statistics.median([r.useful_tokens / r.wall_s for r in runs]),
        "steps_x_batch_per_s": statistics.median([r.book.steps * r.book.done.size / r.wall_s for r in runs]),
        "wall_ms": statistics.median([r.wall_s * 1e3 for r in runs]),
        "step_us": statistics.median(step_us),
        "blocked_us_median": statistics.median(blocked_us),
        "blocked_us_mean": statistics.mean(blocked_us),
        "steps_read": runs[0].book.steps,
        "steps_launched": runs[0].launched,
        "useful_tokens": runs[0].useful_tokens,
        "eos_stops": runs[0].book.eos_stops,
    }


def model_inputs(models: Dict[str, torch.nn.Module], batch: int, max_steps: int):
    m = next(iter(models.values()))
    return decode_inputs(batch, max_steps, device=m.norm.weight.device.type, hidden=m.norm.normalized_shape[0])


def measure_batch(models: Dict[str, torch.nn.Module], batch: int, max_steps: int, runs: int) -> dict:
    """At one batch: a warm-up decode per variant, then `runs` timed decodes per variant in rotating
    order; every decode's tokens are compared with sync's warm-up decode."""
    inputs = model_inputs(models, batch, max_steps)
    timed: Dict[str, List[Run]] = {name: [] for name in models}
    reference = None
    mismatches: List[str] = []

    def one(name: str) -> Run:
        gc.collect()
        wait_device(inputs[0])
        return LOOPS[name](models[name], inputs, max_steps)

    def check(name: str, run: Run) -> None:
        problem = same_tokens(reference.book, run.book)
        if problem is not None and len(mismatches) < 10:
            mismatches.append(f"batch {batch}, {name}: {problem}")

    with torch.no_grad():
        for name in models:  # warm-up: the first decode of each variant; sync's is the reference
            run = one(name)
            if reference is None:
                reference = run
            check(name, run)
        names = list(models)
        for r in range(runs):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                run = one(name)
                check(name, run)
                timed[name].append(run)
    res = {name: summarize(v) for name, v in timed.items()}
    for name, r in res.items():
        print(f"{name:>22} bs {batch:>3}: {r['tokens_per_s']:9.0f} tokens/s, step {r['step_us']:7.1f} µs, "
              f"blocked {r['blocked_us_median']:7.1f} µs/step", flush=True)
    return {"variants": res, "mismatches": mismatches,
            "sequence_lengths": {"min": int(reference.book.lengths.min()), "max": int(reference.book.lengths.max())}}


def profile_batch(models: Dict[str, torch.nn.Module], batch: int, max_steps: int, result: dict) -> None:
    """One profiled decode per variant at one batch; its GPU idle time goes into result's variants."""
    inputs = model_inputs(models, batch, max_steps)
    with torch.no_grad():
        for name in models:
            gc.collect()
            try:
                gpu = profiled_idle(LOOPS[name], models[name], inputs, max_steps, STEP_END[name])
            except Exception as exc:  # noqa: BLE001 - the timings stand without it
                gpu = {"note": f"profiler failed: {type(exc).__name__}: {exc}"}
            result["variants"][name]["gpu"] = gpu
            print(f"{name:>22} bs {batch:>3}: GPU idle {_us(gpu.get('idle_us_per_step'))} µs/step, between steps "
                  f"{_us(gpu.get('between_steps_us_per_step'))}, busy {_us(gpu.get('busy_us_per_step'))}"
                  + (f" ({gpu['note']})" if gpu.get("note") else ""), flush=True)


def run(out_dir: str, quick: bool) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    batches = QUICK_BATCHES if quick else BATCHES
    max_steps = QUICK_MAX_STEPS if quick else MAX_STEPS
    runs = QUICK_RUNS if quick else RUNS
    t0 = time.perf_counter()
    models = {name: build(CLASSES[name], batches) for name in VARIANTS}
    capture_s = time.perf_counter() - t0
    results = {bs: measure_batch(models, bs, max_steps, runs) for bs in batches}
    for bs in batches:  # after every timed decode: the profiler may leave costs behind
        profile_batch(models, bs, max_steps, results[bs])
    for bs in batches:
        results[bs]["result_on_finished_copy_us"] = result_cost_us(bs)
    identical = not any(r["mismatches"] for r in results.values())
    device = torch.cuda.get_device_name()
    st = graph_opt.stats(models[HOST_OUT])
    copies = {"in_graph": st.host_copies_in_graph, "streamed": st.host_copies_streamed,
              "graphs_per_size": st.graphs}
    print(f"host_outputs: {copies['in_graph']} steps copied inside their graph, {copies['streamed']} after it; "
          f"graphs per size {copies['graphs_per_size']}", flush=True)
    write_results(out_dir, batches, max_steps, runs, results, identical, capture_s, device, copies)
    print_table(batches, max_steps, results, identical, device)
    return 0 if identical else 1


def result_cost_us(batch: int, samples: int = 200) -> float:
    """Median µs of HostFuture.result() on a copy already finished: its own cost, without waiting for
    the GPU. The rest of a loop's blocked time is the GPU still running the step being read."""
    import graph_opt

    tokens = torch.zeros(batch, dtype=torch.int64, device="cuda")
    stop = torch.zeros(batch, dtype=torch.bool, device="cuda")
    times = []
    for _ in range(samples):
        fut = graph_opt.to_host_async({"t": tokens, "s": stop})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut.result()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# -- output -----------------------------------------------------------------------------------------
def targets(batches, results) -> List[str]:
    lines = []
    sp = {bs: results[bs]["variants"][ASYNC]["tokens_per_s"] / results[bs]["variants"][SYNC]["tokens_per_s"]
          for bs in batches if bs in TARGET_SPEEDUP_BATCHES}
    if sp:
        ok = all(v >= TARGET_SPEEDUP for v in sp.values())
        lines.append(f"- {ASYNC} >= {TARGET_SPEEDUP:.2f}x sync's tokens/s at batches "
                     f"{', '.join(map(str, sp))}: {'met' if ok else 'NOT met'} ("
                     + ", ".join(f"bs {bs}: {v:.2f}x" for bs, v in sp.items()) + ")")
    for name in (ASYNC, HOST_OUT):
        blocked = {bs: results[bs]["variants"][name]["blocked_us_median"] for bs in batches}
        ok = all(v <= TARGET_BLOCKED_US for v in blocked.values())
        lines.append(f"- {name}: blocked <= {TARGET_BLOCKED_US:.0f} µs per step (median): "
                     f"{'met' if ok else 'NOT met'} (" + ", ".join(f"bs {bs}: {v:.1f}" for bs, v in blocked.items())
                     + ")")
        between = {bs: results[bs]["variants"][name].get("gpu", {}).get("between_steps_us_per_step")
                   for bs in batches}
        if all(v is not None for v in between.values()):
            ok = all(v <= TARGET_IDLE_US for v in between.values())
            lines.append(f"- {name}: GPU idle between steps near zero (<= {TARGET_IDLE_US:.0f} µs): "
                         f"{'met' if ok else 'NOT met'} (" + ", ".join(f"bs {bs}: {v:.1f}" for bs, v in between.items())
                         + ")")
        else:
            lines.append(f"- {name}: GPU idle between steps: not measured (see the JSON's gpu notes)")
    return lines


def write_results(out_dir, batches, max_steps, runs, results, identical, capture_s, device, copies) -> None:
    summary = {
        "device": device, "torch": torch.__version__,
        "model": {"hidden": HIDDEN, "layers": LAYERS, "vocab": VOCAB, "mlp": MLP, "dtype": "bfloat16", "eos": EOS,
                  "limits": f"uniform in [{max_steps // 2}, {max_steps}] per sequence, seeded"},
        "batches": batches, "max_steps": max_steps, "timed_runs": runs, "profiled_window_steps": WINDOW,
        "capture_seconds_all_models": capture_s,
        "tokens_per_s_counts": "useful tokens: each sequence's tokens up to and including its stop",
        "tokens_identical": identical, "results": {str(bs): r for bs, r in results.items()},
        "host_outputs_copies": copies,
        "targets": targets(batches, results),
    }
    write_json(out_dir, "decode_bench.json", summary)
    plot(out_dir, batches, results, device)


def plot(out_dir, batches, results, device) -> None:
    figure = new_figure()
    if figure is None:
        return
    fig, ax = figure
    grouped_bars(ax, batches, {name: [results[bs]["variants"][name]["tokens_per_s"] for bs in batches]
                               for name in VARIANTS})
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("useful tokens/s (median)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save_figure(fig, ax, out_dir, "decode_tokens_per_s.png",
                f"greedy decode, {LAYERS} layers x hidden {HIDDEN}, vocab {VOCAB}, bf16, {device}")


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_table(batches, max_steps, results, identical, device) -> None:
    print(f"\ntokens identical: {'yes' if identical else 'NO'}")
    for bs in batches:
        for line in results[bs]["mismatches"]:
            print(f"  {line}")
        lengths = results[bs]["sequence_lengths"]
        eos = results[bs]["variants"][SYNC]["eos_stops"]
        print(f"  bs {bs}: sequence lengths {lengths['min']}..{lengths['max']}, {eos} stopped at EOS")
    print(f"\nGreedy decode, {LAYERS} layers x hidden {HIDDEN}, vocab {VOCAB}, bf16, up to {max_steps} steps, "
          f"{device}, torch {torch.__version__}")
    head = ["variant", "batch", "tokens/s", "vs sync", "step µs", "blocked µs/step (median / mean)",
            "GPU idle µs/step (all / between steps)"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for bs in batches:
        sync = results[bs]["variants"][SYNC]["tokens_per_s"]
        for name in VARIANTS:
            r = results[bs]["variants"][name]
            gpu = r.get("gpu", {})
            print(f"| {name} | {bs} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / sync:.2f}x | {r['step_us']:.1f} | "
                  f"{r['blocked_us_median']:.1f} / {r['blocked_us_mean']:.1f} | "
                  f"{_us(gpu.get('idle_us_per_step'))} / {_us(gpu.get('between_steps_us_per_step'))} |")
    print("tokens/s: useful tokens (each sequence's up to its stop) over the decode's wall time; medians over "
          f"timed decodes. GPU idle: profiled decode, {WINDOW}-step window; 'all' includes the gaps between the "
          "kernels inside a graph, 'between steps' is last device-to-host copy -> next step's first device event.")
    print("result() on a finished copy (its own cost, no GPU wait), median µs: "
          + ", ".join(f"bs {bs}: {results[bs]['result_on_finished_copy_us']:.1f}" for bs in batches))
    print("Targets (informational):")
    for line in targets(batches, results):
        print(line)
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None, prog: str = "python -m graph_opt.benchmarks.torch_decode") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results", help="folder for decode_bench.json and the plot (default results)")
    parser.add_argument("--quick", action="store_true",
                        help=f"batches {QUICK_BATCHES}, up to {QUICK_MAX_STEPS} steps, {QUICK_RUNS} timed decodes")
    args = parser.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
