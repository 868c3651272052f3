"""Inference replays never silently wrong, on real CUDA graphs: tests/replay_safety_kit.py and the
torch-only cases with the torch shim on the GPU. Skipped without a CUDA device."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_tests"))

from test_torch_replay_safety import *  # noqa: E402,F401,F403  the shared and torch-only tests
from torch_replay_shim import TorchF  # noqa: E402


@pytest.fixture
def F():
    yield TorchF("cuda")
    torch.cuda.synchronize()
