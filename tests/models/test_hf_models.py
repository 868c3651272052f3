"""tests/models/hf_models_kit.py on CPU, with simulated graphs."""
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import graph_opt  # noqa: E402
from sections import shared_tests  # noqa: E402

globals().update(shared_tests("hf_models_kit"))

_CI_SECONDS = 60  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on one model here (Inductor compiles each model for seconds); tests/gpu runs all (tests/conftest.py)
_INDUCTOR_ON_CPU = {"test_inference_replays_equal_eager[level2-full-gpt2]"}


@pytest.fixture
def env():
    # Level 2 (Inductor) is left to the GPU: its CPU compile of BERT's forward and backward took 22 s here
    return SimpleNamespace(device="cpu", graphs=graph_opt.testing.simulate_cuda_graphs, tolerance=0.0, levels=[1])
