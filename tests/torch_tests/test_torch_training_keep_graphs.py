"""Training graphs that stay (torch, simulated graphs; tests/gpu runs the device cases): one trace per
key at the traced levels, a key the compiler cannot trace said and counted, several outputs traced when
one is computed from the others, a level-0 key that a host copy stops traced at level 1, and a refused
key's calls as cheap as eager's."""
import copy
import logging

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from graph_opt.errors import GraphOptError  # noqa: E402

HIDDEN = 16


pytestmark = pytest.mark.usefixtures("simulated")


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(HIDDEN, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class WithLoss(torch.nn.Module):
    """A model that computes its loss when given labels, as Hugging Face's do: (loss, logits)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 5)

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.body(x)))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _twins(cls, seed=0):
    torch.manual_seed(seed)
    ref = cls()
    return ref, copy.deepcopy(ref)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _sgd_steps(ref, m, inputs, loss_of):
    """SGD steps of the eager twin and the graphed model on the same inputs: every parameter equal after
    each step (bitwise: level 1 runs eager's kernels)."""
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
    for step, args in enumerate(inputs):
        for model, opt in zip((ref, m), opts):
            opt.zero_grad(set_to_none=True)
            loss_of(model(*args)).backward()
            opt.step()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert torch.equal(p, p_ref), f"step {step}: {name} differs by {(p - p_ref).abs().max().item()}"


def test_each_key_is_traced_once_under_autocast():
    """The capture turns the autocast cache off; the warm-up traces with it off too, so a key is one trace
    (not two: Dynamo guards on the cache's state), and six sequence lengths are six traces, all captured."""
    import torch._dynamo.utils as dynamo_utils

    ref, m = _twins(Pair)
    m = graph_opt.autocudagraph(m, level=1)
    dynamo_utils.counters.clear()
    lengths = [3, 4, 5, 6, 7, 8]
    inputs = [(torch.randn(2, n, HIDDEN),) for n in lengths for _ in range(3)]

    def loss_of(y):
        return y.float().pow(2).mean()

    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
    for args in inputs:
        for model, opt in zip((ref, m), opts):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(*args)
            loss_of(y).backward()
            opt.step()
        for p_ref, p in zip(ref.parameters(), m.parameters()):
            assert torch.equal(p, p_ref)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == len(lengths)
    s = graph_opt.stats(m)
    assert s.key_levels == {1: len(lengths)} and s.untraced == 0 and s.replays == len(lengths), s


def test_a_key_past_the_compilers_limit_is_captured_from_the_eager_forward_and_said(monkeypatch, caplog):
    """Dynamo's limit of traces per forward spent: the key is captured from the eager forward, one warning
    says so and how to avoid it, stats count it; never a key that stats call traced but runs untraced."""
    from graph_opt.backends.torch import autograd_bridge
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(autograd_bridge, "_TRACES_PER_FORWARD", 2)
    ref, m = _twins(Pair, seed=1)
    caplog.set_level(logging.WARNING, logger="graph_opt")
    inputs = [(torch.randn(2, n, HIDDEN),) for n in (3, 4, 5, 6) for _ in range(3)]
    with dynamo_config.patch(recompile_limit=2):
        m = graph_opt.autocudagraph(m, level=1)
        _sgd_steps(ref, m, inputs, lambda y: y.pow(2).mean())
    s = graph_opt.stats(m)
    assert s.key_levels == {0: 2, 1: 2} and s.untraced == 2 and s.captures == 4 and s.fallbacks == 0, s
    said = [r.getMessage() for r in caplog.records if "captured from the eager forward" in r.getMessage()]
    assert len(said) == 1 and "recompile_limit" in said[0] and "untraced" in said[0], said


def test_a_loss_computed_inside_the_block_is_traced_with_its_logits():
    """(loss, logits) at level 1: the loss is computed from the logits, so the traced backward's zeros for
    the logits add to gradients computed anyway: traced, and eager's gradients, whether the loss alone or
    the loss and a term of the logits are used."""
    ref, m = _twins(WithLoss, seed=2)
    m = graph_opt.autocudagraph(m, level=1)
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(3, 4, HIDDEN, generator=g), torch.randint(0, 5, (3, 4), generator=g)) for _ in range(5)]
    _sgd_steps(ref, m, inputs, lambda out: out["loss"])
    _sgd_steps(ref, m, inputs[:3], lambda out: out["loss"] + out["logits"].pow(2).mean())
    s = graph_opt.stats(m)
    assert s.key_levels == {1: 1} and s.replays >= 5 and s.fallbacks == 0, s


