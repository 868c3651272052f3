"""Inference replays never silently wrong, Paddle's own cases (the cases both frameworks share are
tests/both/test_replay_*.py): a buffer written through a view, the default dtype, recurrent layers, and at
level 1 the paths the capture did not take (SOT runs the frames it did not record as plain Python).
(Autocast and inference_mode are torch's; Paddle's CPU build runs auto_cast regions in float32.)"""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt.decorator import state_of  # noqa: E402
from paddle_zoo.replay import Scaled, ScaledHead  # noqa: E402
from paddle_zoo.replay_ops import PaddleF  # noqa: E402
from replay_support import HIDDEN, capture, eager_padded, pair, same, warned  # noqa: E402

_CI_SECONDS = 2  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)


@pytest.fixture
def F():
    return PaddleF()


@pytest.fixture(params=[0, 1], ids=lambda v: f"level{v}")
def level(request):
    return request.param


class _CacheWrittenThroughAView(paddle.nn.Layer):
    """A decode step whose cache is a buffer, written through a slice: no version counter moves."""

    def __init__(self):
        super().__init__()
        self.kv = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.out = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cache", paddle.zeros([8, 4, HIDDEN]))

    def forward(self, x, pos):
        b = x.shape[0]
        onehot = paddle.nn.functional.one_hot(pos, 4).unsqueeze(-1)
        self.cache[:b].set_value(self.cache[:b] * (1 - onehot) + onehot * self.kv(x).unsqueeze(1))
        return self.out(self.cache[:b].sum(1))


def test_a_buffer_written_through_a_view_is_written_by_every_call_or_the_capture_says_why(F, level, logs):
    """Level 0 records the write; SOT's programs drop it (level 1), and the capture finds that by the
    buffer's values and leaves the model to eager calls, with one warning naming the buffer. The cache is
    one row per sequence (`cache[:b]`): at level 0 a padded call's padding rows would write the rows of
    sequences past the call's own, which a larger call reads, so padded calls run without graphs."""
    m, twin = pair(F, _CacheWrittenThroughAView, level)
    with F.graphs():
        report = graph_opt.capture_model(
            m, lambda n: (F.randn(n, HIDDEN, seed=n), paddle.full([n], n % 4, "int64")), progress=False)
        assert (report.failed is None) == (level == 0), report.failed
        for model in (m, twin):
            model.cache.set_value(paddle.zeros([8, 4, HIDDEN]))
        with paddle.no_grad():
            for step in range(4):
                x, pos = F.randn(3, HIDDEN, seed=10 + step), paddle.full([3], step, "int64")
                assert F.equal(m(x, pos), twin(x, pos)), f"step {step}"
                assert F.equal(m.cache, twin.cache), f"step {step}: the cache"
    assert graph_opt.stats(m).replays == 0
    assert warned(logs, "buffer 'cache'", "padding rows write" if level == 0 else "")


class _DefaultDtype(Scaled):
    def forward(self, x):
        return self.lin(x) + paddle.zeros([HIDDEN]) + 0.1  # follows Paddle's default dtype


def test_the_default_dtype_is_part_of_what_a_replay_must_match(F, level, logs):
    """paddle.set_default_dtype after capture: the graphs made float32 zeros; the call answers as eager
    (at level 1 too: SOT's translation, as graph_opt runs it, would keep the float32 program)."""
    m, twin = pair(F, _DefaultDtype, level)
    with F.graphs():
        graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    x = F.randn(3, HIDDEN, seed=1)
    paddle.set_default_dtype("float64")
    try:
        with F.graphs(), paddle.no_grad():
            out, ref = m(x), twin(x)
    finally:
        paddle.set_default_dtype("float32")
    assert out.dtype == ref.dtype == paddle.float64 and F.equal(out, ref)
    assert graph_opt.stats(m).fallback_reasons == {"ambient": 1}
    assert warned(logs, "under no auto_cast and paddle.set_default_dtype('float64'); the graphs were captured under "
                        "no auto_cast and paddle.set_default_dtype('float32')")
    with F.graphs(), paddle.no_grad():
        assert F.equal(m(x), eager_padded(F, twin, x)) and graph_opt.stats(m).replays == 1


