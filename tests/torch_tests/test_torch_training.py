"""graph_opt.autocudagraph on torch, with simulated graphs: tests/training_kit.py's specification, run
with the torch shim below (tests/gpu/test_gpu_training.py runs it on real graphs), and torch's own cases.
"""
import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from training_kit import *  # noqa: E402,F401,F403  the shared tests, collected here
from training_kit import assert_same_step, graph_warnings, twins  # noqa: E402
from torch_training_shim import Block, TorchShim  # noqa: E402


@pytest.fixture
def F():
    with graph_opt.testing.simulate_cuda_graphs():
        yield TorchShim()


@pytest.fixture
def autocast_tolerance():
    return 0.0  # simulated replays run the same bf16 kernels as eager


# -- torch's own cases -----------------------------------------------------------------------------
def test_swapping_a_parameters_data_is_detected(F, caplog):
    ref, m = twins(F, warmup_steps=0)
    x = F.randn([4, 6, F.hidden], seed=1)
    assert_same_step(F, ref, m, x, seed=0)
    new = F.randn(list(ref.down.weight.shape), seed=5)
    with torch.no_grad():
        ref.down.weight.data = new.clone()
        m.down.weight.data = new.clone()  # same Parameter object, new storage
    F.zero_grads(ref), F.zero_grads(m)
    assert_same_step(F, ref, m, x, seed=1)
    assert graph_opt.stats(m).recaptures == 1


def test_autocast_cache_is_off_while_capturing():
    """The weight cast cached by an eager call in the same autocast region must not be baked in."""
    with graph_opt.testing.simulate_cuda_graphs(), torch.autocast("cpu", dtype=torch.bfloat16):
        m = graph_opt.autocudagraph(Block(16), warmup_steps=1)
        seen = []
        real = torch.is_autocast_cache_enabled

        def spy(x):
            seen.append((graph_opt.is_capturing(), real()))
            return x

        m.norm.register_forward_hook(lambda mod, i, o: spy(o))
        x = torch.randn(2, 16, requires_grad=True)
        for _ in range(3):
            m(x).float().sum().backward()
    assert (True, False) in seen and (False, True) in seen


def test_a_second_backward_with_retain_graph_replays_again(F):
    ref, m = twins(F, warmup_steps=0)
    x = F.randn([4, 6, F.hidden], seed=2)
    y = m(F.leaf(x, True))
    y_ref = ref(F.leaf(x, True))
    for _ in range(2):
        F.loss(y).backward(retain_graph=True)
        F.loss(y_ref).backward(retain_graph=True)
    for (name, p_ref), (_, p) in zip(F.named_params(ref), F.named_params(m)):
        assert F.equal(p.grad, p_ref.grad), name
    assert graph_opt.stats(m).backward_replays == 2


def test_without_cuda_or_simulation_it_runs_eagerly_with_one_warning(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA graphs")
    m = graph_opt.autocudagraph(Block(16), warmup_steps=0)
    caplog.clear()
    for _ in range(3):
        m(torch.randn(2, 16, requires_grad=True)).sum().backward()
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"no_graphs": 3} and s.captures == 0
    assert len(graph_warnings(caplog)) == 1


def test_second_order_gradients_are_refused_clearly(F):
    _, m = twins(F, warmup_steps=0)
    y = m(F.leaf(F.randn([4, 6, F.hidden], seed=1), True))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (g,) = torch.autograd.grad(F.loss(y), [m.up.weight], create_graph=True)
        g.sum().backward()
