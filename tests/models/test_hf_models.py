"""tests/models/hf_models_kit.py on CPU, with simulated graphs."""
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import graph_opt  # noqa: E402
from hf_models_kit import *  # noqa: E402,F401,F403  the shared tests, collected here


@pytest.fixture
def env():
    return SimpleNamespace(device="cpu", graphs=graph_opt.testing.simulate_cuda_graphs, tolerance=0.0)
