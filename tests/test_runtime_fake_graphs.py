"""The core runtime on a tiny fake framework whose graphs really record and replay ops.

No framework is needed: tensors are numpy arrays, every op records itself into the graph being
captured, and replay re-runs the recorded ops in place without running any Python of the model. This
drives the real-graph path of the level-0 runtime (pieces, splitting ops, landing buffers, memory
pools) on any machine.
"""
import contextlib
import sys

import numpy as np
import pytest

from graph_opt import GraphOptConfig
from graph_opt.capture import split
from graph_opt.capture.level0 import EagerStrategy
from graph_opt.replay.runner import GraphRunner
from graph_opt.replay.signature import REQUIRED

_capturing = []  # the FakeGraph being captured, if any


class T:
    """A fake tensor over a numpy array (views share memory, as device tensors do).

    With a BlockPool active, op results own a block that returns to the pool when the tensor dies,
    as with a caching allocator: `base` keeps the block of a view's tensor alive."""

    def __init__(self, a, pool=None, base=None):
        self.a = a
        self.pool = pool
        self.base = base

    @property
    def shape(self):
        return self.a.shape

    def __del__(self):
        if self.pool is not None:
            self.pool.give(self.a)


class BlockPool:
    """Freed blocks are handed out again (filled with NaN meanwhile, so a stale read shows)."""

    def __init__(self):
        self.free = {}
        self.live = self.peak = self.reused = 0

    def take(self, shape, dtype):
        self.live += 1
        self.peak = max(self.peak, self.live)
        blocks = self.free.get((shape, dtype))
        if blocks:
            self.reused += 1
            return blocks.pop()
        return np.empty(shape, dtype)

    def give(self, a):
        self.live -= 1
        a[...] = np.nan
        self.free.setdefault((a.shape, a.dtype), []).append(a)


_pools = []  # the BlockPool op results come from, if any


def op(fn, *inputs):
    value = fn(*[i.a for i in inputs])
    if _pools:
        block = _pools[-1].take(value.shape, value.dtype)
        block[...] = value
        out = T(block, _pools[-1])
    else:
        out = T(value)
    if _capturing:  # a graph does not keep the tensors it reads and writes alive
        _capturing[-1].tape.append((fn, [T(i.a) for i in inputs], T(out.a)))
    return out


def _same(a):
    return a


class FakeGraph:
    def __init__(self, pool):
        self.pool = pool
        self.tape = []
        self.replays = 0

    def capture_begin(self):
        _capturing.append(self)

    def capture_end(self):
        _capturing.remove(self)

    def replay(self):
        self.replays += 1
        for fn, inputs, out in self.tape:
            out.a[...] = fn(*[i.a for i in inputs])  # written in place, at the captured address

    def reset(self):
        self.tape = []


