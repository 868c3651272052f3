"""The specification of async host outputs (graph_opt.to_host_async, host_outputs=), run on each framework
through the fixture `H` (tests/both/conftest.py), the framework's shim (tests/torch_zoo/host_outputs.py,
tests/paddle_zoo/host_outputs.py); tests/gpu/test_gpu_host_outputs.py runs them on real graphs.

The model: a small greedy decoder step. From a state [batch, hidden] it returns
{"next_tokens": int64 [batch], "stop": bool [batch], "state": float [batch, hidden]}.
"""
from __future__ import annotations

import numpy as np
import pytest

import graph_opt

BATCHES = [1, 3, 8]  # 3 is replayed padded to 4: only its real rows come back


def _steps_match_twin(H, model, twin, state, steps: int, keys) -> None:
    """`steps` decode steps of `model` (with host_outputs) and of its plain twin from `state`: at every
    step the futures of `keys` hold the twin's synchronous values, real rows only."""
    twin_state = state
    for step in range(steps):
        out, ref = model(state), twin(twin_state)
        for k in keys:
            assert isinstance(out[k], graph_opt.HostFuture), k
            got, want = out[k].result(), H.numpy(ref[k])
            assert got.shape == want.shape, f"step {step}: {k} has shape {got.shape}; only real rows come back"
            assert np.array_equal(got, want), f"step {step}: {k}"
        state, twin_state = out["state"], ref["state"]


def test_futures_equal_the_synchronous_values_every_step(H):
    for batch in BATCHES:
        model, twin = H.model(host_outputs=["next_tokens", "stop"]), H.model()
        _steps_match_twin(H, model, twin, H.state(batch, seed=batch), 200, ("next_tokens", "stop"))
        assert graph_opt.stats(model).replays == 200


def _decode_sync(H, model, state, limit=256):
    done, tokens = None, []
    for _ in range(limit):
        out = model(state)
        toks, stop = H.numpy(out["next_tokens"]), H.numpy(out["stop"])
        done = stop if done is None else done | stop
        tokens.append(np.where(done & ~stop, -1, toks))
        state = out["state"]
        if done.all():
            break
    return np.stack(tokens)


def _decode_lagged(H, model, state, limit=256):
    """Launch step k+1, then read step k's flags: the host never waits for the step it just launched."""
    done, tokens, extra = None, [], 0
    out = model(state)
    for _ in range(limit):
        nxt = model(out["state"])  # launched before step k is read
        toks, stop = out["next_tokens"].result(), out["stop"].result()
        done = stop if done is None else done | stop
        tokens.append(np.where(done & ~stop, -1, toks))
        out = nxt
        if done.all():
            extra += 1  # the step launched past the end is discarded
            break
    return np.stack(tokens), extra


def test_one_step_lag_gives_the_same_tokens_as_the_synchronous_loop(H):
    lengths = []
    for batch in BATCHES:
        sync_tokens = _decode_sync(H, H.model(), H.state(batch, seed=10 + batch))
        lagged, extra = _decode_lagged(H, H.model(host_outputs=["next_tokens", "stop"]),
                                       H.state(batch, seed=10 + batch))
        assert extra == 1 and len(sync_tokens) < 256  # every row stopped
        assert np.array_equal(lagged, sync_tokens)
        lengths.append(len(sync_tokens))
    assert max(lengths) > 3, "the decodes must run several steps for the lag to matter"


def test_host_outputs_of_a_replay_are_copied_by_its_graph(H):
    model, twin = H.model(host_outputs=["next_tokens", "stop"]), H.model()
    _steps_match_twin(H, model, twin, H.state(3, seed=8), 5, ("stop",))
    stats = graph_opt.stats(model)
    assert stats.replays == 5 and stats.host_copies_in_graph == 5 and stats.host_copies_streamed == 0
    assert stats.graphs == stats.pieces, "level 0: the copies end the forward's own graph, no graph of their own"
    big = H.state(16, seed=9)  # above the largest size: no graph, the copies go the stream way
    assert np.array_equal(model(big)["next_tokens"].result(), H.numpy(twin(big)["next_tokens"]))
    assert graph_opt.stats(model).host_copies_streamed == 1


