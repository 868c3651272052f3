"""GPU benchmark of the torch frontend on a decoder-like stack (one NVIDIA GPU).

    python -m graph_opt.benchmarks.torch_gpu [--out results] [--quick]

Model: hidden 1024, 24 layers, bf16. Each layer: LayerNorm, QKV Linear, decode attention over a
128-token cache (F.scaled_dot_product_attention inside a torch.library custom op: the splitting
op), out projection, LayerNorm, MLP 1024 -> 4096 -> 1024. One token per sequence; the batch is the
dynamic dimension.

Columns, each the median time per call of back-to-back calls (throughput), input copy included:
eager; a hand-written torch.cuda.CUDAGraph of the whole forward (the limit); the plugin at level 0
with one graph per size (full) and split at attention (piecewise); level 1 piecewise (Dynamo); level
2 full graph (Inductor); torch.compile(mode="reduce-overhead"). Also: capture time and graph memory
for the 35 default sizes, and the plugin's host time per call over a raw replay(). Host time only:
the same decoder whose attention writes into a buffer each layer allocates (attention_into, as
vLLM's attention with an output argument), piecewise at levels 0 and 1 and its pieces by hand.

Writes <out>/torch_gpu_bench.md and <out>/torch_gpu_bench.png; prints the table last.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import graph_opt
from graph_opt.decorator import state_of

from .demo import MixedKey
from .report import new_figure, save_figure, write_json

HIDDEN, LAYERS, HEADS, CACHE_LEN, MLP = 1024, 24, 16, 128, 4096
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@torch.library.custom_op("graph_opt_bench::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


@attention_op.register_fake
def _(q, k, v):
    return torch.empty_like(q)


@graph_opt.splitting_op(name="attention")
def attention(q, k, v):
    """Level 0 splits at this Python function; level >= 1 splits at the custom op by its name.

    The op is called through torch.ops (the dispatcher) rather than the custom_op wrapper object:
    it runs eagerly 24 times per piecewise replay, and the wrapper's Python costs add up there."""
    return torch.ops.graph_opt_bench.attention.default(q, k, v)