class FakeAdapter:
    name = "fake"

    def __init__(self):
        self.pools = 0
        self.graphs = []

    def is_tensor(self, x):
        return isinstance(x, T)

    def static_address(self, t):
        return False

    def shape(self, t):
        return t.a.shape

    def dtype(self, t):
        return t.a.dtype

    def device(self, t):
        return "host"

    def training_modules(self, model):
        return []

    def zeros_like(self, t, dim, size):
        shape = list(t.a.shape)
        if dim is not None:
            shape[dim] = size
        return T(np.zeros(shape, t.a.dtype))

    def alias(self, t):
        return T(t.a.view(), base=t)

    def keep_values(self, t):
        t.a, t.base = t.a.copy(), None

    def model_tensors(self, model):
        return []

    def narrow(self, t, dim, length):
        index = [slice(None)] * t.a.ndim
        index[dim] = slice(0, length)
        return T(t.a[tuple(index)], base=t)

    def copy_(self, dst, src):
        dst.a[...] = src.a
        if _capturing:  # a copy inside a capture is a node of the graph, as on a device
            _capturing[-1].tape.append((_same, (T(src.a),), T(dst.a)))

    def data_ptr(self, t):
        return t.a.__array_interface__["data"][0]

    def on_host(self, t):
        return False  # the fake graphs' tensors stand for device memory

    def nbytes(self, t):
        return t.a.nbytes

    def extent(self, t):
        start = self.data_ptr(t)
        if not t.a.size:
            return start, start
        return start, start + sum((n - 1) * s for n, s in zip(t.a.shape, t.a.strides)) + t.a.itemsize

    def layout(self, t):
        return (t.a.dtype, "host")

    def weak_alias(self, t):
        return T(t.a)  # the same memory, not keeping its block

    def clone(self, t):
        return T(t.a.copy())

    def same_values(self, a, b):
        return a.a.shape == b.a.shape and a.a.dtype == b.a.dtype and bool(
            np.array_equal(a.a, b.a, equal_nan=a.a.dtype.kind in "fc"))

    def fill_(self, t, value):
        t.a[...] = value

    def rows(self, t, dim, start, stop):
        index = [slice(None)] * t.a.ndim
        index[dim] = slice(start, stop)
        return T(t.a[tuple(index)], base=t)

    def fill_rows(self, t, dim, start, stop, value):
        self.rows(t, dim, start, stop).a[...] = value

    def stride(self, t):
        return t.a.strides

    def version(self, t):
        return 0  # the fake model never writes its inputs

    def dense(self, t):
        return t.a.flags.c_contiguous

    def compact(self, t):
        return t

    def all_equal_to(self, t, value):
        return bool((t.a == value).all())

    def varied(self, t):
        a = t.a
        if a.dtype.kind != "f" or a.size < 2 or not (a == a.flat[0]).all():
            return t
        return T(((np.arange(a.size) * 0.6180339887498949) % 1.0 - 0.5).reshape(a.shape).astype(a.dtype))

    def max_abs_diff(self, a, b):
        return float(np.abs(a.a.astype(np.float64) - b.a.astype(np.float64)).max()) if a.a.size else 0.0

    def max_abs(self, t):
        return float(np.abs(t.a).max()) if t.a.size else 0.0

    def eps(self, t):
        return float(np.finfo(t.a.dtype).eps) if t.a.dtype.kind == "f" else 0.0

    value_types = ()

    def grad_enabled(self):
        return False

    def no_grad(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass

    def graphs_supported(self):
        return True

    def new_pool(self):
        self.pools += 1
        return f"pool{self.pools}"

    def new_graph(self, pool):
        graph = FakeGraph(pool)
        self.graphs.append(graph)
        return graph

    def capture_stream(self):
        return contextlib.nullcontext()

    def memory_in_use(self):
        return None

    def release_memory(self):
        pass


W = np.random.RandomState(0).randn(4, 4).astype(np.float32)
split_calls = []


@split.splitting_op(name="fake_rowscale")
def rowscale(x):
    split_calls.append(1)
    return op(lambda a: a * np.arange(1, a.shape[0] + 1, dtype=a.dtype)[:, None], x)


def forward_calls():
    calls = []

    def forward(x):
        calls.append(1)
        h = op(lambda a: a @ W, x)
        h = rowscale(h)
        return op(lambda a: np.tanh(a) + 1.0, h)

    return forward, calls


def runner_for(config, adapter, forward):
    selection = None if config.full_cuda_graph else split.SplitSelection(config.cudagraph_splitting_ops)
    strategy = EagerStrategy(forward, adapter, selection)
    return GraphRunner(adapter=adapter, config=config, strategy=strategy, eager=forward, dynamic_arg_dims=None,
                       params=[("x", REQUIRED)], name="fake")


def eager(x):
    return np.tanh((x @ W) * np.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]) + 1.0


@pytest.mark.parametrize("full", [True, False])
def test_replays_run_no_model_python_and_match_eager(full):
    adapter = FakeAdapter()
    forward, calls = forward_calls()
    config = GraphOptConfig(cudagraph_capture_sizes=[2, 4], full_cuda_graph=full, cudagraph_num_of_warmups=2)
    runner = runner_for(config, adapter, forward)
    for size in (4, 2):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    # per size: warmups + capture, and the eager run its replay is checked against (capture_checks)
    assert len(calls) == 2 * (2 + 1 + 1)
    calls.clear()
    split_calls.clear()
    rng = np.random.RandomState(1)
    for n in (4, 3, 2, 1):
        x = rng.randn(n, 4).astype(np.float32)
        out = runner(T(x))
        # The fake splitting op scales rows by their index in the padded batch, which is the same
        # for real rows: real rows match the unpadded eager run.
        np.testing.assert_allclose(out.a, eager(x), rtol=1e-6)
    assert calls == []  # replays ran recorded ops only
    assert split_calls == ([] if full else [1, 1, 1, 1])  # the splitting op runs eagerly at every replay
    assert runner.counters.replays == 4 and runner.counters.fallbacks == 0
    assert {size: e.captured.pieces for size, e in next(iter(runner.signatures.values())).entries.items()} == \
        ({4: 1, 2: 1} if full else {4: 2, 2: 2})


