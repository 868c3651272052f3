"""Tensor parallelism on two and on four GPUs: NCCL, SymmMemAllReduce (symmetric memory, one_shot_all_reduce)
and real CUDA graphs. Skipped with fewer than two CUDA devices; the four-rank run with fewer than four.

    python -m pytest tests/gpu/test_gpu_multigpu.py -q

The scenarios of tests/multirank (tests/multirank_kit.py), each rank on its own GPU in a spawned
process, under a hard deadline: every mode against the unsharded model (level 2 included), the
same sizes largest first on every rank, capture sizes that differ, a capture fault on rank 1, lazy
captures, and seed 001, where a real graph's registered path shows in the buffer it writes.
"""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_available(),
    reason="needs two CUDA devices and torch.distributed")

import multirank_kit as kit  # noqa: E402
from sections import shared_tests  # noqa: E402

globals().update(shared_tests("multirank_kit"))

DEADLINE_S = 420


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def results(request, tmp_path_factory):
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    return kit.run_ranks("cuda", list(kit.SCENARIOS), str(tmp_path_factory.mktemp("ranks")), DEADLINE_S, world=world)


@pytest.fixture(scope="module")
def real_graphs():
    return True