class _Recurrent(paddle.nn.Layer):
    """Paddle's RNN layers hold a buffer without memory (`_dropout_state`): data_ptr() of it raises."""

    def __init__(self):
        super().__init__()
        self.rnn = paddle.nn.LSTM(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.rnn(x)[0]


def test_a_recurrent_layer_with_a_buffer_without_memory_is_captured(F, level):
    m, twin = pair(F, _Recurrent, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, 5, HIDDEN, seed=n), progress=False)
    assert report.failed is None, report.failed
    with F.graphs(), paddle.no_grad():
        for real in (4, 2, 8):
            x = F.randn(real, 5, HIDDEN, seed=real)
            assert F.equal(m(x), twin(x)), f"{real} rows"
    assert graph_opt.stats(m).replays == 3


class _CountsInt(Scaled):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_python_state_the_forward_sets_fails_a_level_1_capture_naming_it(F, logs):
    """SOT's translated code does not make the store as a replay needs: the level-1 capture is refused
    for what it is (it used to fail its check, blaming the numbers)."""
    m, twin = pair(F, _CountsInt, 1)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    assert report.failed is not None
    assert warned(logs, "sets Python state as it runs", "'calls'")
    twin.calls = m.calls
    with F.graphs(), paddle.no_grad():
        x = F.randn(3, HIDDEN, seed=1)
        assert F.equal(m(x), twin(x)) and m.calls == twin.calls


