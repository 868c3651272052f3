"""Inference replays never silently wrong on torch when what is ambient changes after capture: autocast,
the math modes (TF32, reduced-precision reductions, deterministic algorithms, SDPA backends),
inference_mode, the default dtype. Simulated graphs on CPU; tests/gpu/test_gpu_replay_safety.py runs them
on a device."""
import functools

import pytest
import torch

import graph_opt
from replay_support import HIDDEN, capture, eager_padded, pair, warned
from torch_zoo.replay import Scaled

_CI_SECONDS = 1  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch here only where Inductor's kernels change what a replay must get right; tests/gpu runs
# every case at every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {
    "test_under_inference_mode_the_guards_see_a_change_and_leave_the_callers_mode_as_it_was",
}


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_autocast_is_part_of_what_a_replay_must_match(F, level, logs):
    m, twin = pair(F, Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        with F.autocast():
            out, ref = m(x), twin(x)
        assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
        assert torch.equal(m(x), eager_padded(F, twin, x)) and m(x).dtype == torch.float32
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallbacks == 1
    assert warned(logs, "autocast") or warned(logs, "GLOBAL_STATE")


def _math_mode_changes():
    """(what changes the math mode, what sets it back): torch's legacy setters only, since once the newer
    fp32_precision API is used the legacy getters raise for the rest of the process."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return [
        ("allow_tf32", lambda: setattr(cuda, "allow_tf32", not cuda.allow_tf32),
         functools.partial(setattr, cuda, "allow_tf32", cuda.allow_tf32)),
        ("set_float32_matmul_precision", lambda: torch.set_float32_matmul_precision("high"),
         functools.partial(torch.set_float32_matmul_precision, torch.get_float32_matmul_precision())),
        ("cudnn.allow_tf32", lambda: setattr(cudnn, "allow_tf32", not cudnn.allow_tf32),
         functools.partial(setattr, cudnn, "allow_tf32", cudnn.allow_tf32)),
        ("bf16 reduction", lambda: setattr(cuda, "allow_bf16_reduced_precision_reduction", False),
         functools.partial(setattr, cuda, "allow_bf16_reduced_precision_reduction",
                           cuda.allow_bf16_reduced_precision_reduction)),
        ("deterministic", lambda: torch.use_deterministic_algorithms(True),
         functools.partial(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled())),
        ("flash attention", lambda: torch.backends.cuda.enable_flash_sdp(not torch.backends.cuda.flash_sdp_enabled()),
         functools.partial(torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.flash_sdp_enabled())),
    ]


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_math_mode_changed_after_capture_is_not_replayed(F, level, logs):
    # A graph replays the kernels its capture chose: TF32 or not, reduced-precision reductions or not.
    m, twin = pair(F, Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        for name, change, restore in _math_mode_changes():
            before = graph_opt.stats(m)
            try:
                change()
                assert torch.equal(m(x), twin(x))
                assert graph_opt.stats(m).fallbacks == before.fallbacks + 1, name
            finally:
                restore()
            assert torch.equal(m(x), eager_padded(F, twin, x)), name
            assert graph_opt.stats(m).replays == before.replays + 1, name
        with torch.backends.cudnn.flags(enabled=not torch.backends.cudnn.enabled):  # a context manager too
            m(x)
        assert graph_opt.stats(m).fallback_reasons["ambient"] == 7
    assert warned(logs, "the math mode changed since capture")


def test_a_math_mode_set_by_code_dynamo_compiled_is_seen(F):
    # torch.compile'd code may set a flag: Dynamo must not trace the counting (it would bake the count in).
    m, twin = pair(F, Scaled, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    cuda = torch.backends.cuda.matmul
    was = cuda.allow_tf32

    def set_tf32(t, value):
        cuda.allow_tf32 = value
        return t + 1

    compiled = torch.compile(set_tf32, backend="eager")
    try:
        with torch.no_grad():  # eager and compiled sets interleaved, as when the count was baked in
            for value, step in [(not was, set_tf32), (not was, set_tf32), (not was, compiled), (was, set_tf32),
                                (was, compiled), (not was, compiled), (was, compiled), (not was, compiled),
                                (not was, set_tf32), (was, compiled)]:
                step(x, value)
                before = graph_opt.stats(m)
                assert torch.equal(m(x), eager_padded(F, twin, x) if value == was else twin(x))
                after = graph_opt.stats(m)
                assert (after.replays - before.replays, after.fallbacks - before.fallbacks) == \
                    ((1, 0) if value == was else (0, 1)), value
    finally:
        cuda.allow_tf32 = was


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_capture_under_inference_mode_replays_under_no_grad(F, level):
    m, twin = pair(F, Scaled, level)
    with torch.inference_mode():
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.no_grad():
        out = m(x)
        assert torch.equal(out, eager_padded(F, twin, x))
        out.add_(0)  # an ordinary tensor, as eager's output is
    with torch.inference_mode():
        assert torch.equal(m(x), eager_padded(F, twin, x))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.replay_failures == 0 and s.disabled_reason is None


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.inductor)], ids=["level1", "level2"])
def test_under_inference_mode_the_guards_see_a_change_and_leave_the_callers_mode_as_it_was(F, level):
    """The guards run out of inference mode (tensors' dispatch keys differ in it): a changed attribute is
    still seen under it, and the caller is back in inference mode without grad after every call."""
    m, twin = pair(F, Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with torch.inference_mode():
        close = torch.equal if level < 2 else functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
        assert close(m(x), eager_padded(F, twin, x))
        assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
        m.temperature = twin.temperature = 2.0
        assert close(m(x), twin(x))  # Dynamo's guard on temperature fails: no stale replay
        assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.disabled_reason is None, s


class _DefaultDtype(Scaled):
    def forward(self, x):
        return self.lin(x) + torch.zeros(HIDDEN, device=x.device)  # follows torch's default dtype


def test_the_default_dtype_is_part_of_what_a_replay_must_match(F, logs):
    m, twin = pair(F, _DefaultDtype, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(4, HIDDEN, seed=1)
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            out, ref = m(x), twin(x)
    finally:
        torch.set_default_dtype(torch.float32)
    assert out.dtype == ref.dtype == torch.float64 and torch.equal(out, ref)
    assert graph_opt.stats(m).fallback_reasons == {"ambient": 1}
    assert warned(logs, "under no autocast and torch.set_default_dtype(torch.float64); the graphs were captured under "
                        "no autocast and torch.set_default_dtype(torch.float32)")
    with torch.no_grad():
        assert torch.equal(m(x), twin(x)) and graph_opt.stats(m).replays == 1
