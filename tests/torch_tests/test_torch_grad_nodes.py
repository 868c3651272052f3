"""backends/torch/grad_hooks.accumulates: inside a backward, whether autograd adds a leaf's gradient into its
.grad. A training block keeps its parameters' AccumulateGrad nodes (found once, ~2.7 µs a parameter each
time before); the answer must stay the one a fresh lookup gives: True under loss.backward(), False under
torch.autograd.grad, and only the block's parameters are kept (an input leaf made per step is not)."""
import gc
import weakref

import torch

from graph_opt.backends.torch.grad_hooks import accumulates


def _answers(params, nodes, leaves, run):
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            return sum(t.sum() for t in ts).detach()

        @staticmethod
        def backward(ctx, g):
            seen["cached"] = [accumulates(t, nodes) for t in leaves]
            seen["fresh"] = [accumulates(t, {}) for t in leaves]
            return tuple(torch.ones_like(t) for t in leaves)

    run(Probe.apply(*leaves), leaves)
    return seen


def test_the_kept_nodes_answer_as_a_fresh_lookup_and_hold_only_parameters():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    nodes = {id(p): (p, None) for p in params}
    for step in range(3):
        x = torch.randn(3, requires_grad=True)  # an input leaf made per step
        ref = weakref.ref(x)
        seen = _answers(params, nodes, params + [x], lambda out, _: out.backward())
        assert seen["cached"] == seen["fresh"] == [True] * 5, (step, seen)
        del x, seen
        gc.collect()
        assert ref() is None, "the input leaf is kept alive"
    assert set(nodes) == {id(p) for p in params} and all(n is not None for _, n in nodes.values())
    seen = _answers(params, nodes, params, lambda out, leaves: torch.autograd.grad(out, leaves))
    assert seen["cached"] == seen["fresh"] == [False] * 4
    assert all(p.grad is not None for p in params)  # the loss.backward() steps accumulated
