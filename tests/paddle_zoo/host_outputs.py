"""The Paddle model and shim of tests/both/test_host_outputs.py: a greedy decoder step. Paddle's pinned-memory
and stream path is written against Paddle 3.2+ and not run here."""
import numpy as np
import paddle

import graph_opt


class DecoderStep(paddle.nn.Layer):
    def __init__(self, hidden=32, vocab=50, fail_capture=False, nested=False):
        super().__init__()
        self.embed = paddle.nn.Embedding(vocab, hidden)
        self.head = paddle.nn.Linear(hidden, vocab)
        self.fail_capture = fail_capture
        self.nested = nested

    def forward(self, state):
        if self.fail_capture and graph_opt.is_capturing():
            raise RuntimeError("injected capture failure")
        tokens = self.head(state).argmax(-1)
        stop = tokens % 7 == 0
        new = paddle.tanh(self.embed(tokens) + state)
        if self.nested:
            return {"state": new, "aux": [tokens, {"flag": stop}]}
        return {"next_tokens": tokens, "stop": stop, "state": new}


class PaddleHostShim:
    adapter = graph_opt.backends.load("paddle").ADAPTER

    def model(self, host_outputs=None, depth=2, seed=0, fail_capture=False, nested=False, level=0):
        kw = {} if host_outputs is None else {"host_outputs": host_outputs, "host_ring_depth": depth}
        cls = graph_opt.support_graph_optimization(type("Step", (DecoderStep,), {}), **kw)
        paddle.seed(seed)
        cfg = graph_opt.GraphOptConfig(use_cudagraph=True, graph_opt_level=level,
                                       cudagraph_capture_sizes=[1, 2, 4, 8])
        m = cls(fail_capture=fail_capture, nested=nested, graph_opt_config=cfg)
        m.eval()
        graph_opt.capture_model(m, make_inputs=lambda bs: paddle.randn([bs, 32]), progress=False)
        return m

    @staticmethod
    def state(batch, seed):
        return paddle.to_tensor(np.random.default_rng(seed).standard_normal((batch, 32)).astype("float32"))

    @staticmethod
    def numpy(t):
        return t.numpy().copy()
