"""A greedy decode loop with async host outputs and full + piecewise graphs per batch size.

    python examples/decode_loop.py [--smoke]

host_outputs=["next_tokens", "stop"]: each step's graph copies those into pinned host memory itself and
they come back as HostFutures, so the loop launches step k+1 before it reads step k. cudagraph_mode
full_and_piecewise: per size a full graph and pieces split at the attention (a splitting op, eager between
them); dispatch_key_fn asks the scheduler: "full" for a decode-only step, "piecewise" for one that also
carries a prefill (here every 4th step). The eager twin, the undecorated class, decodes synchronously
(`.cpu()` each step); both must give the same tokens. Without a CUDA device the graphs are graph_opt's
host stand-in: tokens are checked, the timing shows the plugin's overhead, not a speed-up.
"""
import argparse
import contextlib
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import graph_opt

SCHEDULE = {"kind": "full"}  # what the scheduler knows about the step it launches next
EOS = 2


@graph_opt.splitting_op
def attention(qkv, heads: int):
    """Attention across heads within each row (rows stay independent, as a padded batch needs)."""
    q, k, v = qkv.reshape(qkv.shape[0], heads, -1).chunk(3, dim=-1)
    return torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1).matmul(v).flatten(1)


class DecodeStep(torch.nn.Module):
    """state [batch, hidden], step and limits [batch] in; the next tokens, stop flags, state and step out."""

    def __init__(self, hidden, layers, vocab, heads=8):
        super().__init__()
        self.heads, self.embed, self.head = heads, torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.mlp = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, state, step, limits):
        for qkv, mlp in zip(self.qkv, self.mlp):
            state = state + attention(qkv(state), self.heads)
            state = F.layer_norm(state + F.gelu(mlp(state)), state.shape[-1:])
        next_tokens, step = self.head(state).argmax(-1), step + 1
        stop = ((next_tokens == EOS) & (2 * step >= limits)) | (step >= limits)
        return {"next_tokens": next_tokens, "stop": stop, "state": torch.tanh(self.embed(next_tokens) + state),
                "step": step}


@graph_opt.support_graph_optimization(host_outputs=["next_tokens", "stop"],
                                      dispatch_key_fn=lambda *args: SCHEDULE["kind"])
class GraphedDecodeStep(DecodeStep):  # patches this subclass: DecodeStep stays the eager twin
    pass


def decode(m, state, limits, lagged):
    """Greedy decode until every row stopped: tokens [steps, batch] (-1 once a row stopped), seconds."""
    def launch(k, state, step):
        SCHEDULE["kind"] = "piecewise" if k % 4 == 3 else "full"  # the scheduler: step k carries a prefill
        return m(state, step, limits)

    t0, rows, done = time.perf_counter(), [], np.zeros(len(limits), dtype=bool)
    out = launch(0, state, torch.zeros_like(limits))
    while not done.all():
        if lagged:  # launch step k+1, then read step k (the step past the end is discarded)
            nxt = launch(len(rows) + 1, out["state"], out["step"])
            tokens, stop = out["next_tokens"].result(), out["stop"].result()
        else:
            tokens, stop = out["next_tokens"].cpu().numpy(), out["stop"].cpu().numpy()
            nxt = None if (done | stop).all() else launch(len(rows) + 1, out["state"], out["step"])
        rows.append(np.where(done, -1, tokens))
        done, out = done | stop, nxt
    if state.is_cuda:
        torch.cuda.synchronize()
    return np.stack(rows), time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiniest model, fewest steps (CI)")
    smoke = parser.parse_args().smoke
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    hidden, layers, vocab, batch, max_steps, runs = (32, 1, 64, 2, 8, 1) if smoke else \
        (1024, 8, 32000, 8, 128, 5) if cuda else (64, 2, 512, 4, 32, 3)
    print(f"device {device}" + ("" if cuda else ": no CUDA device, graphs simulated on the host"))
    if not cuda:
        torch.set_num_threads(1)  # tiny sizes: two threads contending with other work time noise
    torch.manual_seed(0)
    eager = DecodeStep(hidden, layers, vocab).to(device).eval()
    config = graph_opt.GraphOptConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[1, 2, 4, 8])
    m = GraphedDecodeStep(hidden, layers, vocab, graph_opt_config=config).to(device).eval()
    m.load_state_dict(eager.state_dict())
    state = torch.randn(batch, hidden, device=device)
    limits = torch.randint(max_steps // 2, max_steps + 1, (batch,), device=device, dtype=torch.int32)

    simulated = contextlib.nullcontext() if cuda else graph_opt.testing.simulate_cuda_graphs()
    with simulated, torch.no_grad():
        print(graph_opt.capture_model(m, lambda n: (torch.randn(n, hidden, device=device), limits.new_zeros(n),
                                                    limits.new_full((n,), max_steps)), progress=False))
        decodes = {model: [decode(model, state, limits, lagged=model is m) for _ in range(runs)]
                   for model in (eager, m)}
    want = decodes[eager][0][0]
    ok = all(np.array_equal(tokens, want) for tokens, _ in decodes[eager] + decodes[m])
    print(f"correctness: {'matched' if ok else 'MISMATCH against'} the eager loop's tokens in every decode "
          f"({len(want)} steps x {batch} sequences, identical required)")
    eager_rate, graph_rate = (statistics.median((t >= 0).sum() / sec for t, sec in decodes[model])
                              for model in (eager, m))
    print(f"tokens/s, median of {runs} decodes: eager with .cpu() each step {eager_rate:.0f}; graph_opt with "
          f"host_outputs read one step late {graph_rate:.0f} ({graph_rate / eager_rate:.2f}x)")
    s = graph_opt.stats(m)
    print(f"stats: replays_by_kind={s.replays_by_kind} host_copies_in_graph={s.host_copies_in_graph} "
          f"host_copies_streamed={s.host_copies_streamed} fallbacks={s.fallbacks} graphs={s.graphs}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
