"""The fixtures of the tests run on both frameworks: each takes `fw` (tests/conftest.py), the framework's
zoo, and gives a section its shim. tests/gpu defines the same names with the torch shims on a device."""
import types

import pytest

import graph_opt


# -- replay safety (test_replay_*.py) ------------------------------------------------------------------------
@pytest.fixture
def F(fw):
    """The replay-safety shim: tensor operations, and the models of the cases (M)."""
    return fw.replay_shim()


@pytest.fixture
def M(F):
    return F.models()


@pytest.fixture(params=[True, False], ids=["graphs", "no-graphs"])
def graphs(request):
    return request.param


# -- autocudagraph (test_training_spec.py) --------------------------------------------------------------------
@pytest.fixture
def T(fw):
    """The training shim: the blocks autocudagraph is given, and their tensor operations."""
    with graph_opt.testing.simulate_cuda_graphs():
        yield fw.training_shim()


@pytest.fixture
def autocast_tolerance():
    # torch: simulated replays run the same bf16 kernels as eager; Paddle's CPU build runs auto_cast regions
    # in float32 (it warns), and the key still holds the amp state
    return 0.0


# -- full_and_piecewise dispatch (test_dispatch_modes.py) -----------------------------------------------------
@pytest.fixture
def D(fw):
    """The framework's demo decoder (graph_opt.benchmarks), captured in simulated graphs."""
    return types.SimpleNamespace(demo=fw.demo, simulated=graph_opt.testing.simulate_cuda_graphs)


# -- async host outputs (test_host_outputs.py) ----------------------------------------------------------------
@pytest.fixture
def H(fw):
    with fw.no_grad(), graph_opt.testing.simulate_cuda_graphs():
        yield fw.host_outputs_shim()


# -- soak and faults (test_soak_and_faults.py) ----------------------------------------------------------------
@pytest.fixture
def kit(fw):
    return fw.soak_kit()
