"""graph_opt.autocudagraph(level=1 | 2) on torch, with simulated graphs (tests/gpu/test_gpu_training.py
runs these on real graphs): the forward traced by Dynamo and AOTAutograd, captured with its backward."""
import copy

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from torch_zoo.training import TorchShim  # noqa: E402

# Level 2 here only where Inductor changes what is checked; tests/gpu runs every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {"test_traced_levels_train_as_eager_does"}

# Level 1 runs eager's kernels: bitwise. Level 2 fuses them (Inductor): float32 rounding, relative.
TOLERANCE = {1: 0.0, 2: 1e-5}


@pytest.fixture
def T():
    with graph_opt.testing.simulate_cuda_graphs():
        yield TorchShim()


def _close(a, b, level) -> bool:
    if TOLERANCE[level] == 0.0:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=TOLERANCE[level], atol=TOLERANCE[level] * b.abs().max().item())


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.inductor)])
def test_traced_levels_train_as_eager_does(T, level, steps=5):
    """SGD steps through a graphed block at level 1 (dropout on: the traced graph draws eager's masks)
    and level 2: outputs, input and parameter gradients, parameters after each step."""
    ref = T.block(dropout=0.1 if level == 1 else 0.0)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level)
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
    for step in range(steps):
        x = T.randn([4, 6, T.hidden], seed=step)
        got = []
        for model, opt in zip((ref, m), opts):
            opt.zero_grad(set_to_none=True)
            xin = x.clone().requires_grad_(True)
            torch.manual_seed(step)
            y = model(xin)
            T.loss(y).backward()
            opt.step()
            got.append((y, xin.grad))
        (y_ref, gx_ref), (y, gx) = got
        assert _close(y, y_ref, level) and _close(gx, gx_ref, level), f"step {step}: output or input grad"
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert _close(p, p_ref, level), f"step {step}: {name} differs by {(p - p_ref).abs().max().item()}"
    s = graph_opt.stats(m)
    assert f"level {level}" in s.mode
    # the first call eager, one traced warmup (it compiles), then the capture and replays
    assert (s.warmups, s.captures, s.replays, s.fallbacks) == (2, 1, steps - 2, 0), s


def test_a_traced_block_with_several_outputs_is_captured_from_its_eager_forward(T, caplog):
    """A traced backward gives an output the loss leaves out a zero gradient (a head's parameters would
    get zeros, not None, and a logged norm's backward NaN): such a key is captured at level 0."""
    ref = T.monitored_block()
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=1, warmup_steps=0)
    caplog.set_level("INFO", logger="graph_opt")
    for step in range(4):
        x = T.zero_row(T.randn([4, T.hidden], seed=step), 2)
        got = []
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            xin = x.clone().requires_grad_(True)
            y, rms = model(xin)
            T.loss(y).backward()
            got.append([xin.grad] + [p.grad for p in model.parameters()])
        for a, b in zip(*got):
            assert torch.equal(a, b) and not a.isnan().any(), f"step {step}"
    assert graph_opt.stats(m).captures == 1
    assert any("captured from the eager forward" in r.getMessage() for r in caplog.records)


def test_a_forward_that_makes_device_constants_from_python_numbers_is_traced(T):
    """`torch.where(mask, torch.tensor(0.0, device=...), min)` (Hugging Face's eager attention mask): a
    host-to-device copy inside the forward, which a capture of the eager forward refuses on a device.
    Traced, the constant is part of the graph; the gradients are eager's."""

    class Masked(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.lin = torch.nn.Linear(hidden, hidden)

        def forward(self, x):
            h = self.lin(x)
            bias = torch.where(h > 0, torch.tensor(0.0, device=h.device, dtype=h.dtype), torch.finfo(h.dtype).min)
            return torch.softmax(h + bias, -1)

    torch.manual_seed(0)
    ref = Masked(T.hidden).to(T.device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=1)
    for step in range(4):
        x = T.randn([4, T.hidden], seed=step)
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            T.loss(model(x)).backward()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert torch.equal(p.grad, p_ref.grad), f"step {step}: grad of {name}"
    s = graph_opt.stats(m)
    assert s.captures == 1 and s.replays == 2 and s.capture_failures == 0, s


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.inductor)])
def test_a_plain_attribute_set_after_capture_is_traced_and_captured_again(T, level):
    """`block.temperature = 2.0` between steps at a traced level: the captured graph baked the value
    (replays skip Dynamo's guards), so it is captured again; the trace follows Dynamo's own guards."""

    class Tempered(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.lin = torch.nn.Linear(hidden, hidden)
            self.temperature = 1.0

        def forward(self, x):
            return torch.tanh(self.lin(x)) / self.temperature

    torch.manual_seed(0)
    ref = Tempered(T.hidden).to(T.device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=0)
    for step, temperature in enumerate((1.0, 1.0, 1.0, 2.0, 2.0, 3.0)):
        ref.temperature = m.temperature = temperature
        x = T.randn([4, T.hidden], seed=step)
        got = []
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            xin = x.clone().requires_grad_(True)
            y = model(xin)
            T.loss(y).backward()
            got.append([y, xin.grad, model.lin.weight.grad])
        for a, b in zip(*got):
            assert _close(a, b, level), f"step {step} (temperature {temperature})"
    s = graph_opt.stats(m)
    assert s.recaptures == 2 and s.replays == 3, s  # after a recapture a traced key counts its outputs again (eager)


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.inductor)])
def test_a_second_output_that_starts_carrying_gradients_is_not_traced(T, level):
    """A traced block whose auxiliary head is frozen at first (one output carries gradients), then
    unfrozen while the loss leaves its output out: eager leaves the head's .grad None and makes no NaN
    (its output is a norm at an all-zero row); the traced backward would give zeros and NaN."""

    class Aux(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.lin = torch.nn.Linear(hidden, hidden)
            self.aux = torch.nn.Linear(hidden, hidden, bias=False)

        def forward(self, x):
            return torch.tanh(self.lin(x)), self.aux(x).pow(2).sum(-1).sqrt()

    torch.manual_seed(0)
    ref = Aux(T.hidden).to(T.device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=0)
    for model in (ref, m):
        model.aux.weight.requires_grad_(False)
    for step in range(6):
        if step == 3:
            for model in (ref, m):
                model.aux.weight.requires_grad_(True)
        x = T.zero_row(T.randn([4, T.hidden], seed=step), 1)
        got = []
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            y, _ = model(x)
            T.loss(y).backward()
            got.append([model.lin.weight.grad, model.aux.weight.grad])
        (lin_ref, aux_ref), (lin, aux) = got
        assert aux is None and aux_ref is None, f"step {step}: the unused head got a gradient"
        assert _close(lin, lin_ref, level), f"step {step}"
