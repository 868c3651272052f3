"""Serve a Hugging Face causal LM with one CUDA graph per padded batch size.

    python examples/hf_causal_lm_serving.py [--smoke]

A LlamaForCausalLM with random weights (nothing is downloaded) inside a thin serving module: input ids
in, logits out. graph_opt captures a few batch sizes at start-up; a call of any batch size up to the
largest is padded to the nearest captured size, replayed, and its real rows come back. The eager
reference is the undecorated module with the same weights. Without a CUDA device the graphs are
graph_opt's host stand-in: the check is real, the timing shows the plugin's overhead, not a speed-up.
"""
import argparse
import contextlib
import statistics
import time

import torch
import transformers

import graph_opt


# hidden, layers, vocab, sequence length, capture sizes
SHAPES = {"cuda": (1024, 8, 32000, 64, [1, 2, 4, 8, 16]), "cpu": (64, 2, 256, 16, [1, 2, 4, 8]),
          "smoke": (32, 1, 128, 8, [1, 2, 4])}


class Logits(torch.nn.Module):
    """The user's serving module: input ids [batch, seq] in, logits [batch, seq, vocab] out."""

    def __init__(self, config):
        super().__init__()
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


@graph_opt.support_graph_optimization  # patches this subclass: Logits stays the eager twin
class GraphedLogits(Logits):
    pass


def median_ms(fn, calls, device):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiniest model, fewest calls (CI)")
    smoke = parser.parse_args().smoke
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hidden, layers, vocab, seq, sizes = SHAPES["smoke" if smoke else device]
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, intermediate_size=hidden * 11 // 4,
                                      max_position_embeddings=2 * seq)
    print(f"device {device}" + ("" if cuda else ": no CUDA device, graphs simulated on the host"))
    if not cuda:
        torch.set_num_threads(1)  # tiny sizes: two threads contending with other work time noise
    torch.manual_seed(0)
    eager = Logits(config).to(device, dtype).eval()
    m = GraphedLogits(config, graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=sizes))
    m.load_state_dict(eager.state_dict())
    m = m.to(device, dtype).eval()
    ids = lambda n: torch.randint(0, vocab, (n, seq), device=device)  # noqa: E731

    simulated = contextlib.nullcontext() if cuda else graph_opt.testing.simulate_cuda_graphs()
    with simulated, torch.no_grad():
        print(graph_opt.capture_model(m, make_inputs=lambda n: {"input_ids": ids(n)}, progress=False))
        # bf16 rounds (2**-8); a graph replays eager's kernels, but a padded batch may pick other ones
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        worst, batches = 0.0, sorted({1, 3, sizes[-1] - 1, sizes[-1]})  # 3 and max-1 are padded up
        for n in batches:
            x = ids(n)
            want = eager(x).float()
            worst = max(worst, ((m(x).float() - want).abs().max() / want.abs().max()).item())
        ok = worst <= tolerance
        print(f"correctness: {'matched' if ok else 'MISMATCH against'} eager at batches {batches} "
              f"(max diff {worst:.1e} of the largest logit, tolerance {tolerance:.0e})")
        calls = 3 if smoke else 30
        for n in (1, sizes[-1] - 1):
            x = ids(n)
            t_eager, t_graph = median_ms(lambda: eager(x), calls, device), median_ms(lambda: m(x), calls, device)
            print(f"batch {n:>3}: eager {t_eager:.2f} ms, graph_opt {t_graph:.2f} ms per call "
                  f"({t_eager / t_graph:.2f}x)")
    s = graph_opt.stats(m)
    print(f"stats: captured_sizes={s.captured_sizes} captures={s.captures} replays={s.replays} "
          f"fallbacks={s.fallbacks} {dict(s.fallback_reasons)} capture_seconds={s.capture_seconds:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
