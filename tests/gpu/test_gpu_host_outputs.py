"""Async host outputs on real CUDA graphs and streams: tests/both/test_host_outputs.py with the torch shim
on the GPU, and a copy made slow on the device itself. Skipped without a CUDA device."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import numpy as np  # noqa: E402

import graph_opt  # noqa: E402
from graph_opt.backends.torch.adapter import ADAPTER  # noqa: E402
from sections import shared_tests  # noqa: E402
from torch_zoo.host_outputs import TorchHostShim  # noqa: E402

globals().update(shared_tests("test_host_outputs"))


@pytest.fixture
def H():
    with torch.no_grad():
        yield TorchHostShim("cuda")
    torch.cuda.synchronize()


def test_a_copy_delayed_on_the_device_still_reads_its_step(H, monkeypatch):
    """The copy stream sleeps before each copy: the next replay is launched at once and must wait.
    (Copies after the replay, as where a graph cannot write pinned memory.)"""
    monkeypatch.setattr(ADAPTER, "host_slots", lambda pinned, like: None)
    real = ADAPTER.copy_to_host_async

    def slow(buffers, sources):
        if ADAPTER._copy_stream is None:
            ADAPTER._copy_stream = torch.cuda.Stream()
        ADAPTER._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ADAPTER._copy_stream):
            torch.cuda._sleep(20_000_000)  # tens of milliseconds
        return real(buffers, sources)

    model, twin = H.model(host_outputs=["next_tokens"]), H.model()
    s = H.state(8, seed=1)
    ref1 = twin(s)
    want1 = H.numpy(ref1["next_tokens"])
    want2 = H.numpy(twin(ref1["state"])["next_tokens"])
    monkeypatch.setattr(ADAPTER, "copy_to_host_async", slow)
    out1 = model(s)
    assert not out1["next_tokens"].ready()
    out2 = model(out1["state"])  # rewrites the buffer out1's copy reads, unless it waits
    assert np.array_equal(out1["next_tokens"].result(), want1)
    assert np.array_equal(out2["next_tokens"].result(), want2)


def test_results_come_from_pinned_memory_the_graph_wrote(H):
    model = H.model(host_outputs=["stop", "next_tokens"])
    model(H.state(4, seed=2))["stop"].result()
    copies = graph_opt.decorator.state_of(model).host_outputs.in_graph
    assert copies is not None and copies.rings
    assert all(pinned.is_pinned() and device.is_cuda and device.data_ptr() == pinned.data_ptr()
               for pinned, device, _ in copies.rings.values())
    stats = graph_opt.stats(model)
    assert stats.host_copies_in_graph == 1 and stats.host_copies_streamed == 0


def test_a_slow_graph_is_read_only_after_it_ends(H):
    """The forward sleeps on the device: result() must wait for the replay's own event, and a lagged
    reader sees each step's values although the graphs run far behind the host."""
    model = H.model(host_outputs=["next_tokens", "stop"])
    twin = H.model()
    state = ref = H.state(8, seed=3)
    sleeper = torch.cuda.graphs.CUDAGraph()  # a slow graph on the same stream ahead of each step
    with torch.cuda.graph(sleeper):
        torch.cuda._sleep(5_000_000)
    pending = []
    for _ in range(6):
        sleeper.replay()
        out = model(state)
        assert not out["next_tokens"].ready()  # the device is still sleeping ahead of this replay
        want = twin(ref)
        pending.append((out["next_tokens"], H.numpy(want["next_tokens"])))
        if len(pending) == 2:
            future, expected = pending.pop(0)
            assert np.array_equal(future.result(), expected)
        state, ref = out["state"], want["state"]
    future, expected = pending.pop()
    assert np.array_equal(future.result(), expected)
