import pytest

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test traces from scratch: no Dynamo cache entries or recompile budget carried over."""
    import torch

    torch._dynamo.reset()
    yield


# -- the replay-safety cases of torch's own (test_torch_replay_*.py); tests/gpu gives them on a device ------
@pytest.fixture
def F():
    from torch_zoo.replay_ops import TorchF

    return TorchF("cpu")


@pytest.fixture
def M(F):
    return F.models()


@pytest.fixture(params=[0, 1, pytest.param(2, marks=pytest.mark.inductor)], ids=lambda v: f"level{v}")
def level(request):
    return request.param
