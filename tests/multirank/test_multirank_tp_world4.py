"""Tensor parallelism on four ranks, on CPU: the scenarios of test_multirank_tp.py (tests/multirank_kit.py)
with world size 4 (gloo, simulated graphs, a real collective in every forward): every rank captures the
same sizes, a fault on rank 1 drops every rank's graphs, a check that fails on rank 1 makes the three
others run without graphs too. Level 2 is left to two ranks here: four Inductor C++ compiles at once cost
minutes on a 2-core host. tests/gpu/test_gpu_multigpu.py runs them all on four GPUs where present.
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import multirank_kit as kit  # noqa: E402
from sections import shared_tests  # noqa: E402

globals().update(shared_tests("multirank_kit"))

_CI_SECONDS = 40  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

WORLD = 4
MODES = [name for name, mode in kit.MODES.items() if mode.level < 2]
SCENARIOS = [name for name in kit.SCENARIOS if not name.startswith("mode:") or name[len("mode:"):] in MODES]
DEADLINE_S = 300


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return kit.run_ranks("cpu", SCENARIOS, str(tmp_path_factory.mktemp("ranks")), DEADLINE_S, world=WORLD)


@pytest.fixture(scope="module")
def real_graphs():
    return False


@pytest.mark.parametrize("mode", MODES)
def test_ranks_capture_the_same_sizes_largest_first_and_replay_the_unsharded_model(results, mode):
    kit.check_mode(results, mode)


def test_every_scenario_ran_on_four_ranks(results):
    assert all(len(per_rank) == WORLD for per_rank in results.values()), {k: len(v) for k, v in results.items()}
    slow = {name: max(res.get("seconds", 0.0) for res in per_rank) for name, per_rank in results.items()}
    assert all(s < 90 for s in slow.values()), slow