@torch.library.custom_op("graph_opt_bench::attention_into", mutates_args=("out",))
def attention_into_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Decode attention that writes its result into `out` (the last matmul's output argument), as
    attention kernels with an output argument do (vLLM's unified_attention_with_output)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    torch.matmul(torch.softmax(scores, dim=-1), v, out=out)


@graph_opt.splitting_op(name="attention_into")
def attention_into(q, k, v, out):
    """Level 0 splits here; level >= 1 at the custom op. Returns the buffer it was given: nothing to copy."""
    torch.ops.graph_opt_bench.attention_into.default(q, k, v, out)
    return out


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden, heads, k_cache, v_cache, mlp, into=False):
        super().__init__()
        self.heads = heads
        self.into = into  # attention writes into a buffer the layer allocates (attention_into)
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, mlp)
        self.fc2 = torch.nn.Linear(mlp, hidden)
        self.register_buffer("k_cache", k_cache, persistent=False)
        self.register_buffer("v_cache", v_cache, persistent=False)

    def forward(self, x):
        bs, hidden = x.shape
        q = self.qkv(self.ln1(x))[:, :hidden].reshape(bs, self.heads, 1, hidden // self.heads)
        if self.into:
            a = attention_into(q, self.k_cache[:bs], self.v_cache[:bs], torch.empty_like(q))
        else:
            a = attention(q, self.k_cache[:bs], self.v_cache[:bs])
        x = x + self.out(a.reshape(bs, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


@graph_opt.support_graph_optimization
class Decoder(torch.nn.Module):
    """kv: (k, v) caches of shape [layers, max batch, heads, cache length, hidden // heads] (make_kv)."""

    def __init__(self, kv, hidden=HIDDEN, heads=HEADS, mlp=MLP, into=False):
        super().__init__()
        layers = kv[0].shape[0]
        self.layers = torch.nn.ModuleList(DecoderLayer(hidden, heads, kv[0][i], kv[1][i], mlp, into)
                                          for i in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


DispatchedDecoder = graph_opt.support_graph_optimization(type("DispatchedDecoder", (Decoder,), {}),
                                                         dispatch_key_fn=MixedKey(every=5))


def make_kv(layers=LAYERS, max_batch=256, heads=HEADS, cache_len=CACHE_LEN, hidden=HIDDEN,
            dtype=torch.bfloat16, device="cuda", seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (layers, max_batch, heads, cache_len, hidden // heads)
    return tuple(torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(2))


def build(config: Optional[graph_opt.GraphOptConfig], kv, dtype=torch.bfloat16, seed=0, cls=None, **dims):
    """A Decoder on the GPU; every call with the same seed has the same weights. kv is shared, not copied.
    cls: DispatchedDecoder for cudagraph_mode full_and_piecewise."""
    torch.manual_seed(seed)
    cfg = config or graph_opt.GraphOptConfig(use_cudagraph=False)
    m = (cls or Decoder)(kv, graph_opt_config=cfg, **dims).to(device="cuda", dtype=dtype).eval()
    for layer, k, v in zip(m.layers, *kv):  # .to() keeps these, but say so: the caches are shared
        layer.k_cache, layer.v_cache = k, v
    return m


# -- timing ---------------------------------------------------------------------------------------
def paired_us(samples: Dict[str, List[float]], a: str, b: str) -> float:
    """Median over rounds of a's time minus b's in the same round: a difference of a few microseconds
    that the host's drift between rounds (several microseconds on a shared host) does not swamp."""
    return statistics.median(x - y for x, y in zip(samples[a], samples[b]))


def device_us(fn: Callable, x, calls: int, repeats: int) -> float:
    """Median over `repeats` of the device time per call of `calls` back-to-back calls."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def host_us(fns: Dict[str, Callable], x, calls: int = 40, rounds: int = 31,
            samples: Optional[Dict[str, List[float]]] = None) -> Dict[str, float]:
    """Median host time per call of each fn. Rounds alternate between the fns, so that a drift of the
    host's speed hits all alike; few enough calls per sample that the launch queue never blocks (checked
    on the H200 for the piecewise model too: 1, 2, 4 or 40 calls per sample agree within 10%).
    samples: filled with each fn's per-round times, for differences paired by round (paired_us)."""
    samples = {} if samples is None else samples
    samples.update({name: [] for name in fns})
    for fn in fns.values():
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            samples[name].append((time.perf_counter() - t0) * 1e6 / calls)
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


class HandGraphs:
    """One torch.cuda.CUDAGraph of `forward` per batch size, each on a static copy of its example input
    (xs: batch -> input tensor): one pool, largest first; a call copies the input in and replays."""

    def __init__(self, forward: Callable, xs):
        self.graphs, self.inputs, self.outputs = {}, {}, {}
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in sorted(xs, reverse=True):
            x = xs[bs].clone()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward(x)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                out = forward(x)
            self.graphs[bs], self.inputs[bs], self.outputs[bs] = g, x, out

    def __call__(self, x):
        bs = x.shape[0]
        self.inputs[bs].copy_(x)
        self.graphs[bs].replay()
        return self.outputs[bs]


def model_hand_graphs(model, batches, dtype) -> HandGraphs:
    """HandGraphs of the whole forward of the bench decoder, no_grad, on zero inputs per batch size."""
    width = model.norm.normalized_shape[0]
    with torch.no_grad():
        return HandGraphs(functools.partial(type(model).forward, model),
                          {bs: torch.zeros(bs, width, device="cuda", dtype=dtype) for bs in batches})


def raw_pieces(m, bs: int) -> Callable:
    """The piecewise replay of size bs without the plugin: the input's copy_, each piece's graph.replay()
    and each splitting op's own function on the tensors it read at capture, in order (what the plugin's
    host time per call is compared with; the landing copies of the split results are the plugin's own
    work)."""
    from graph_opt.capture.level0 import _SplitStep

    entry = next(sig.entries[bs] for sig in state_of(m).runner.signatures.values() if bs in sig.entries)
    (static,) = entry.inputs
    graphs = [obj for obj in entry.captured.keepalive if not isinstance(obj, _SplitStep)]
    splits = [obj for obj in entry.captured.keepalive if isinstance(obj, _SplitStep)]
    steps = []
    for i, g in enumerate(graphs):
        steps.append(g.replay)
        if i < len(splits):
            split = splits[i]
            steps.append(lambda s=split: s.op.fn(*s.args, **s.kwargs))

    def run(x):
        static.copy_(x)
        for step in steps:
            step()

    run.pieces = len(graphs)
    return run


def level_config(level, full, sizes, split_ops=None):
    return graph_opt.GraphOptConfig(graph_opt_level=level, full_cuda_graph=full, cudagraph_capture_sizes=sizes,
                                    cudagraph_splitting_ops=split_ops)


def plugin_modes(batches):
    """name -> config of every plugin column."""
    return {
        "plugin full (L0)": level_config(0, True, batches),
        "plugin full (L1)": level_config(1, True, batches),
        "plugin piecewise (L0)": level_config(0, False, batches),
        "plugin piecewise (L1)": level_config(1, False, batches, ["graph_opt_bench::attention"]),
        "plugin level 2 (full)": level_config(2, True, batches),
        MIXED: graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_mode="full_and_piecewise",
                                        cudagraph_capture_sizes=batches),
    }


MIXED = "plugin full+piecewise (L0, 80% full)"


def run(out_dir: str, quick: bool) -> int:
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = [1, 8, 64] if quick else BATCHES
    calls, repeats = (5, 3) if quick else (20, 7)
    kv = make_kv(dtype=dtype)
    xs = {bs: torch.randn(bs, HIDDEN, device="cuda", dtype=dtype) for bs in batches}
    table: Dict[str, Dict[int, float]] = {}
    notes: Dict[str, str] = {}

    def measure(name, fn):
        table[name] = {}
        with torch.no_grad():
            for bs in batches:
                table[name][bs] = device_us(fn, xs[bs], calls, repeats)
        print(f"{name:>26}: " + "  ".join(f"{bs}:{table[name][bs]:.0f}" for bs in batches), flush=True)

    base = build(None, kv, dtype)
    measure("eager", base)
    t0 = time.perf_counter()
    hand = model_hand_graphs(base, batches, dtype)
    notes["hand graphs"] = f"{len(batches)} sizes captured in {time.perf_counter() - t0:.2f} s"
    measure("hand-written graph", hand)

    host_bs = 8 if 8 in batches else batches[0]
    graph, static = hand.graphs[host_bs], hand.inputs[host_bs]
    host_fns = {"raw replay()": lambda _: graph.replay(), "copy_ + replay()": lambda t: (static.copy_(t), graph.replay())}

    for name, cfg in plugin_modes(batches).items():
        m = build(cfg, kv, dtype, cls=DispatchedDecoder if name == MIXED else None)
        t0 = time.perf_counter()
        report = graph_opt.capture_model(m, lambda n: torch.randn(n, HIDDEN, device="cuda", dtype=dtype), progress=False)
        if report.failed:
            print(f"{name}: capture failed: {report.failed}", flush=True)
            continue
        s = graph_opt.stats(m)
        notes[name] = (f"capture of {len(batches)} sizes {time.perf_counter() - t0:.1f} s (translations "
                       f"{report.translations}), graphs per size {max(s.graphs.values())}")
        measure(name, m)
        if name == MIXED:
            notes[name] += f"; replays per kind {graph_opt.stats(m).replays_by_kind}"
        host_fns[name] = m
        if name == "plugin piecewise (L0)":
            host_fns["pieces by hand (L0)"] = raw_pieces(m, host_bs)

    into_notes = writes_into_output(kv, dtype, host_bs, xs[host_bs], host_fns)

    ro = build(None, kv, dtype)
    forward = type(ro).forward
    t0 = time.perf_counter()
    compiled = torch.compile(lambda x: forward(ro, x), mode="reduce-overhead")

    def reduce_overhead(x):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x)

    with torch.no_grad():
        for bs in sorted(batches, reverse=True):
            torch._dynamo.maybe_mark_dynamic(xs[bs], 0)
            for _ in range(3):
                reduce_overhead(xs[bs])
    torch.cuda.synchronize()
    notes["reduce-overhead"] = f"compile and record of {len(batches)} sizes {time.perf_counter() - t0:.1f} s"
    measure("reduce-overhead", reduce_overhead)
    # Eager is bound by the host's Python speed, which drifts over a run: measure it again at the end
    # and keep the faster of the two, so that speed-ups over eager are not flattered by a slow phase.
    first = table.pop("eager")
    measure("eager", base)
    table["eager"] = {bs: min(first[bs], table["eager"][bs]) for bs in batches}
    with torch.no_grad():
        host = host_us(host_fns, xs[host_bs])
    for plugin, by_hand_name, key in [("plugin piecewise (L0)", "pieces by hand (L0)", "piecewise overhead"),
                                      (INTO_L0, INTO_HAND, "piecewise overhead, attention into its output")]:
        by_hand = host_fns.get(by_hand_name)
        if by_hand is not None and plugin in host:
            over = host[plugin] - host[by_hand_name]
            # What every mode pays once per call (dispatch, padding, output): the full graph's over its
            # hand-written copy_ + replay().
            per_call = host["plugin full (L0)"] - host["copy_ + replay()"]
            notes[key] = (f"{plugin} over its pieces replayed by hand (input copy included) at bs {host_bs}: "
                          f"{over:.1f} µs per call; less the per-call cost of the full graph ({per_call:.1f} µs), "
                          f"{(over - per_call) / by_hand.pieces:.2f} µs per piece ({by_hand.pieces} pieces, "
                          f"{by_hand.pieces - 1} splitting ops)")
    notes.update(into_notes)
    del compiled, ro, hand, host_fns, graph, static, base
    gc.collect()
    torch.cuda.empty_cache()

    capture = capture_report(kv, dtype)
    write_results(out_dir, batches, table, host, notes, capture, torch.cuda.get_device_name())
    return 0


INTO_L0 = "plugin piecewise (L0, attention into its output)"
INTO_HAND = "pieces by hand (L0, attention into its output)"
INTO_L1 = "plugin piecewise (L1, attention into its output)"


def writes_into_output(kv, dtype, bs, x, host_fns) -> Dict[str, str]:
    """The decoder whose attention writes into a buffer each layer allocates (attention_into): piecewise
    at levels 0 and 1, captured at bs alone, for the host-time table. Checked against its own eager run."""
    notes = {}
    reference = build(None, kv, dtype, into=True)
    with torch.no_grad():
        expected = type(reference).forward(reference, x)
    for name, cfg in [(INTO_L0, level_config(0, False, [bs])),
                      (INTO_L1, level_config(1, False, [bs], ["graph_opt_bench::attention_into"]))]:
        m = build(cfg, kv, dtype, into=True)
        report = graph_opt.capture_model(m, lambda n: torch.randn(n, HIDDEN, device="cuda", dtype=dtype),
                                         progress=False)
        if report.failed:
            print(f"{name}: capture failed: {report.failed}", flush=True)
            continue
        with torch.no_grad():
            got = m(x)
        diff = (got.float() - expected.float()).abs().max().item()
        notes[name] = (f"graphs per size {max(graph_opt.stats(m).graphs.values())}, max |replay - eager| "
                       f"{diff:.3g} at bs {bs}")
        host_fns[name] = m
        if name == INTO_L0:
            host_fns[INTO_HAND] = raw_pieces(m, bs)
    return notes


def capture_report(kv, dtype) -> Dict[str, dict]:
    """Capture time of the 35 default sizes (1..256) per mode, and graph memory: all sizes vs the largest alone,
    each captured into a fresh model."""
    out = {}
    modes = {"full (L0)": level_config(0, True, None), "full (L1)": level_config(1, True, None),
             "piecewise (L0)": level_config(0, False, None),
             "piecewise (L1)": level_config(1, False, None, ["graph_opt_bench::attention"])}
    make = lambda n: torch.randn(n, HIDDEN, device="cuda", dtype=dtype)  # noqa: E731

    def pool_bytes(pool) -> int:
        """Bytes of the segments that belong to the graphs' private pool: graph memory, nothing else."""
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == tuple(pool))

    def captured(cfg, sizes):
        """capture_model on a fresh model: its report, the graph pool's size, and reserved memory's growth."""
        m = build(cfg, kv, dtype)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        report = graph_opt.capture_model(m, make, sizes=sizes, progress=False)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
        in_pool = pool_bytes(state_of(m).runner.pool)
        del m
        gc.collect()
        torch.cuda.empty_cache()
        return report, in_pool / 2**20, grown / 2**20

    from graph_opt.replay.sizes import default_capture_sizes

    base = build(None, kv, dtype)
    for sizes, label in (([256], "largest"), (default_capture_sizes(256), "all")):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        hand = model_hand_graphs(base, sizes, dtype)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        out.setdefault("hand-written (full)", {})[label] = {"seconds": seconds, "pool_mib": pool_bytes(hand.pool) / 2**20}
        del hand
    hand = out["hand-written (full)"]
    print(f"capture hand-written: {hand}", flush=True)
    def seconds_traced_before(cfg) -> float:
        """capture_model of every size on a model whose forward was traced before (sizes 256, 8 and 1:
        Dynamo traces one graph for sizes >= 2 and one for size 1), graphs dropped: capture alone."""
        m = build(cfg, kv, dtype)
        graph_opt.capture_model(m, make, sizes=[256, 8, 1], progress=False)
        graph_opt.clear_graphs(m)
        report = graph_opt.capture_model(m, make, progress=False)
        assert report.translations == 0, report.translations
        del m
        gc.collect()
        torch.cuda.empty_cache()
        return report.seconds

    for name, cfg in modes.items():
        _, pool_largest, reserved_largest = captured(cfg, [256])
        report, pool_all, reserved_all = captured(cfg, None)
        untraced = seconds_traced_before(cfg) if cfg.graph_opt_level >= 1 else report.seconds
        trace_s = max(0.0, report.seconds - untraced)
        out[name] = {
            "sizes": len(report.sizes), "seconds": report.seconds, "translations": report.translations,
            "trace_seconds": trace_s, "seconds_without_trace": untraced,
            "pool_all_mib": pool_all, "pool_largest_mib": pool_largest,
            "ratio": pool_all / pool_largest if pool_largest else float("nan"),
            "reserved_all_mib": reserved_all, "reserved_largest_mib": reserved_largest, "failed": report.failed,
        }
        print(f"capture {name}: {out[name]}", flush=True)
    return out


COLUMNS = ["eager", "hand-written graph", "plugin full (L0)", "plugin full (L1)", "plugin piecewise (L0)",
           "plugin piecewise (L1)", "plugin level 2 (full)", MIXED, "reduce-overhead"]


def write_results(out_dir, batches, table, host, notes, capture, device) -> None:
    os.makedirs(out_dir, exist_ok=True)
    cols = [c for c in COLUMNS if c in table]
    lines = [f"# torch frontend on {device} (torch {torch.__version__})", "",
             f"Decoder: hidden {HIDDEN}, {LAYERS} layers, bf16, attention over a {CACHE_LEN}-token cache as a "
             "torch.library custom op. Median µs per call (back-to-back calls, input copy included); "
             "in brackets: speed-up over eager (eager measured first and last, the faster kept).", "",
             "| bs | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for bs in batches:
        eager = table["eager"][bs]
        cells = [f"{table[c][bs]:.0f}" + ("" if c == "eager" else f" ({eager / table[c][bs]:.1f}×)") for c in cols]
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    lines += ["", "Host time per call at bs 8 (µs, median):", ""]
    raw, copy = host["raw replay()"], host["copy_ + replay()"]
    lines += [f"- {k}: {v:.1f}" + ("" if k == "raw replay()" else f" (+{v - raw:.1f} over raw replay()") +
              ("" if k in ("raw replay()", "copy_ + replay()") else f", +{v - copy:.1f} over copy_ + replay()") +
              ("" if k == "raw replay()" else ")") for k, v in host.items()]
    lines += ["", "Capture of the 35 default sizes (1, 2, 4, 8, 16, ..., 256) into one pool, largest first, on a "
              "fresh model; graph memory is the size of the graphs' private pool (its segments in "
              "torch.cuda.memory_snapshot()), reserved is memory_reserved()'s growth over capture_model "
              "(warmup caches, static buffers and boundary buffers outside the pool included):", "",
              "| mode | sizes | seconds (trace included) | of which tracing (a traced model's capture apart) | translations | graph pool, all sizes | "
              "graph pool, largest alone | ratio | reserved, all sizes | reserved, largest alone |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    hand = capture.pop("hand-written (full)")
    for name, c in capture.items():
        lines.append(f"| {name} | {c['sizes']} | {c['seconds']:.2f} | {c['trace_seconds']:.2f} | {c['translations']} | "
                     f"{c['pool_all_mib']:.0f} MiB"
                     f" | {c['pool_largest_mib']:.0f} MiB | {c['ratio']:.2f} | {c['reserved_all_mib']:.0f} MiB | "
                     f"{c['reserved_largest_mib']:.0f} MiB |")
    lines += ["", f"Hand-written capture (one torch.cuda.graph per size, one pool and stream, largest first) in "
              f"the same run: 35 sizes {hand['all']['seconds']:.2f} s, graph pool {hand['all']['pool_mib']:.0f} MiB; "
              f"the largest alone {hand['largest']['pool_mib']:.0f} MiB (ratio "
              f"{hand['all']['pool_mib'] / max(hand['largest']['pool_mib'], 1e-9):.2f}). Plugin capture time over "
              "hand-written, tracing apart: " + ", ".join(
                  f"{n} {c['seconds_without_trace'] / hand['all']['seconds']:.2f}x" for n, c in capture.items()) + "."]
    capture["hand-written (full)"] = hand
    lines += ["", "Notes:", ""] + [f"- {k}: {v}" for k, v in notes.items()]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "torch_gpu_bench.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    write_json(out_dir, "torch_gpu_bench.json", {"device": device, "torch": torch.__version__, "us_per_call": table,
                                                 "host_us": host, "capture": capture, "notes": notes})
    plot(out_dir, batches, table, cols, device)
    print(text, flush=True)


def plot(out_dir, batches, table, cols, device) -> None:
    figure = new_figure()
    if figure is None:
        return
    fig, ax = figure
    for c in cols:
        ax.plot(batches, [table[c][bs] for bs in batches], marker="o", label=c,
                linestyle="--" if c in ("eager", "hand-written graph", "reduce-overhead") else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("µs per forward (median)")
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, ax, out_dir, "torch_gpu_bench.png",
                f"graph_opt torch frontend, {LAYERS}-layer decoder, bf16, {device}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graph_opt.benchmarks.torch_gpu",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results", help="folder for the markdown table and the plot (default results)")
    parser.add_argument("--quick", action="store_true", help="3 batch sizes, few calls: a smoke run")
    args = parser.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