def test_splitting_op_results_land_in_one_buffer_shared_by_every_size():
    adapter = FakeAdapter()
    forward, _ = forward_calls()
    runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[1, 2, 4, 8], full_cuda_graph=False), adapter,
                        forward)
    for size in (8, 4, 2, 1):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    landing = runner.strategy.landing.buffers
    assert list(landing) == [(0, 0)] and landing[(0, 0)].a.shape == (8, 4)
    base = adapter.data_ptr(landing[(0, 0)])
    entries = next(iter(runner.signatures.values())).entries
    for size, entry in entries.items():
        (step,) = [s for s in entry.captured.keepalive if hasattr(s, "landed")]
        assert adapter.data_ptr(step.landed[0]) == base  # a view of the one buffer, whatever the size


@pytest.mark.parametrize("unique_pool", [True, False])
def test_one_memory_pool_per_model_only_when_configured(unique_pool):
    adapter = FakeAdapter()
    forward, _ = forward_calls()
    runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[2, 4], full_cuda_graph=False,
                                       use_unique_memory_pool=unique_pool), adapter, forward)
    for size in (4, 2):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    pools = {g.pool for g in adapter.graphs}
    assert len(adapter.graphs) == 4
    assert pools == ({"pool1"} if unique_pool else {None})
    assert adapter.pools == (1 if unique_pool else 0)


@pytest.mark.parametrize("keep", [True, False], ids=["keep_outputs", "no-keep_outputs"])
def test_a_replay_reads_the_captured_buffers_and_hands_out_the_captured_memory(keep):
    """Each call's output is the graph's memory (no copy), in a tensor object of its own; a kept one gets
    its values copied at the next replay (graph_opt/replay/handed_outputs.py). keep_outputs=False: the stored
    output itself, overwritten by the next call."""
    adapter = FakeAdapter()
    forward, _ = forward_calls()
    runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[4], keep_outputs=keep), adapter, forward)
    runner.capture((T(np.ones((4, 4), np.float32)),), {}, 4)
    (stored,) = [e.captured.outputs for e in next(iter(runner.signatures.values())).entries.values()]
    zeros, twos = np.zeros((4, 4), np.float32), np.full((4, 4), 2.0, np.float32)
    first = runner(T(zeros))
    assert np.shares_memory(first.a, stored.a)
    second = runner(T(twos))
    assert np.shares_memory(second.a, stored.a)
    np.testing.assert_allclose(second.a, eager(twos), rtol=1e-6)
    if keep:
        assert second is not first and not np.shares_memory(first.a, stored.a)
        np.testing.assert_allclose(first.a, eager(zeros), rtol=1e-6)  # kept: its own values
    else:
        assert second is first  # overwritten in place by the replay


@pytest.mark.parametrize("full", [True, False])
def test_smaller_sizes_write_their_outputs_into_the_largest_sizes_storage(full):
    """graph_opt.replay.output_sharing: a smaller size's graph ends with a copy of its batch-major outputs into
    the rows of the largest size's output, and returns views of those; a fixed-shape output keeps its own."""
    from graph_opt.replay.output_sharing import shares_storage

    adapter = FakeAdapter()

    def forward(x):
        h = op(lambda a: np.tanh(a @ W), x)
        if not full:
            h = rowscale(h)
        return h, op(lambda a: a.sum(axis=0)[:3], h)  # [batch, 4] and a fixed-shape [3]

    config = GraphOptConfig(cudagraph_capture_sizes=[1, 2, 4, 8], full_cuda_graph=full)
    runner = runner_for(config, adapter, forward)
    for size in (8, 4, 2, 1):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    entries = next(iter(runner.signatures.values())).entries
    largest = entries[8].captured.outputs
    for size in (4, 2, 1):
        batch, fixed = entries[size].captured.outputs
        assert shares_storage(adapter, batch, largest[0]) and batch.a.shape == (size, 4)
        assert not shares_storage(adapter, fixed, largest[1])
    rng = np.random.RandomState(2)
    for n in (3, 8, 1, 5):
        x = rng.randn(n, 4).astype(np.float32)
        batch, fixed = runner(T(x))
        want = np.tanh(x @ W) * (np.arange(1, n + 1, dtype=np.float32)[:, None] if not full else 1.0)
        np.testing.assert_allclose(batch.a, want, rtol=1e-6)
    x4 = rng.randn(4, 4).astype(np.float32)
    held = runner(T(x4))[0]
    assert shares_storage(adapter, held, largest[0])
    runner(T(rng.randn(8, 4).astype(np.float32)))  # another size writes the same storage: `held` was kept first
    np.testing.assert_allclose(held.a, np.tanh(x4 @ W) * (np.arange(1, 5, dtype=np.float32)[:, None] if not full else 1),
                               rtol=1e-6)


