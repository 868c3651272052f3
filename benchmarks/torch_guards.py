"""What the checks before a replay cost per call, on the GPU (torch).

    python -m graph_opt bench guards [--out results] [--smoke]

Every replay checks the model's state (training flags, autocast; at level 0 the decorated model's
attributes) and, at level >= 1, the framework's guards (Dynamo's guard manager). This measures the
host time per call at batch 8 with and without them, on four models, each full graph:

- the benchmark decoder of torch_gpu.py (hidden 1024, 24 layers, bf16; its caches are buffers);
- a decoder whose KV caches come in as arguments, one 5-D tensor per K and V indexed per layer
  (12 layers, hidden 512); both the hand-written graph and the plugin (graph_opt.mark_static_address)
  read the caches in place and copy only x in;
- Hugging Face GPT-2 and Llama LM head models (4 layers, hidden 256, random weights, input ids [8, 16]),
  each wrapped in a thin user module.

Columns: a hand-written CUDA graph's replay() alone and copy_ + replay(); the plugin at levels 0, 1
and 2 with guarded_replays true (the default) and false; at level 0 also with the model-state check
stubbed out, with keep_outputs false, in a loop that holds the previous output while the next call runs
(`out = model(x)`: its values are copied first), and its own graph's replay() called bare (measurement
only). Host time is the median of
alternating rounds (torch_gpu.host_us), and again for one call at a time with the GPU idle before it
(idle_host_us). Every plugin column's output is checked against the hand-written
graph's first. --smoke runs the same code on CPU with simulated graphs and tiny sizes (no meaningful
timings).

Writes <out>/guards_bench.json and prints the table last.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import graph_opt
from graph_opt.decorator import state_of

from .report import write_json
from .torch_gpu import HandGraphs, build, host_us, make_kv, paired_us

BATCH = 8
SIZES = [1, 2, 4, 8]


class GPT2Serve(torch.nn.Module):
    """A user's thin module around a Hugging Face GPT-2: input ids in, logits out."""

    def __init__(self, layers=4, hidden=256, heads=4, vocab=1000, positions=64):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                             n_positions=positions, bos_token_id=0, eos_token_id=0))

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


GPT2Graphed = graph_opt.support_graph_optimization(type("GPT2Graphed", (GPT2Serve,), {}))


class LlamaServe(torch.nn.Module):
    """A user's thin module around a Hugging Face Llama (GQA): input ids in, logits out."""

    def __init__(self, layers=4, hidden=256, heads=4, kv_heads=2, vocab=1000):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                               num_attention_heads=heads, num_key_value_heads=kv_heads,
                                               vocab_size=vocab, max_position_embeddings=64))

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


LlamaGraphed = graph_opt.support_graph_optimization(type("LlamaGraphed", (LlamaServe,), {}))


class _HandGraph:
    """One hand-written CUDA graph of a model's forward at one batch, from a static input (torch.cuda.graph)."""

    def __init__(self, forward: Callable, x):
        # A tuple: the first tensor is copied in per call, the rest (KV caches) are the caller's own buffers.
        self.static = (x[0].clone(), *x[1:]) if isinstance(x, tuple) else x.clone()
        self.first = self.static[0] if isinstance(x, tuple) else self.static
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            forward(self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, stream=stream):
            self.out = forward(self.static)


def _variants(make: Callable[[Optional[graph_opt.GraphOptConfig]], torch.nn.Module], make_inputs, smoke: bool):
    """name -> a plugin model captured at SIZES, for each level and guard setting."""
    models = {}
    levels = [0, 1] if smoke else [0, 1, 2]
    for level in levels:
        for guarded in (True, False):
            cfg = graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=SIZES,
                                           guarded_replays=guarded)
            m = make(cfg)

            def simulated():
                return graph_opt.testing.simulate_cuda_graphs() if smoke else contextlib.nullcontext()

            with simulated():
                report = graph_opt.capture_model(m, make_inputs, progress=False)
            if report.failed:
                print(f"  L{level} guarded={guarded}: capture failed: {report.failed}", file=sys.stderr)
                continue
            if level == 0 and not guarded:
                continue  # guarded_replays concerns level >= 1 only
            models[f"L{level}" + ("" if guarded else " unguarded")] = m
            if level == 0:
                stubbed = make(cfg)
                with simulated():
                    graph_opt.capture_model(stubbed, make_inputs, progress=False)
                state_of(stubbed).model_state.check = lambda: None  # measurement only
                models["L0 no model-state check"] = stubbed
                unkept = make(graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=SIZES,
                                                       keep_outputs=False))
                with simulated():
                    graph_opt.capture_model(unkept, make_inputs, progress=False)
                models["L0 keep_outputs off"] = unkept
    return models


def _spread(fn: Callable, x) -> Callable:
    """fn taking the inputs as make_inputs gives them: one tensor, or a tuple of arguments."""
    return (lambda t: fn(*t)) if isinstance(x, tuple) else fn


