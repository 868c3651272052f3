"""graph_opt.autocudagraph(DistributedDataParallel(...)) on GPUs: NCCL, each rank on its own GPU in a spawned
process under a hard deadline, real CUDA graphs. The checks of tests/torch_tests/test_torch_training_ddp.py
(tests/torch_zoo/ddp.py check_ranks): every rank holds the same parameters, equal to the eager DDP's it
trained beside, bitwise with two ranks and, with a warm-up step, with four. Skipped with fewer GPUs than
ranks.

    python -m pytest tests/gpu/test_gpu_ddp.py -q

Not yet run: no machine with two GPUs was available to this project since it was written.
"""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_available()
    or not torch.distributed.is_nccl_available(), reason="needs two CUDA devices and NCCL")

from torch_zoo import ddp as kit  # noqa: E402

DEADLINE_S = 240


@pytest.mark.parametrize("world, warmup_steps", [(2, 1), (2, 0), (4, 1), (4, 0)])
def test_ranks_keep_equal_parameters_and_match_eager_ddp(tmp_path, world, warmup_steps):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    kit.check_ranks(str(tmp_path), world, warmup_steps, cuda=True, deadline_s=DEADLINE_S)
