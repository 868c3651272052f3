"""Host (CPU) tensor arguments of a training block on the device, on real graphs: a capture bakes in
what it reads of one, so a block must key its graphs by the value (graph_opt/watch/arguments.py), never
replay another call's. tests/test_host_arguments.py shows the classification with the stand-in, which
bakes nothing. Skipped without a CUDA device."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import graph_opt  # noqa: E402
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402


class Scaled(torch.nn.Module):
    """A temperature or loss weight passed as a 0-dim CPU tensor: torch reads it on the host and passes
    it to the kernel as a number, which a graph records."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x, scale):
        return torch.tanh(self.lin(x)) * scale


class Packed(torch.nn.Module):
    """pack_padded_sequence with CPU lengths: they size the kernels, read on the host."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(16, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        y, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(y)


def _steps(ref, m, calls):
    """Forward and backward of each call through both; the largest difference of outputs, input and
    parameter gradients."""
    worst = 0.0
    for args in calls:
        got = []
        for model in (ref, m):
            for p in model.parameters():
                p.grad = None
            x = args[0].clone().requires_grad_(True)
            y = model(x, *args[1:])
            (y * y).sum().backward()
            got.append([y.detach(), x.grad] + [p.grad for p in model.parameters()])
        worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(*got)])
    return worst


@pytest.mark.parametrize("level", [0, 1])
def test_a_0_dim_cpu_scale_is_never_replayed_at_its_captured_value(level):
    torch.manual_seed(0)
    ref = Scaled().cuda()
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=1)
    scales = [2.0, 2.0, 3.0, 3.0, 2.0, 0.5, 0.5, 0.5, 3.0, 2.0, 3.0]
    calls = [(torch.randn(8, 64, device="cuda"), torch.tensor(s)) for s in scales]
    assert _steps(ref, m, calls) == 0.0
    s = graph_opt.stats(m)
    # level 1: a key's first call eager, one traced warmup, then the capture: 2 + 2 + 1 replays
    assert s.keys == 3 and s.replays >= 5 and s.fallbacks == 0, s


@pytest.mark.parametrize("level", [0, 1])
def test_pack_padded_sequence_with_cpu_lengths_varying_between_calls(level):
    torch.manual_seed(0)
    ref = Packed().cuda()
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=1)
    lengths = [[6, 3, 2, 1], [6, 3, 2, 1], [5, 6, 1, 4], [6, 3, 2, 1], [5, 6, 1, 4], [5, 6, 1, 4], [2, 2, 6, 6]]
    calls = [(torch.randn(4, 6, 16, device="cuda"), torch.tensor(n)) for n in lengths]
    # cuDNN's GRU kernels pick their algorithm per call: the same inputs, within rounding
    assert _steps(ref, m, calls) < 1e-5
    s = graph_opt.stats(m)
    assert s.keys + s.fallback_reasons.get("capture_failed", 0) >= 2, s
    print(f"\nlevel {level}: {s.keys} keys, {s.replays} replays, fallbacks {s.fallback_reasons}")
