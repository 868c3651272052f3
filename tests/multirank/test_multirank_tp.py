"""Tensor parallelism on two ranks, on CPU: gloo, simulated graphs, a real collective in every forward.

Both ranks run in spawned processes (tests/multirank_kit.py), once for the whole module, under a hard
deadline: a hang fails the module instead of blocking it. Each test checks one scenario's results
from both ranks. The same scenarios run on two GPUs in tests/gpu/test_gpu_multigpu.py.
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import multirank_kit as kit  # noqa: E402
from sections import shared_tests  # noqa: E402

globals().update(shared_tests("multirank_kit"))

_CI_SECONDS = 25  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

SCENARIOS = list(kit.SCENARIOS)  # level 2 included: Inductor's C++ compile costs about 16 s here, cold
DEADLINE_S = 240


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return kit.run_ranks("cpu", SCENARIOS, str(tmp_path_factory.mktemp("ranks")), DEADLINE_S)


@pytest.fixture(scope="module")
def real_graphs():
    return False


def test_scenario_times(results):
    """Keeps the module's cost visible: every scenario's seconds on the slower rank."""
    slow = {name: max(res.get("seconds", 0.0) for res in per_rank) for name, per_rank in results.items()}
    assert all(s < 60 for s in slow.values()), slow
