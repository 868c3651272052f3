"""cudagraph_mode full_and_piecewise on torch: tests/dispatch_kit.py with simulated graphs on CPU."""
import pytest

pytest.importorskip("torch")

from dispatch_kit import *  # noqa: E402,F401,F403  the shared tests, collected here
from dispatch_kit import Shim  # noqa: E402
from graph_opt.benchmarks import torch_demo  # noqa: E402


@pytest.fixture
def H():
    return Shim(torch_demo)
