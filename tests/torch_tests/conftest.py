import pytest

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test traces from scratch: no Dynamo cache entries or recompile budget carried over."""
    import torch

    torch._dynamo.reset()
    yield


@pytest.fixture
def simulated():
    """Simulated graphs around the test."""
    import graph_opt

    with graph_opt.testing.simulate_cuda_graphs():
        yield


@pytest.fixture
def capturing(monkeypatch):
    """{"on": whether a training block's forward graph is being captured now}: the host stand-in refuses no
    host copy or sync, so a test's forward raises torch's error itself while an eager forward is captured."""
    from graph_opt.recorders import host_graphs

    flag = {"on": False}
    begin, end = host_graphs.HostStepForward.capture_begin, host_graphs.HostStepForward.capture_end

    def capture_begin(self):
        flag["on"] = True
        begin(self)

    def capture_end(self):
        flag["on"] = False
        end(self)

    monkeypatch.setattr(host_graphs.HostStepForward, "capture_begin", capture_begin)
    monkeypatch.setattr(host_graphs.HostStepForward, "capture_end", capture_end)
    return flag


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
