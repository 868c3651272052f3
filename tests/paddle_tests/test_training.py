"""graph_opt.autocudagraph, Paddle's own cases, with simulated graphs (the specification both frameworks
meet is tests/both/test_training_spec.py). Paddle's CUDA path is written but not run (no Paddle GPU build
runs here)."""
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from paddle_zoo.training import PaddleShim  # noqa: E402
from training_support import assert_same_step, twins  # noqa: E402


@pytest.fixture
def T():
    with graph_opt.testing.simulate_cuda_graphs():
        yield PaddleShim()


def test_paddle_grad_accumulation_after_clear_grad_without_zeroing(T):
    """clear_gradients(set_to_zero=False) leaves Paddle's grads 'empty', and its accumulation then
    shares the next gradient it gets: those gradients must be copies, not the static buffers."""
    ref, m = twins(T, warmup_steps=0)
    x = T.randn([4, 6, T.hidden], seed=1)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
        kept = [p.grad.clone() for p in m.parameters()]
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=9), seed=step)  # accumulates
        assert not all(T.equal(k, p.grad) for k, p in zip(kept, m.parameters()))


def test_traced_levels_are_torch_s_and_say_so(T):
    """level=1 or 2 traces with Dynamo and AOTAutograd: a Paddle block is refused at once, naming the level."""
    with pytest.raises(graph_opt.GraphOptInputError, match=r"level=1.*use level=0"):
        graph_opt.autocudagraph(T.block(), level=1)
    f = graph_opt.autocudagraph(lambda x: paddle.tanh(x) * 2, level=2)
    with pytest.raises(graph_opt.GraphOptInputError, match=r"level=2.*use level=0"):
        f(T.randn([2, 4], seed=0))


class _DefaultDtype(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + paddle.full([x.shape[0], 8], 0.1)  # follows the default dtype


def test_the_default_dtype_is_in_the_key(T):
    """paddle.set_default_dtype between steps: the float32 graphs are not replayed for a float64 step."""
    paddle.seed(0)
    ref = _DefaultDtype()
    block = _DefaultDtype()
    block.set_state_dict(ref.state_dict())
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    try:
        for step in range(6):
            if step == 3:
                paddle.set_default_dtype("float64")
            x = T.randn([4, 8], seed=step)
            outs = []
            for model in (ref, m):
                y = model(x)
                y.sum().backward()
                outs.append((y, model.lin.weight.grad.clone()))
                model.clear_gradients()
            assert outs[0][0].dtype == outs[1][0].dtype, f"step {step}"
            assert T.equal(outs[0][0], outs[1][0]) and T.equal(outs[0][1], outs[1][1]), f"step {step}"
    finally:
        paddle.set_default_dtype("float32")
    s = graph_opt.stats(m)
    assert s.captures == 2 and s.fallbacks == 0, s


class _Recurrent(paddle.nn.Layer):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(paddle.nn, kind)(8, 8)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "SimpleRNN"])
def test_a_recurrent_layer_with_a_buffer_without_memory_is_graphed(T, kind):
    """Paddle's RNN layers hold a buffer without memory (`_dropout_state`): data_ptr() of it raises."""
    paddle.seed(0)
    ref = _Recurrent(kind)
    block = _Recurrent(kind)
    block.set_state_dict(ref.state_dict())
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    for step in range(4):
        x = T.randn([3, 5, 8], seed=step)
        outs = []
        for model in (ref, m):
            y = model(x)
            y.sum().backward()
            outs.append([y] + [p.grad.clone() for p in model.parameters()])
            model.clear_gradients()
        assert all(T.equal(a, b) for a, b in zip(*outs)), f"step {step}"
    assert graph_opt.stats(m).replays == 3


def test_sparse_gradients_run_eagerly_and_say_so(T):
    """A graph replays dense buffers: a sparse (SelectedRows) gradient would have crashed the replay."""
    paddle.seed(0)
    emb = paddle.nn.Embedding(10, 4, sparse=True)
    m = graph_opt.autocudagraph(emb, warmup_steps=0)
    ids = paddle.to_tensor([[1, 2], [3, 1]])
    for _ in range(3):
        m(ids).sum().backward()
    assert emb.weight.grad.is_selected_rows()
    s = graph_opt.stats(m)
    assert "sparse gradient" in s.disabled_reason and s.replays == 0


def test_a_backward_that_raised_does_not_keep_later_calls_eager(T):
    """paddle.grad through a replayed step raises (docs/training.md); Paddle keeps that step's autograd
    context alive, so the block must not wait for its backward: later steps replay."""
    paddle.seed(0)
    ref = _DefaultDtype()
    block = _DefaultDtype()
    block.set_state_dict(ref.state_dict())
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    for step in range(5):
        x = T.randn([3, 8], seed=step)
        if step == 1:
            with pytest.raises(Exception, match="paddle.grad"):
                paddle.grad(m(x).sum(), [block.lin.weight])
            continue
        outs = []
        for model in (ref, m):
            model(x).sum().backward()
            outs.append(model.lin.weight.grad.clone())
            model.clear_gradients()
        assert T.equal(outs[0], outs[1]), f"step {step}"
    s = graph_opt.stats(m)
    assert "backward_pending" not in s.fallback_reasons and s.backward_replays == 3, s


def test_a_data_parallel_wrapper_graphs_its_layers_and_stays_eager_around_them(T, caplog):
    """autocudagraph(paddle.DataParallel(layer)) graphs `_layers` and returns the wrapper, whose forward
    (the reducer's preparation) runs around the replay; training is eager DataParallel's."""
    import logging
    import warnings

    caplog.set_level(logging.INFO, logger="graph_opt")
    ref = T.block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The program will return to single-card operation"
        dp_ref, dp = paddle.DataParallel(ref), paddle.DataParallel(T.copy_block(ref))
    assert graph_opt.autocudagraph(dp, warmup_steps=0) is dp
    assert any("graphed its wrapped Block (._layers)" in r.getMessage() for r in caplog.records)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(dp._layers)
        assert_same_step(T, dp_ref, dp, T.randn([4, 6, T.hidden], seed=step), seed=step)
    s = graph_opt.stats(dp)
    assert s.replays == 3 and s.backward_replays == 3 and s.fallbacks == 0, s
