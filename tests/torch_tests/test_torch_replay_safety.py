"""Inference replays never silently wrong, on torch: tests/replay_safety_kit.py with simulated graphs
on CPU, plus the torch-only cases (autocast, inference_mode, a replaced parameter at level 0)."""
import pytest
import torch

import graph_opt
from replay_safety_kit import *  # noqa: F401,F403  the shared tests, collected here
from replay_safety_kit import HIDDEN, capture, pair, warned  # noqa: F401
from torch_replay_shim import Scaled, TorchF


@pytest.fixture
def F():
    return TorchF("cpu")


@pytest.fixture(params=[0, 1, pytest.param(2, marks=pytest.mark.inductor)], ids=lambda v: f"level{v}")
def level(request):
    return request.param


@pytest.fixture(params=[True, False], ids=["graphs", "no-graphs"])
def graphs(request):
    return request.param


# -- torch only (tests/gpu/test_gpu_replay_safety.py runs them on a device too) --------------------------
@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_autocast_is_part_of_what_a_replay_must_match(F, level, logs):
    m, twin = pair(F, Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        with F.autocast():
            out, ref = m(x), twin(x)
        assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
        assert torch.equal(m(x), twin(x)) and m(x).dtype == torch.float32
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallbacks == 1
    assert warned(logs, "autocast") or warned(logs, "GLOBAL_STATE")


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_capture_under_inference_mode_replays_under_no_grad(F, level):
    m, twin = pair(F, Scaled, level)
    with torch.inference_mode():
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        out = m(x)
        assert torch.equal(out, twin(x))
        out.add_(0)  # an ordinary tensor, as eager's output is
    with torch.inference_mode():
        assert torch.equal(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.replay_failures == 0 and s.disabled_reason is None


def test_a_parameter_replaced_after_capture_is_never_replayed_stale_at_level_0(F, logs):
    m, twin = pair(F, Scaled, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        new = torch.nn.Parameter(torch.full_like(m.lin.weight, 0.25))
        m.lin.weight = new
        twin.lin.weight = torch.nn.Parameter(new.detach().clone())
        assert torch.allclose(m(x), twin(x))
        assert torch.allclose(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"replaced": 2}
    assert len(warned(logs, "replaced by a new object")) == 1
