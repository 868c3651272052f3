"""Level 1, piecewise: what a splitting op returns reaches the next graph as it is now. A result that is its
argument or a view of it keeps the alias; a new tensor at one call and an alias at another is never
replayed stale; results read or written by a graph are one memory with what the eager piece made (the
direct replay of tests/torch_tests/test_torch_direct_replay.py, past the splitting ops)."""
import pytest
import torch

import graph_opt
from torch_zoo.small import HIDDEN, SIZES, make_x

_CI_SECONDS = 3  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)


def _split_twins(cls, *args, ops):
    """(the decorated cls at level 1 piecewise, cut at the splitting ops `ops`; its undecorated twin)."""
    torch.manual_seed(0)
    twin = cls(*args)
    cfg = graph_opt.GraphOptConfig(graph_opt_level=1, full_cuda_graph=False, cudagraph_capture_sizes=SIZES,
                                   cudagraph_splitting_ops=ops)
    m = graph_opt.support_graph_optimization(type("Graphed", (cls,), {}))(*args, graph_opt_config=cfg)
    m.load_state_dict(twin.state_dict())
    return m, twin


def _calls_equal_eager(m, twin, switches, at_capture=True, rows=None):
    """capture_model with the ops' switch (_RETURNS_ITS_ARGUMENT) at `at_capture`, then one call per
    switch value (of rows[step] rows, default 4), each equal to the twin's."""
    _RETURNS_ITS_ARGUMENT[0] = at_capture
    try:
        with graph_opt.testing.simulate_cuda_graphs():
            assert graph_opt.capture_model(m, make_x, progress=False).failed is None
            for step, switch in enumerate(switches):
                _RETURNS_ITS_ARGUMENT[0] = switch
                x = make_x(rows[step] if rows else 4, seed=step)
                with torch.no_grad():
                    out, want = m(x), twin(x)
                pairs = zip(out, want) if isinstance(out, tuple) else [(out, want)]
                assert all(torch.equal(a, b) for a, b in pairs), (step, switch)
    finally:
        _RETURNS_ITS_ARGUMENT[0] = True


class _OneWeight(torch.nn.Module):
    """x * w, then what a test's forward does with its case."""

    def __init__(self, case=None, graph_opt_config=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(HIDDEN))
        self.case = case


@graph_opt.splitting_op(name="test_passes_through")
def _passes_through(c):
    return c


@graph_opt.splitting_op(name="test_views")
def _views(c):
    return c.view(-1, c.shape[-1])


_RETURNS_ITS_ARGUMENT = [True]


@graph_opt.splitting_op(name="test_sometimes_passes_through")
def _sometimes_passes_through(c):
    return c if _RETURNS_ITS_ARGUMENT[0] else c * 2


@graph_opt.splitting_op(name="test_writes_out")
def _writes_out(h, out):
    out.copy_(torch.tanh(h))
    return out


class _WritesThroughAnAlias(_OneWeight):
    def forward(self, x):
        c = x * self.w
        if self.case == "out=":  # docs/splitting.md's buffer pattern
            out = torch.empty_like(c)
            d = _writes_out(c, out)
            d.add_(1.0)
            return out * 2
        if self.case == "sometimes":
            d = _sometimes_passes_through(c)
            d.add_(1.0)
            return x * c + d
        d = _passes_through(c) if self.case == "identity" else _views(c)
        d.add_(1.0)  # eager: c changes too
        return x * c


@pytest.mark.parametrize("op", ["identity", "view", "out="])
def test_a_splitting_op_returning_its_argument_or_a_view_of_it_keeps_the_alias_in_the_next_graph(op):
    """The next graph writes through the op's result and reads the argument: both must be one memory in
    the graph, as in eager (a landing copy of the result would leave the argument unwritten)."""
    m, twin = _split_twins(_WritesThroughAnAlias, op, ops=["test_passes_through", "test_views", "test_writes_out"])
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
        for real in (4, 2, 4):
            x = make_x(real, seed=real)
            with torch.no_grad():
                assert torch.equal(m(x), twin(x)), real
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallbacks == 0, s.fallback_reasons


def test_a_splitting_op_returning_its_argument_at_capture_and_a_new_tensor_later_is_not_replayed_stale():
    """Captured while the op returned its argument (no copy where the next graph reads), called when it
    returns a new tensor: the replay must not read the argument in its place. Each call equals eager."""
    m, twin = _split_twins(_WritesThroughAnAlias, "sometimes", ops=["test_sometimes_passes_through"])
    _calls_equal_eager(m, twin, (True, False, True, False))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"divergence": 2}, s.fallback_reasons