def counting_copies(monkeypatch):
    """A FakeAdapter whose copy_ calls are counted in the returned list."""
    adapter = FakeAdapter()
    copies = []
    real_copy = adapter.copy_
    monkeypatch.setattr(adapter, "copy_", lambda dst, src: (copies.append(1), real_copy(dst, src)))
    return adapter, copies


@split.splitting_op(name="fake_rowscale_out", out="out")
def rowscale_out(x, out=None):
    """rowscale that writes into `out` when given one, as an attention kernel with an output argument."""
    split_calls.append(1)
    scaled = x.a * np.arange(1, x.a.shape[0] + 1, dtype=x.a.dtype)[:, None]
    if out is None:
        return T(scaled)
    out.a[...] = scaled
    return out if not IGNORE_OUT else T(scaled)


IGNORE_OUT = False


@pytest.mark.parametrize("ignores_out", [False, True])
def test_a_splitting_op_with_out_writes_where_the_next_piece_reads(ignores_out, monkeypatch):
    """@splitting_op(out=...): the replay passes the landing buffer, and no copy of a fresh result follows;
    an op that returns a fresh tensor anyway is still copied (correct either way)."""
    monkeypatch.setattr(sys.modules[__name__], "IGNORE_OUT", ignores_out)
    adapter, copies = counting_copies(monkeypatch)

    def forward(x):
        return op(lambda a: np.tanh(a) + 1.0, rowscale_out(op(lambda a: a @ W, x)))

    config = GraphOptConfig(cudagraph_capture_sizes=[1, 2, 4, 8], full_cuda_graph=False,
                            cudagraph_splitting_ops=["fake_rowscale_out"])
    runner = runner_for(config, adapter, forward)
    for size in (8, 4, 2, 1):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    rng = np.random.RandomState(3)
    for n in (3, 8, 1):
        x = rng.randn(n, 4).astype(np.float32)
        copies.clear()
        np.testing.assert_allclose(runner(T(x)).a, eager(x), rtol=1e-6)
        assert len(copies) == (2 if ignores_out else 1)  # the input copy, and the result's if the op ignored out
    assert runner.counters.replays == 3


def test_splitting_op_out_errors_name_the_keyword():
    with pytest.raises(ValueError, match=r"out=3.*name of the keyword argument"):
        split.splitting_op(out=3)
    with pytest.raises(ValueError, match=r"out='output'.*has no 'output' parameter"):
        split.splitting_op(lambda x: x, name="no_output_param", out="output")


def test_blocks_a_splitting_op_reads_return_to_the_pool_once_the_model_drops_them():
    """A tensor a splitting op reads is held weakly from the op's capture on: the model's references
    decide when its block is reused, as in eager, so a deep model's capture needs as many blocks as
    a shallow one's (held until the size's capture ended, every layer's would be live at once). Later
    pieces write into reused blocks, and replays still match eager."""

    def forward_of(layers):
        def forward(x):
            for _ in range(layers):
                h = rowscale(op(lambda a: a @ W, x))  # the block read by rowscale is dropped right after
                x = op(lambda a, b: np.tanh(a) + b, h, x)
            return x
        return forward

    def reference(x, layers):
        for _ in range(layers):
            x = np.tanh((x @ W) * np.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]) + x
        return x

    peaks = {}
    for layers in (2, 8):
        pool = BlockPool()
        _pools.append(pool)
        try:
            runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[2, 4], full_cuda_graph=False,
                                               cudagraph_splitting_ops=["fake_rowscale"]),
                                FakeAdapter(), forward_of(layers))
            for size in (4, 2):
                runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
            peaks[layers] = pool.peak
            assert pool.reused > 0
            rng = np.random.RandomState(4)
            for n in (4, 3, 2, 1):
                x = rng.randn(n, 4).astype(np.float32)
                np.testing.assert_allclose(runner(T(x)).a, reference(x, layers), rtol=1e-5)
        finally:
            _pools.remove(pool)
    assert peaks[8] == peaks[2], peaks