def test_level_1_copies_in_a_graph_after_the_forwards(H):
    model, twin = H.model(host_outputs=["next_tokens"], level=1), H.model()
    _steps_match_twin(H, model, twin, H.state(4, seed=11), 4, ("next_tokens",))
    stats = graph_opt.stats(model)
    assert stats.host_copies_in_graph == 4 and stats.host_copies_streamed == 0


def test_a_capture_while_a_step_is_unread_leaves_the_caller_s_slots_alone(H):
    # A capture checks each size's padded calls with a replay of its own. That replay is not a call: the
    # ring slot the caller's next step writes stays the next one, so a loop one step behind (depth 2) goes
    # on after clear_graphs() and capture_model(), and padded calls keep replaying.
    model, twin = H.model(host_outputs=["next_tokens"]), H.model()
    first = H.state(3, seed=1)
    pending = model(first)  # launched, not read
    graph_opt.clear_graphs(model)
    report = graph_opt.capture_model(model, lambda bs: H.state(bs, seed=bs), progress=False)
    assert report.failed is None and graph_opt.stats(model).captured_sizes == [1, 2, 4, 8]
    before = graph_opt.stats(model)
    for step, batch in enumerate((5, 3, 7, 3)):
        state = H.state(batch, seed=20 + step)
        launched = model(state)  # then the step before is read: one step of lag
        assert np.array_equal(pending["next_tokens"].result(), H.numpy(twin(first)["next_tokens"])), step
        pending, first = launched, state
    assert np.array_equal(pending["next_tokens"].result(), H.numpy(twin(first)["next_tokens"]))
    stats = graph_opt.stats(model)
    assert stats.replays == before.replays + 4 and stats.fallbacks == before.fallbacks, stats


@pytest.mark.parametrize("in_graph", [True, False], ids=["in_graph", "streamed"])
def test_a_ring_too_shallow_for_the_readers_lag_is_an_error_not_stale_data(H, in_graph, monkeypatch):
    if not in_graph:  # as on a device that cannot write pinned memory from a graph (Paddle on a GPU)
        monkeypatch.setattr(H.adapter, "host_slots", lambda pinned, like: None)
    model = H.model(host_outputs=["next_tokens"], depth=2)
    state = H.state(4, seed=1)
    first = model(state)
    second = model(first["state"])
    pattern = r"ring slot 0.*not been read.*host_ring_depth to 3" if in_graph else r"2 deep.*not yet read.*depth=3"
    with pytest.raises(graph_opt.GraphOptError, match=pattern):
        model(second["state"])
    assert graph_opt.stats(model).disabled_reason is None  # the caller's error: the graphs stay
    want = H.numpy(H.model()(state)["next_tokens"])
    assert np.array_equal(first["next_tokens"].result(), want)  # reading frees a buffer
    third = model(second["state"])
    del second  # a dropped future frees its buffer too
    model(third["state"])
    stats = graph_opt.stats(model)
    assert (stats.host_copies_in_graph, stats.host_copies_streamed) == ((4, 0) if in_graph else (0, 4))


@pytest.mark.parametrize("through", ["host_outputs", "to_host_async"])
def test_a_slow_copy_is_not_overwritten_by_the_next_replay(H, through, monkeypatch):
    """Copies that run after the replay, on the copy stream: the next replay must wait for them."""
    monkeypatch.setattr(H.adapter, "host_slots", lambda pinned, like: None)  # host_outputs go the stream way
    model = H.model(host_outputs=["next_tokens", "stop"]) if through == "host_outputs" else H.model()
    twin = H.model()
    s1 = H.state(8, seed=2)
    with graph_opt.testing.slow_host_copies(polls=5):
        out1 = model(s1)
        tokens1 = out1["next_tokens"] if through == "host_outputs" else graph_opt.to_host_async(out1["next_tokens"])
        assert not tokens1.ready()  # the copy has not landed
        out2 = model(out1["state"])  # the replay rewrites the buffers out1 is copying from
        tokens2 = out2["next_tokens"] if through == "host_outputs" else graph_opt.to_host_async(out2["next_tokens"])
        ref1 = twin(s1)
        want1 = H.numpy(ref1["next_tokens"])
        ref2 = twin(ref1["state"])
        assert not np.array_equal(want1, H.numpy(ref2["next_tokens"]))  # a stale read would show
        assert np.array_equal(tokens1.result(), want1)
        assert np.array_equal(tokens2.result(), H.numpy(ref2["next_tokens"]))
    assert graph_opt.stats(model).replays == 2