class _FreshThenAlias(_OneWeight):
    def forward(self, x):
        c = x * self.w
        y = _sometimes_passes_through(c)  # new memory while _RETURNS_ITS_ARGUMENT[0] is False
        z = _passes_through(y) if self.case else y
        z.add_(1.0)
        return z * 2, c * 3 + y


@pytest.mark.parametrize("chain", [False, True], ids=["new-then-its-argument", "new-then-passed-on"])
def test_a_splitting_op_result_that_reaches_a_graph_through_an_alias_is_one_memory(chain):
    """new-then-its-argument: captured while the op made a new tensor (copied where the next graph
    reads), called when it returns its argument: that call must not read a stale argument. passed-on: a
    new tensor passed on by a second op that returns its argument reaches the next graph twice; both
    are one memory there. Every call equals eager."""
    m, twin = _split_twins(_FreshThenAlias, chain, ops=["test_sometimes_passes_through", "test_passes_through"])
    _calls_equal_eager(m, twin, (False, True, False) if not chain else (False, False), at_capture=False)
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == ({} if chain else {"divergence": 1}), s.fallback_reasons


@graph_opt.splitting_op(name="test_new_and_view")
def _new_and_view(c):
    t = c * 2
    return t, t[1:]


class _WritesAView(_OneWeight):
    def forward(self, x):
        t, view = _new_and_view(x * self.w)
        view.add_(1.0)
        return t * 3


def test_a_splitting_op_returning_a_new_tensor_and_a_view_of_it_is_not_captured(graph_opt_warnings):
    """Both would be copied to separate places where the next graph reads, and the write through the
    view would miss the tensor: the capture fails with one warning, and the calls are eager's."""
    m, twin = _split_twins(_WritesAView, ops=["test_new_and_view"])
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, make_x, progress=False)
        assert report.failed is not None and "Take the view in the graph" in report.failed
        for real in (4, 3):
            x = make_x(real, seed=real)
            with torch.no_grad():
                assert torch.equal(m(x), twin(x)), real
    assert graph_opt.stats(m).replays == 0


@graph_opt.splitting_op(name="test_chunks")
def _chunks(c):
    buf = torch.cat([c * 2, c + 1], dim=1)
    return buf[:, :HIDDEN], buf[:, HIDDEN:]  # two column chunks of one new tensor: interleaved, no shared element


@graph_opt.splitting_op(name="test_once_or_twice")
def _once_or_twice(c):
    t = c * 2
    return (t, t) if _RETURNS_ITS_ARGUMENT[0] else (t, c - 1)


class _ReadsTwoResults(_OneWeight):
    def forward(self, x):
        a, b = (_chunks if self.case == "chunks" else _once_or_twice)(x * self.w)
        return a * b + a


@pytest.mark.parametrize("op", ["chunks", "once-then-two"])
def test_two_results_of_a_splitting_op_read_by_a_graph_replay_as_they_are_now(op):
    """chunks: two views over one new tensor, read only: they replay. once-then-two: one tensor
    returned twice at capture (one landing copy), two different ones later: those calls must not read
    one copy for both. Every call equals eager."""
    m, twin = _split_twins(_ReadsTwoResults, op, ops=["test_chunks", "test_once_or_twice"])
    _calls_equal_eager(m, twin, (True, False, True))
    s = graph_opt.stats(m)
    want = {} if op == "chunks" else {"divergence": 1}
    assert s.replays == 3 - len(want) and s.fallback_reasons == want, s.fallback_reasons


@graph_opt.splitting_op(name="test_doubled")
def _doubled(c):
    return c * 2


class _WritesAnEagerResult(_OneWeight):
    def forward(self, x):
        c = x * self.w
        if self.case == "apart-then-one":
            a, b = _once_or_twice(c)  # two tensors at capture, one tensor twice later
            a.add_(1.0)
            return a * 3 + b
        t = _doubled(c)
        t.add_(1.0)  # the graph after the op writes it ...
        u = _doubled(c * 3)
        return t * u + t  # ... and the graph after the next op reads it


@pytest.mark.parametrize("case", ["apart-then-one", "written-then-read-later"])
def test_a_graph_writing_a_splitting_ops_new_tensor_is_replayed_right(case):
    """apart-then-one: the graph writes one result, which later is also the other: those calls run
    without graphs. written-then-read-later: a later graph reads what an earlier one wrote into the op's
    new tensor (copied back between them). Every call equals eager."""
    m, twin = _split_twins(_WritesAnEagerResult, case, ops=["test_once_or_twice", "test_doubled"])
    _calls_equal_eager(m, twin, (False, True, False, False), at_capture=False, rows=(4, 4, 4, 2))
    s = graph_opt.stats(m)
    want = {"divergence": 1} if case == "apart-then-one" else {}
    assert s.replays == 4 - len(want) and s.fallback_reasons == want, s.fallback_reasons