@split.splitting_op(name="fake_rowscale_into")
def rowscale_into(x, out):
    """rowscale written into a buffer the model made (vLLM's attention with an output argument)."""
    split_calls.append(1)
    out.a[...] = x.a * np.arange(1, x.a.shape[0] + 1, dtype=x.a.dtype)[:, None]
    return out if RETURNS_GIVEN else None


RETURNS_GIVEN = True


@pytest.mark.parametrize("returns_given", [True, False])
def test_a_splitting_op_writing_into_a_buffer_of_the_model_is_not_copied(returns_given, monkeypatch):
    """The buffer comes from a piece's graph, so it sits at a fixed address the next piece reads: whether
    the op returns it or nothing, a replay copies nothing but the input."""
    monkeypatch.setattr(sys.modules[__name__], "RETURNS_GIVEN", returns_given)
    adapter, copies = counting_copies(monkeypatch)

    def forward(x):
        h = op(lambda a: a @ W, x)
        buf = op(np.zeros_like, h)
        returned = rowscale_into(h, buf)
        return op(lambda a: np.tanh(a) + 1.0, returned if returns_given else buf)

    config = GraphOptConfig(cudagraph_capture_sizes=[1, 2, 4, 8], full_cuda_graph=False,
                            cudagraph_splitting_ops=["fake_rowscale_into"])
    runner = runner_for(config, adapter, forward)
    for size in (8, 4, 2, 1):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    assert runner.strategy.landing.buffers == {}
    rng = np.random.RandomState(5)
    for n in (3, 8, 1):
        x = rng.randn(n, 4).astype(np.float32)
        copies.clear()
        np.testing.assert_allclose(runner(T(x)).a, eager(x), rtol=1e-6)
        assert len(copies) == 1  # the input
    assert runner.counters.replays == 3


def test_positional_and_keyword_calls_share_one_signature():
    """m(x) takes the dispatch's fast path (all positional tensors: no walk of the arguments), m(x=x)
    the general one; both must find the same captured graphs."""
    adapter = FakeAdapter()
    forward, calls = forward_calls()
    runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[2, 4]), adapter, forward)
    for size in (4, 2):
        runner.capture((T(np.ones((size, 4), np.float32)),), {}, size)
    x = np.random.RandomState(6).randn(3, 4).astype(np.float32)
    calls.clear()
    a = runner(T(x)).a.copy()
    b = runner(x=T(x)).a.copy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, eager(x), rtol=1e-6)
    assert len(runner.signatures) == 1 and runner.counters.replays == 2 and runner.counters.fallbacks == 0
    assert calls == []


def test_captures_pause_the_collector_and_leave_the_heap_s_freeze_as_the_process_made_it():
    """A server freezes its heap after start-up (gc.freeze) to keep collections short, maybe from another
    thread while a size is being captured: a capture pauses the collector and neither freezes nor
    unfreezes (unfreezing handed the server's whole heap back to the collector)."""
    import gc

    seen = []

    def forward(x):
        seen.append(gc.isenabled())
        if len(seen) == 1:
            gc.freeze()  # the server's freeze, made while the capture runs
        return op(lambda a: a * 2.0, x)

    runner = runner_for(GraphOptConfig(cudagraph_capture_sizes=[2, 4]), FakeAdapter(), forward)
    x = np.random.RandomState(7).randn(3, 4).astype(np.float32)
    was = gc.get_freeze_count()
    gc.unfreeze()
    try:
        out = runner(T(x))  # size 4 captured at this call
        np.testing.assert_array_equal(out.a, x * 2.0)
        assert runner.counters.captures == 1 and runner.counters.replays == 1
        assert seen and not any(seen)  # the collector was paused for the warmups, capture and checks
        assert gc.isenabled() and gc.get_freeze_count() > 0  # the freeze made meanwhile stands
        gc.disable()  # the process's own choice stands too
        runner(T(np.ones((2, 4), np.float32)))  # size 2 captured at this call
        assert runner.counters.captures == 2 and not gc.isenabled()
    finally:
        gc.enable()
        if was:  # as the test session had it (tests/conftest.py freezes what collection imported)
            gc.freeze()