def test_two_models_with_host_outputs_interleaved(H):
    a, b = H.model(host_outputs=["next_tokens"]), H.model(host_outputs=["next_tokens"], seed=5)
    ta, tb = H.model(), H.model(seed=5)
    sa = sb = H.state(4, seed=3)
    ra, rb = sa, sb
    pending = []
    for _ in range(20):  # each model keeps one unread future while the other runs
        oa, ob = a(sa), b(sb)
        wa, wb = ta(ra), tb(rb)
        pending.append((oa["next_tokens"], H.numpy(wa["next_tokens"]), ob["next_tokens"], H.numpy(wb["next_tokens"])))
        if len(pending) == 2:
            fa, ea, fb, eb = pending.pop(0)
            assert np.array_equal(fa.result(), ea) and np.array_equal(fb.result(), eb)
        sa, sb, ra, rb = oa["state"], ob["state"], wa["state"], wb["state"]


def test_host_outputs_stay_right_when_capture_failed(H, caplog):
    model = H.model(host_outputs=["next_tokens", "stop"], fail_capture=True)
    twin = H.model(fail_capture=True)  # eager on the 3 rows too: a captured twin would replay them padded to 4
    assert graph_opt.stats(model).capture_failures == 1
    state = ref_state = H.state(3, seed=4)
    for _ in range(10):
        out, ref = model(state), twin(ref_state)
        assert np.array_equal(out["next_tokens"].result(), H.numpy(ref["next_tokens"]))
        assert np.array_equal(out["stop"].result(), H.numpy(ref["stop"]))
        state, ref_state = out["state"], ref["state"]
    assert graph_opt.stats(model).replays == 0


def test_paths_reach_nested_outputs_and_a_path_that_matches_nothing_is_named(H):
    model = H.model(host_outputs=["aux.0", "aux.1.flag"], nested=True)
    out = model(H.state(2, seed=6))
    assert isinstance(out["aux"][0], graph_opt.HostFuture) and out["aux"][0].result().shape == (2,)
    assert isinstance(out["aux"][1]["flag"], graph_opt.HostFuture)
    bad = H.model(host_outputs=["next_tokens", "stopped"])
    with pytest.raises(graph_opt.GraphOptInputError, match=r"'stopped' matches nothing.*next_tokens, stop, state"):
        bad(H.state(2, seed=6))
    with pytest.raises(graph_opt.GraphOptInputError, match="host_outputs='stop'"):
        H.model(host_outputs="stop")
    with pytest.raises(graph_opt.GraphOptInputError, match="'a..b' is not an output path"):
        H.model(host_outputs=["a..b"])
    with pytest.raises(graph_opt.GraphOptInputError, match=r"host_ring_depth=0: expected an int >= 1"):
        H.model(host_outputs=["stop"], depth=0)
    with pytest.raises(graph_opt.GraphOptInputError, match=r"host_ring_depth=3.*name the outputs too"):
        graph_opt.support_graph_optimization(type(H.model()), host_ring_depth=3)
    with pytest.raises(graph_opt.GraphOptInputError, match=r"to_host_async: depth=0: expected an int >= 1"):
        graph_opt.to_host_async(H.state(2, seed=1), depth=0)


def test_to_host_async_on_a_tree(H):
    t = H.state(3, seed=7)
    fut = graph_opt.to_host_async({"a": t, "b": [t, (t, "x")]})
    host = fut.result()
    assert fut.ready() and host["b"][1][1] == "x"
    assert np.array_equal(host["a"], H.numpy(t)) and np.array_equal(host["b"][1][0], H.numpy(t))
    with pytest.raises(graph_opt.GraphOptInputError, match="found no paddle or torch tensor"):
        graph_opt.to_host_async({"a": 1})
    with graph_opt.testing.slow_host_copies(polls=2):
        slow = graph_opt.to_host_async(t)
        assert not slow.ready() and slow.ready()
        assert np.array_equal(slow.result(), H.numpy(t))