def test_a_backward_that_leaves_out_the_loss_computed_inside_is_refused_then_captured_eagerly():
    """The logits used and the loss computed inside left out: the traced backward would run the loss's
    backward on zeros. Refused with a message naming the fix; that key's next call is captured from the
    eager forward, and its gradients are eager's."""
    ref, m = _twins(WithLoss, seed=3)
    m = graph_opt.autocudagraph(m, level=1)
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(3, 4, HIDDEN, generator=g), torch.randint(0, 5, (3, 4), generator=g)) for _ in range(6)]
    _sgd_steps(ref, m, inputs[:3], lambda out: out["loss"])  # first call, warm-up, capture
    out = m(*inputs[3])
    with pytest.raises(GraphOptError, match="labels="):
        out["logits"].pow(2).mean().backward()
    m.zero_grad(set_to_none=True)
    _sgd_steps(ref, m, inputs[4:], lambda out: out["logits"].pow(2).mean())
    assert graph_opt.stats(m).key_levels == {0: 1}


def test_a_level_0_key_stopped_by_a_host_copy_is_traced_at_level_1(capturing, caplog):
    """The eager forward's capture fails on a tensor made from host data (transformers'
    `torch.tensor(0.0, device=...)` on a device): the key is traced at level 1, where the tensor is made
    once, with one warning; its gradients are eager's."""

    class Masked(Pair):
        def forward(self, x):
            if not torch.compiler.is_compiling() and capturing["on"]:
                raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless "
                                   "the CPU tensor is pinned.")
            return super().forward(x)

    ref, m = _twins(Masked, seed=4)
    m = graph_opt.autocudagraph(m)  # the default level
    caplog.set_level(logging.WARNING, logger="graph_opt")
    inputs = [(torch.randn(2, 5, HIDDEN),) for _ in range(7)]
    _sgd_steps(ref, m, inputs, lambda y: y.pow(2).mean())
    s = graph_opt.stats(m)
    assert s.key_levels == {1: 1} and s.retraced == 1 and s.replays >= 2 and s.fallbacks == 0, s
    said = [r.getMessage() for r in caplog.records if r.name == "graph_opt"]
    assert len(said) == 1 and "traced at level 1" in said[0] and "pinned" in said[0], said

    explicit = graph_opt.autocudagraph(copy.deepcopy(ref), level=0)  # asked for the eager forward: kept
    for args in inputs[:4]:
        explicit(*args).sum().backward()
    s = graph_opt.stats(explicit)
    assert s.captures == 0 and s.retraced == 0 and s.capture_failures == 1 and s.fallbacks == 3, s


def test_a_refused_key_runs_the_plain_forward(capturing, monkeypatch):
    """A key whose capture failed (a sync: tracing would not help, so no retrace) runs eagerly at the cost
    of eager: with no graphs held, its calls do not go through the watch of what the forward writes."""

    class Syncing(Pair):
        def forward(self, x):
            if capturing["on"]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().forward(x)

    ref, m = _twins(Syncing, seed=5)
    m = graph_opt.autocudagraph(m)
    x = torch.randn(2, 3, HIDDEN)
    for _ in range(2):  # the warm-up, then the capture, which fails
        m(x).sum().backward()
    block = graph_opt.training.api.state_of_training(m)
    watched = []
    monkeypatch.setattr(block.watch, "eager", lambda *a: watched.append(a))
    y = m(x)
    assert not watched and torch.equal(y, type(ref).forward(ref, x))
    s = graph_opt.stats(m)
    assert s.capture_failures == 1 and s.retraced == 0 and s.fallback_reasons == {"capture_failed": 2}, s
