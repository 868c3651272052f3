import pytest


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test traces from scratch: no Dynamo cache entries or recompile budget carried over."""
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    yield