def measure(name: str, make, make_inputs, smoke: bool) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(host µs per call of each column, the paired gaps the targets compare)."""
    x = make_inputs(BATCH)
    eager = make(graph_opt.GraphOptConfig(use_cudagraph=False))
    forward = _spread(lambda *t: type(eager).forward(eager, *t), x)
    fns: Dict[str, Callable] = {}
    if not smoke:
        hand = _HandGraph(forward, x)
        fns["raw replay()"] = lambda t: hand.graph.replay()
        if isinstance(x, tuple):
            fns["copy_ + replay()"] = lambda t: (hand.first.copy_(t[0]), hand.graph.replay())
        else:
            fns["copy_ + replay()"] = lambda t: (hand.first.copy_(t), hand.graph.replay())
        with torch.no_grad():
            hand.graph.replay()
            reference = hand.out.clone()
    else:
        with torch.no_grad():
            reference = forward(x)
    for label, m in _variants(make, make_inputs, smoke).items():
        with torch.no_grad():
            out = _spread(m, x)(x)
        level = state_of(m).config.graph_opt_level
        # Level 2's kernels are Inductor's: within 5% of the largest output value (bf16, fused kernels).
        scale = reference.float().abs().max().item()
        ok = torch.equal(out, reference) if level < 2 else (out.float() - reference.float()).abs().max() <= 0.05 * scale
        if not ok:
            raise AssertionError(f"{name} {label}: output differs from the hand-written graph's")
        if graph_opt.stats(m).replays != 1:
            raise AssertionError(f"{name} {label}: the call did not replay: {graph_opt.stats(m)}")
        fns[label] = _spread(m, x)
        if label == "L0" and not smoke:
            # The plugin's own graph, replayed bare: the same work as the hand-written graph's replay().
            plan = state_of(m).runner.shortcut.sig.plans[BATCH]
            fns["L0 graph replay() alone"] = lambda t, replay=plan.replay: replay()
            # `out = model(x)` in a loop: the previous output is still held while the next call runs, and
            # its values are copied first (graph_opt/replay/handed_outputs.py)
            held = [None]

            def holding(t, call=_spread(m, x), held=held):
                held[0] = call(t)

            fns["L0 previous output held"] = holding
    with torch.no_grad():
        if smoke:
            return {k: 0.0 for k in fns}, {}, {}, {}
        samples: Dict[str, List[float]] = {}
        medians = host_us(fns, x, samples=samples)
        idle: Dict[str, List[float]] = {}
        idle_medians = idle_host_us(fns, x, samples=idle)
    return medians, _gaps(samples), idle_medians, _gaps(idle)


def _gaps(samples: Dict[str, List[float]]) -> Dict[str, float]:
    """What the targets compare, paired by round: the plugin's own work over the hand-written graph's,
    and the translating levels over level 0."""
    gaps = {"L0 - copy_ + replay()": paired_us(samples, "L0", "copy_ + replay()"),
            "L0 graph replay() alone - raw replay()": paired_us(samples, "L0 graph replay() alone", "raw replay()")}
    for label in ("L1", "L1 unguarded", "L2", "L2 unguarded"):
        if label in samples:
            gaps[f"{label} - L0"] = paired_us(samples, label, "L0")
    for label in ("L0 keep_outputs off", "L0 previous output held"):
        if label in samples:
            gaps[f"{label} - L0"] = paired_us(samples, label, "L0")
    return gaps


def idle_host_us(fns: Dict[str, Callable], x, rounds: int = 301,
                 samples: Optional[Dict[str, List[float]]] = None) -> Dict[str, float]:
    """Median host time of one call with the GPU idle before it (synchronized), rounds alternating
    between the fns: a server's call between steps, as against host_us's bursts of calls."""
    samples = {} if samples is None else samples
    samples.update({name: [] for name in fns})
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = clock()
            fn(x)
            samples[name].append((clock() - t0) * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


def decoder(smoke: bool):
    device = "cpu" if smoke else "cuda"
    dims = dict(hidden=64, heads=4, mlp=128) if smoke else {}
    layers = 2 if smoke else 24
    kv = make_kv(layers=layers, max_batch=8, device=device, **({"heads": 4, "hidden": 64} if smoke else {}))

    def make(cfg):
        if smoke:
            torch.manual_seed(0)
            from .torch_gpu import Decoder

            m = Decoder(kv, graph_opt_config=cfg, **dims).to(dtype=torch.bfloat16).eval()
            for layer, k, v in zip(m.layers, *kv):
                layer.k_cache, layer.v_cache = k, v
            return m
        return build(cfg, kv)

    hidden = dims.get("hidden", 1024)
    return make, lambda n: torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=None)


def _hf(serve, graphed):
    """make and make_inputs of a Hugging Face serving module: its undecorated class without graphs."""
    def builder(smoke: bool):
        device = "cpu" if smoke else "cuda"

        def make(cfg):
            torch.manual_seed(0)
            m = graphed(graph_opt_config=cfg) if cfg.use_cudagraph else serve()
            return m.to(device=device, dtype=torch.bfloat16).eval()

        g = torch.Generator().manual_seed(0)
        return make, lambda n: torch.randint(0, 1000, (n, 16), generator=g).to(device)

    return builder


gpt2 = _hf(GPT2Serve, GPT2Graphed)
llama = _hf(LlamaServe, LlamaGraphed)


class CacheLayer(torch.nn.Module):
    """A decoder layer that reads and writes its slice of the caches the forward was given."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x, k_cache, v_cache, position: int):
        bs, hidden = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(bs, 3, self.heads, hidden // self.heads).unbind(1)
        k_cache[:bs, :, position] = k
        v_cache[:bs, :, position] = v
        scores = torch.einsum("bhd,bhtd->bht", q, k_cache[:bs]) * (hidden // self.heads) ** -0.5
        a = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v_cache[:bs])
        return x + self.out(a.reshape(bs, hidden))


class CacheDecoder(torch.nn.Module):
    """Its KV caches come in as arguments: one 5-D tensor per K and V, [layers, max batch, heads, cache
    length, head dim], indexed per layer."""

    def __init__(self, layers=12, hidden=512, heads=8, graph_opt_config=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(CacheLayer(hidden, heads) for _ in range(layers))

    def forward(self, x, k_cache, v_cache):
        for i, layer in enumerate(self.layers):
            x = layer(x, k_cache[i], v_cache[i], 7)
        return x


CacheDecoderGraphed = graph_opt.support_graph_optimization(type("CacheDecoderGraphed", (CacheDecoder,), {}),
                                                           dynamic_arg_dims={"x": 0})


def cache_decoder(smoke: bool):
    device = "cpu" if smoke else "cuda"
    layers, hidden, heads, length = (2, 32, 4, 8) if smoke else (12, 512, 8, 64)
    # Read in place by the plugin's graphs, as by the hand-written one (graph_opt.mark_static_address).
    caches = tuple(graph_opt.mark_static_address(torch.zeros(layers, max(SIZES), heads, length, hidden // heads,
                                                             device=device, dtype=torch.bfloat16))
                   for _ in range(2))

    def make(cfg):
        torch.manual_seed(0)
        cls = CacheDecoderGraphed if cfg.use_cudagraph else CacheDecoder
        return cls(layers, hidden, heads, graph_opt_config=cfg).to(device=device, dtype=torch.bfloat16).eval()

    g = torch.Generator().manual_seed(0)
    return make, lambda n: (torch.randn(n, hidden, generator=g).to(device=device, dtype=torch.bfloat16), *caches)


def main(argv: Optional[List[str]] = None, prog: str = "python -m graph_opt bench guards") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--smoke", action="store_true", help="CPU, simulated graphs, tiny models: the code runs")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench guards needs a CUDA device (or --smoke on CPU)", file=sys.stderr)
        return 2
    results = {}
    models = {"decoder": decoder, "cache-decoder": cache_decoder}
    try:
        import transformers  # noqa: F401

        models["hf-gpt2"] = gpt2
        models["hf-llama"] = llama
    except ImportError:
        print("transformers is not installed: the GPT-2 rows are skipped", file=sys.stderr)
    gaps, idle, idle_gaps = {}, {}, {}
    for name, builder in models.items():
        make, make_inputs = builder(args.smoke)
        results[name], gaps[name], idle[name], idle_gaps[name] = measure(name, make, make_inputs, args.smoke)
    if not args.smoke:
        write_json(args.out, "guards_bench.json", {"batch": BATCH, "host_us": results, "paired_gaps_us": gaps,
                                                   "idle_host_us": idle, "idle_paired_gaps_us": idle_gaps,
                                                   "device": torch.cuda.get_device_name()})
    print(f"host us per call at batch {BATCH} (median):")
    for name, row in results.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
        for level in (1, 2):
            a, b = row.get(f"L{level}"), row.get(f"L{level} unguarded")
            if a is not None and b is not None:
                print(f"    level {level}: Dynamo's guards cost {a - b:+.1f} us per call")
        a, b = row.get("L0"), row.get("L0 no model-state check")
        if a is not None and b is not None:
            print(f"    level 0: the model-state check costs {a - b:+.1f} us per call")
        if gaps[name]:
            print("    paired by round: " + ", ".join(f"{k} {v:+.1f}" for k, v in gaps[name].items()))
        if idle_gaps[name]:
            print("    one call, GPU idle before it: " + ", ".join(f"{k} {v:.1f}" for k, v in idle[name].items()))
            print("      paired by round: " + ", ".join(f"{k} {v:+.1f}" for k, v in idle_gaps[name].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
