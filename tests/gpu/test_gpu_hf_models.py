"""tests/models/hf_models_kit.py on a CUDA device, with real graphs. Skipped without one."""
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from sections import shared_tests  # noqa: E402

globals().update(shared_tests("hf_models_kit"))


@pytest.fixture
def env():
    yield SimpleNamespace(device="cuda", graphs=contextlib.nullcontext, tolerance=1e-6, levels=[1, 2])
    torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
