import os
import sys

import pytest

pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))  # torch_models


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test traces from scratch: no Dynamo cache entries or recompile budget carried over."""
    import torch

    torch._dynamo.reset()
    yield

