"""The torch model and shim of tests/both/test_host_outputs.py: a greedy decoder step, on CPU with simulated
graphs or on a CUDA device (tests/gpu/test_gpu_host_outputs.py)."""
import torch

import graph_opt


class DecoderStep(torch.nn.Module):
    def __init__(self, hidden=32, vocab=50, fail_capture=False, nested=False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.fail_capture = fail_capture
        self.nested = nested

    def forward(self, state):
        if self.fail_capture and graph_opt.is_capturing():
            raise RuntimeError("injected capture failure")
        tokens = self.head(state).argmax(-1)
        stop = tokens % 7 == 0
        new = torch.tanh(self.embed(tokens) + state)
        if self.nested:
            return {"state": new, "aux": [tokens, {"flag": stop}]}
        return {"next_tokens": tokens, "stop": stop, "state": new}


class TorchHostShim:
    adapter = graph_opt.backends.load("torch").ADAPTER

    def __init__(self, device="cpu"):
        self.device = device

    def model(self, host_outputs=None, depth=2, seed=0, fail_capture=False, nested=False, level=0):
        kw = {} if host_outputs is None else {"host_outputs": host_outputs, "host_ring_depth": depth}
        cls = graph_opt.support_graph_optimization(type("Step", (DecoderStep,), {}), **kw)
        torch.manual_seed(seed)
        cfg = graph_opt.GraphOptConfig(use_cudagraph=True, graph_opt_level=level,
                                       cudagraph_capture_sizes=[1, 2, 4, 8])
        m = cls(fail_capture=fail_capture, nested=nested, graph_opt_config=cfg).to(self.device).eval()
        graph_opt.capture_model(m, make_inputs=lambda bs: torch.randn(bs, 32, device=self.device), progress=False)
        return m

    def state(self, batch, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, 32, generator=g).to(self.device)

    @staticmethod
    def numpy(t):
        return t.cpu().numpy().copy()  # on CPU .numpy() shares the replay's buffer, which the next replay rewrites
