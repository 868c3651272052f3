"""autocudagraph's training graphs in ordinary usage (torch, simulated graphs), each checked against an
undecorated eager twin with the same weights and seeds."""
import copy
import logging

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402

H = 8


pytestmark = pytest.mark.usefixtures("simulated")


def _twins(cls, seed=0):
    torch.manual_seed(seed)
    ref = cls()
    return ref, copy.deepcopy(ref)


def _same(ref, m):
    for (name, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        assert torch.equal(a, b), name
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name
    for (name, a), (_, b) in zip(ref.named_buffers(), m.named_buffers()):
        assert torch.equal(a, b), name


class Critic(torch.nn.Module):
    """A GAN discriminator with batch norm (DCGAN's)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)
        self.bn = torch.nn.BatchNorm1d(H)
        self.out = torch.nn.Linear(H, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


@pytest.mark.parametrize("level", [None, 0, 1])
def test_batch_norm_block_called_on_real_and_fake_before_one_backward(level):
    """D(real) and D(fake) in one loss, the block holding a batch norm. The first call runs eagerly (a
    warm-up; at levels 1 and 2 the key's first look) and saves the running statistics for its backward;
    the second call captures (or runs traced), and putting the statistics back with copy_ (or AOTAutograd
    writing them back) moved their version counters, which eager's kernel never does: the first call's
    backward raised "modified by an inplace operation" at the very first step."""
    ref, m = _twins(Critic)
    m = graph_opt.autocudagraph(m, level=level)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (ref, m)]
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        real, fake = torch.randn(6, H, generator=g), torch.randn(6, H, generator=g)
        for model, opt in zip((ref, m), opts):
            opt.zero_grad()
            (model(real).pow(2).mean() + model(fake).pow(2).mean()).backward()
            opt.step()
        _same(ref, m)
    assert graph_opt.stats(m).replays >= 6


class TwoOut(torch.nn.Module):
    """An output and a logged norm (not detached), and a tensor made from host data that stops a
    capture of the eager forward on a device."""

    flag = None

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(H, H)
        self.b = torch.nn.Linear(H, H)

    def forward(self, x):
        if TwoOut.flag is not None and TwoOut.flag["on"] and not torch.compiler.is_compiling():
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the "
                               "CPU tensor is pinned")
        h = torch.relu(self.a(x))
        return self.b(h), h.norm()


def test_a_retraced_key_with_several_outputs_and_no_root_settles_eager(capturing, monkeypatch):
    """Default level: the eager capture fails on host data, so the key is retraced; tracing finds two
    outputs carrying gradients and no root, so it is captured from the eager forward, which fails on the
    host data again. That looped for ever: every third call another warm-up and failed capture (on a
    device, a capture attempt each time), `retraced` and `capture_failures` growing with the steps and no
    fallback counted. Expected: one retrace, then the key runs eagerly."""
    monkeypatch.setattr(TwoOut, "flag", capturing)
    ref, m = _twins(TwoOut)
    m = graph_opt.autocudagraph(m)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (ref, m)]
    for _ in range(12):
        x = torch.randn(2, 3, H)
        for model, opt in zip((ref, m), opts):
            opt.zero_grad()
            model(x)[0].pow(2).mean().backward()
            opt.step()
        _same(ref, m)
    s = graph_opt.stats(m)
    assert s.retraced == 1 and s.capture_failures == 2 and s.fallback_reasons.get("capture_failed", 0) >= 7, s


class WithLoss(torch.nn.Module):
    """(loss, logits) as a Hugging Face model returns with labels=, and a tensor made from host data."""

    flag = None

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, 5)

    def forward(self, x, labels):
        if WithLoss.flag is not None and WithLoss.flag["on"] and not torch.compiler.is_compiling():
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the "
                               "CPU tensor is pinned")
        logits = self.head(torch.tanh(self.body(x)))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_a_retraced_loss_left_out_is_refused_once_at_the_default_level(capturing, monkeypatch):
    """Default level, host data stops the eager capture: the key is retraced at level 1 with the loss as
    its root. The user's loss is their own, from the logits (distillation), so the backward leaving the
    root out is refused (GraphOptError) and the key goes back to the eager forward, whose capture fails
    on the host data again, which retraced it again: the GraphOptError came back every fourth step, for
    ever. Expected: refused once, then the key runs eagerly."""
    monkeypatch.setattr(WithLoss, "flag", capturing)
    ref, m = _twins(WithLoss)
    m = graph_opt.autocudagraph(m)
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in (ref, m)]
    g = torch.Generator().manual_seed(0)
    refused = 0
    for _ in range(14):
        x, y = torch.randn(2, 3, H, generator=g), torch.randint(0, 5, (2, 3), generator=g)
        for model, opt in zip((ref, m), opts):
            opt.zero_grad()
            out = model(x, y)
            try:
                out["logits"].log_softmax(-1).mean().neg().backward()
            except graph_opt.errors.GraphOptError:
                refused += 1
                model.zero_grad()
                type(model).forward(model, x, y)["logits"].log_softmax(-1).mean().neg().backward()
            opt.step()
        _same(ref, m)
    assert refused == 1, refused


class Encoder(torch.nn.Module):
    """A VAE encoder: mu and logvar, two outputs of one chunk node."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(H, 2 * H)

    def forward(self, x):
        mu, logvar = self.a(x).chunk(2, -1)
        return mu, logvar


def test_two_outputs_of_one_node_are_not_a_root_and_its_loss(caplog):
    """Level 1: mu and logvar come from one ChunkBackward node, so their (name, sequence number) keys were
    equal and either was taken for "the output computed from all the others" (the root). A loss of
    logvar alone then raised GraphOptError, "leaves out the output the others feed (... a loss computed
    inside the block)", where nothing is computed from anything else and eager is fine. Expected: no
    root, the key captured from the eager forward with the several-outputs warning, eager's gradients."""
    ref, m = _twins(Encoder)
    m = graph_opt.autocudagraph(m, level=1)
    caplog.set_level(logging.WARNING, logger="graph_opt")
    for step in range(5):
        x = torch.randn(3, H)
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            mu, logvar = model(x)
            (mu if step < 3 else logvar).pow(2).mean().backward()
        _same(ref, m)
    assert graph_opt.stats(m).key_levels == {0: 1}
    assert any("none computed from all the others" in r.getMessage() for r in caplog.records)
