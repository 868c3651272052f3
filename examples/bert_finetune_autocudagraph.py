"""Fine-tune a Hugging Face BERT with graphed training steps: graph_opt.autocudagraph.

    python examples/bert_finetune_autocudagraph.py [--smoke]

BertForMaskedLM with random weights (nothing is downloaded), dropout on, in a thin module that returns the
loss. autocudagraph patches that instance: after one eager warm-up step it captures the forward and the
backward as CUDA graphs and replays them every step; AdamW steps the parameters as usual. The eager twin is
a copy made before patching, stepped on the same batches with the same seeds: its loss must match at every
step. Attention dropout is off: inside SDPA on a GPU a replay draws other masks than eager (measured on an
H200); hidden dropout stays on, its masks equal eager's. Without a CUDA device the graphs are graph_opt's
host stand-in: losses are checked, the timing shows the plugin's overhead, not a speed-up.
"""
import argparse
import contextlib
import copy
import statistics
import time

import torch
import transformers

import graph_opt


class MaskedLMLoss(torch.nn.Module):
    """The user's training block: token ids and labels in, the loss out."""

    def __init__(self, config):
        super().__init__()
        self.bert = transformers.BertForMaskedLM(config)

    def forward(self, input_ids, labels):
        return self.bert(input_ids=input_ids, labels=labels).loss


def step(model, opt, ids, seed, device):
    """One training step; its loss and its wall time."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models
    loss = model(ids, ids)
    loss.backward()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return loss.item(), time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiniest model, fewest steps (CI)")
    smoke = parser.parse_args().smoke
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    hidden, layers, vocab, seq, batch, steps = (32, 1, 128, 8, 2, 3) if smoke else \
        (256, 4, 8192, 128, 8, 30) if cuda else (64, 2, 512, 32, 4, 10)
    print(f"device {device}" + ("" if cuda else ": no CUDA device, graphs simulated on the host"))
    if not cuda:
        torch.set_num_threads(1)  # tiny sizes: two threads contending with other work time noise
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=4, intermediate_size=4 * hidden,
                                     max_position_embeddings=seq, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    eager = MaskedLMLoss(config).to(device).train()
    block = copy.deepcopy(eager)  # before autocudagraph patches it: `eager` stays unpatched
    # on a GPU, SDPA replays differ from eager in the last bits (up to 1.1e-7 in float32 on an H200)
    tolerance = 1e-5 if cuda else 0.0

    simulated = contextlib.nullcontext() if cuda else graph_opt.testing.simulate_cuda_graphs()
    with simulated:
        block = graph_opt.autocudagraph(block, warmup_steps=1)
        opts = [torch.optim.AdamW(mod.parameters(), lr=1e-4) for mod in (eager, block)]
        losses, times, worst = ([], []), ([], []), 0.0
        for k in range(steps):
            ids = torch.randint(0, vocab, (batch, seq), device=device)
            for i, mod in enumerate((eager, block)):
                loss, seconds = step(mod, opts[i], ids, seed=100 + k, device=device)
                losses[i].append(loss)
                times[i].append(seconds)
            worst = max(worst, abs(losses[1][-1] - losses[0][-1]) / abs(losses[0][-1]))
    ok = worst <= tolerance
    print(f"correctness: {'matched' if ok else 'MISMATCH against'} eager's loss at all {steps} steps (largest "
          f"relative difference {worst:.1e}, tolerance {tolerance:.0e}); last loss {losses[1][-1]:.4f}")
    eager_ms, graph_ms = (statistics.median(t[2:]) * 1e3 for t in times)  # after the warm-up and capture steps
    print(f"ms per step: eager {eager_ms:.2f}, autocudagraph {graph_ms:.2f} ({eager_ms / graph_ms:.2f}x), "
          f"median of steps 3-{steps}")
    s = graph_opt.stats(block)
    print(f"stats: graphs={s.graphs} captures={s.captures} replays={s.replays} backward_replays={s.backward_replays} "
          f"fallbacks={s.fallbacks} capture_seconds={s.capture_seconds:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