# -- level 1: paths the capture did not take (SOT runs the frames it did not record as plain Python) -------
class _BranchingSub(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.lin(x)
        if x.min() > 0:
            h = h * 2.0
        return h


class _SharesABranchingSub(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.sub = _BranchingSub()

    def forward(self, x):
        return self.sub(x) + 1.0


def _level1(cls, **options):
    return pair(PaddleF(), cls, level=1, **options)


def _positive(n, seed):
    x = paddle.randn([n, HIDDEN])
    return x * x + 0.1


def test_a_second_model_running_a_branch_sot_translated_for_the_first_keeps_padded_calls_eager(logs):
    """SOT translates a sublayer's frame once and every model running that code reuses it: the second
    model's capture translates nothing, and its padded calls must still see the branch."""
    for seed in (0, 1):
        m, twin = _level1(_SharesABranchingSub)
        with graph_opt.testing.simulate_cuda_graphs():
            graph_opt.capture_model(m, lambda n: paddle.randn([n, HIDDEN]), progress=False)
        with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
            for real in (3, 5, 4):
                x = _positive(real, seed + real)
                np.testing.assert_allclose(m(x).numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
        assert graph_opt.stats(m).fallback_reasons == {"outputs": 2}, seed


@graph_opt.splitting_op
def _positive_rows(x):
    return bool(x.min() > 0)


@pytest.mark.parametrize("spelling", ["bool", "item", "int", "all", "numpy", "generator", "splitting op"])
def test_a_branch_on_a_value_read_on_the_host_keeps_padded_calls_eager(spelling, logs):
    """`if bool(t)`, `.item()`, `int(t)`, `all(t)` (SOT breaks the graph at the call, not at a jump), a
    generator expression (a frame SOT leaves to plain Python), a splitting op (run eagerly between pieces):
    the read is seen as the forward runs in the capture phase."""
    decide = {"bool": lambda x: bool(x.min() > 0), "item": lambda x: x.min().item() > 0,
              "int": lambda x: int(x.min() > 0) == 1, "all": lambda x: all(x.min(axis=1) > 0),
              "numpy": lambda x: f"{x.min().numpy():.3f}" != "0.000",
              "generator": lambda x: all(v > 0 for v in x.min(axis=1)), "splitting op": _positive_rows}[spelling]

    class Reads(Scaled):
        def forward(self, x):
            h = self.lin(x)
            if decide(x):
                h = h * 2.0
            return h

    m, twin = _level1(Reads, config={"full_cuda_graph": spelling != "splitting op"})
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda n: paddle.randn([n, HIDDEN]), progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for real in (3, 5, 1):
            x = _positive(real, real)
            np.testing.assert_allclose(m(x).numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
    # (SOT may translate no program at all for such a forward: the capture fails and it runs eagerly)
    assert report.failed is not None or warned(logs, "reads a tensor's value on the host")


class _CountsWhenPositive(Scaled):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", paddle.zeros([2]))
        self.hits = 0

    def forward(self, x, w):
        h = self.lin(x)
        if x.mean() > 0:
            self.count[0] = self.count[0] + 1.0
            self.hits += 1
            x.add_(paddle.ones_like(x))
            return w, h * 2.0 + x + self.count[0]
        return h, w


def test_a_path_the_capture_did_not_take_runs_once_and_returns_and_writes_what_eager_does():
    """A call taking the branch the capture did not runs it once (no replay abandoned and run again: the
    count and a Python value advance once), writes the caller's argument as eager does, returns the
    caller's own tensor where that path returns its argument, and its outputs are kept when held."""
    m, twin = _level1(_CountsWhenPositive, dims={"x": 0})
    w = paddle.arange(HIDDEN, dtype="float32")
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: (-paddle.randn([n, HIDDEN]).abs() - 0.1, w), progress=False)
    m.count.set_value(paddle.zeros([2]))
    m.hits = 0
    kept = []
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for i in range(4):
            x = _positive(4, i) * (1.0 if i % 2 == 0 else -1.0)
            x_twin = x.clone()
            out, want = m(x, w), twin(x_twin, w)
            taken = i % 2 == 0
            assert out[0 if taken else 1] is w, "the argument returned is the caller's tensor"
            got, expected = out[1 if taken else 0], want[1 if taken else 0]
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(x.numpy(), x_twin.numpy())  # written on that path, as eager writes it
            kept.append((got, expected.clone()))
            assert float(m.count[0]) == float(twin.count[0]) and m.hits == twin.hits, i
    for got, expected in kept:
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert graph_opt.stats(m).replays == 4


class _WritesWhenPositive(Scaled):
    def forward(self, x):
        h = self.lin(x)
        if x.mean() > 0:
            x.add_(paddle.ones_like(x))
            return h * 2.0 + x
        return h


def test_a_path_the_capture_did_not_take_in_the_common_calls_shortcut_writes_its_argument_back():
    """The same answer from the shortcut (fast_replay.py) as from the full path: its third call, the
    branch taken again once the shortcut answers, wrote nothing into the caller's x before."""
    m, twin = _level1(_WritesWhenPositive)
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: -paddle.randn([n, HIDDEN]).abs() - 0.1, progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for i in range(4):
            x = _positive(4, i) * (1.0 if i % 2 == 0 else -1.0)
            x_twin = x.clone()
            np.testing.assert_allclose(m(x).numpy(), twin(x_twin).numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(x.numpy(), x_twin.numpy())
    assert graph_opt.stats(m).replays == 4
    assert state_of(m).runner.shortcut is not None and state_of(m).runner.shortcut.plans


def test_a_submodule_attribute_set_after_capture_runs_without_graphs_then_replays_again_at_level_0(F, logs):
    """`model.head.scale = 2.0` (a dropout schedule's `drop.p`): level-0 graphs bake what the forward read
    of a submodule as of the model; Layer.__setattr__ counts the set, and the replay looks only then. (torch:
    not seen at level 0, docs/replay-assumptions.md: counting Module.__setattr__ stops Dynamo tracing any
    module whose forward sets an attribute.)"""
    m, twin = pair(F, ScaledHead, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert F.equal(m(x), eager_padded(F, twin, x))
        m.head.scale = twin.head.scale = 2.0
        for _ in range(2):
            assert F.close(m(x), twin(x)), "a replay ignored the submodule's new scale"
        s = graph_opt.stats(m)
        assert s.replays == 1 and s.fallback_reasons == {"attribute": 2}, s
        (message,) = warned(logs, "head.scale")
        assert "head.scale = 2.0 (was 1.0 at capture)" in message, message
        m.head.scale = twin.head.scale = 1  # 1 is not 1.0: the graphs baked a float
        assert F.close(m(x), twin(x)) and graph_opt.stats(m).replays == 1
        m.head.scale = twin.head.scale = 1.0  # back to the captured value: replays resume
        assert F.equal(m(x), eager_padded(F, twin, x))
        assert graph_opt.stats(m).replays == 2


# -- level 1: an object the forward makes at every call (a KV cache built from the cache tensors) -------------
class _Holder:
    def __init__(self, k, scale):
        self.k = k
        self.scale = scale
        self.place = k.place  # a new Place object at every read, equal by value


@graph_opt.splitting_op
def _attend(q, holder):
    return q * holder.k.mean(-1, keepdim=True)


class _MakesAHolder(Scaled):
    """The holder reaches frames SOT translates on their own (its __init__, the frame after the splitting
    op): each gets a new object at every call, which SOT's guards compare by identity."""

    def __init__(self):
        super().__init__()
        self.lin2 = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.scale = 2.0

    def forward(self, x, k):
        holder = _Holder(k, self.scale)
        h = _attend(self.lin(x), holder)
        return self.lin2(h) * holder.scale + holder.k


def test_an_object_the_forward_makes_at_every_call_is_compared_by_content_and_replays():
    m, twin = _level1(_MakesAHolder, config={"full_cuda_graph": False})
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: (paddle.randn([n, HIDDEN]), paddle.randn([n, HIDDEN])),
                                progress=False)
    translated = graph_opt.stats(m).translations
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for real in (4, 2, 3, 8, 5):
            x, k = paddle.randn([real, HIDDEN]), paddle.randn([real, HIDDEN])
            assert bool((m(x, k) == eager_padded(PaddleF(), twin, x, k, batch=(0, 1))).all()), real
    s = graph_opt.stats(m)
    assert (s.replays, s.fallbacks, s.translations) == (5, 0, translated), s.fallback_reasons


class _Signed:
    def __init__(self, k):
        self.k = k
        self.positive = None


@graph_opt.splitting_op
def _attend_and_sign(q, holder):
    holder.positive = bool(holder.k.mean() > 0)
    return q * holder.k.mean(-1, keepdim=True)


class _MakesASignedHolder(Scaled):
    def forward(self, x, k):
        holder = _Signed(k)
        h = _attend_and_sign(self.lin(x), holder)
        return h * (2.0 if holder.positive else -1.0)


def test_an_object_made_at_every_call_with_other_contents_runs_without_graphs_naming_it(logs):
    """What the object holds besides tensors is part of what the capture translated: a call whose object
    holds another value (here decided by a tensor's value) runs without graphs, and the warning names it."""
    m, twin = _level1(_MakesASignedHolder, config={"full_cuda_graph": False})
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: (paddle.randn([n, HIDDEN]), paddle.randn([n, HIDDEN]).abs() + 0.1),
                                progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for sign in (1.0, -1.0, 1.0):
            x, k = paddle.randn([4, HIDDEN]), sign * (paddle.randn([4, HIDDEN]).abs() + 0.1)
            assert bool((m(x, k) == twin(x, k)).all()), sign
    assert graph_opt.stats(m).replays == 2
    assert warned(logs, "got another `holder` than at capture: a _Signed whose non-tensor contents")


class _BranchesOnASize(Scaled):
    def forward(self, x):
        h = self.lin(x)
        if x.numel() == 0:  # a tensor in SOT's program, made from x's shape alone
            return h
        return h * 2.0


def test_a_branch_on_a_tensor_made_from_shapes_alone_lets_padded_calls_replay(logs):
    m, twin = _level1(_BranchesOnASize)
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: paddle.randn([n, HIDDEN]), progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for real in (3, 5, 8):
            x = paddle.randn([real, HIDDEN])
            assert bool((m(x) == eager_padded(PaddleF(), twin, x)).all()), real
    assert graph_opt.stats(m).replays == 3 and not warned(logs, "reads a tensor's value on the host")


def test_objects_compared_by_content_must_be_shared_as_at_capture_and_hold_the_same_values():
    """Two arguments that were one object at capture must be one object again; a value inside differs."""
    from graph_opt.backends.paddle.sot_guards import FrameArguments
    from graph_opt.errors import ReplayDivergence

    def frame_of(a, b):
        import sys
        return sys._getframe()

    one = _Holder(paddle.ones([2]), 2.0)
    captured = FrameArguments(frame_of(one, one), None)
    assert captured.guard_for(frame_of(one, one)) is None  # the very object
    again = _Holder(paddle.zeros([2]), 2.0)  # other tensors, the same values
    assert captured.guard_for(frame_of(again, again)) is None
    for a, b in ((again, _Holder(paddle.zeros([2]), 2.0)), (_Holder(paddle.ones([2]), 3.0),) * 2):
        with pytest.raises(ReplayDivergence, match="`a` than at capture: a _Holder|`b` than at capture: a _Holder"):
            captured.guard_for(frame_of(a, b))
