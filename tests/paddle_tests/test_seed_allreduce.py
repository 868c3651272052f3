"""Seed 001: a communicator whose all-reduce branches on is_capturing().

With the plugin, SOT's first translation happens inside the capture phase, so the program that is
captured and replayed holds the capture-path ops. Warming up (translating) before capture, as the
seed did, bakes the other path.
"""
import contextlib

import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from paddle_zoo.small import SIZES, config, inputs, same  # noqa: E402


class FakeCommunicator:
    """The vLLM/FastDeploy custom all-reduce protocol: capture() brackets graph capture."""

    def __init__(self):
        self.captures = 0

    @contextlib.contextmanager
    def capture(self):
        self.captures += 1
        yield

    def all_reduce(self, x):
        if graph_opt.is_capturing():
            return paddle.tanh(x)  # the graph path (registered buffers); an op only this path has
        return paddle.nn.functional.relu(x)  # the eager path


COMM = FakeCommunicator()


class TPLayer(paddle.nn.Layer):
    def __init__(self, hidden=16):
        super().__init__()
        self.lin = paddle.nn.Linear(hidden, hidden)

    def forward(self, x):
        return COMM.all_reduce(self.lin(x)) + 1.0


SeedModel = graph_opt.support_graph_optimization(type("SeedModel", (TPLayer,), {}))


def capture_path(layer, x):
    return paddle.tanh(layer.lin(x)) + 1.0


def eager_path(layer, x):
    return paddle.nn.functional.relu(layer.lin(x)) + 1.0


def program_ops(model):
    strategy = model._graph_opt_state.runner.strategy
    return {name for ops in strategy.program_ops.values() for name in ops}


@pytest.fixture
def registered():
    graph_opt.register_custom_allreduce(COMM)
    yield COMM
    graph_opt.unregister_custom_allreduce(COMM)


def _model(level):
    paddle.seed(0)
    model = SeedModel(graph_opt_config=config(graph_opt_level=level))
    model.eval()
    return model


def test_level1_captured_program_holds_the_capture_path(registered):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model = _model(1)
        before = registered.captures
        report = graph_opt.capture_model(model, lambda bs: {"x": inputs(bs)}, progress=False)
        assert report.failed is None
        assert registered.captures - before == len(SIZES)  # one capture phase (warmups + capture) per size
        ops = program_ops(model)
        assert "pd_op.tanh" in ops and "pd_op.relu" not in ops
        for bs in (1, 3, 8):
            x = inputs(bs, seed=bs)
            out = model(x)
            assert not graph_opt.is_capturing()
            assert float((out - capture_path(model, x)).abs().max()) <= 1e-6
            assert float((out - eager_path(model, x)).abs().max()) > 1e-3


def test_level0_replay_runs_the_capture_path(registered):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model = _model(0)
        graph_opt.capture_model(model, lambda bs: {"x": inputs(bs)}, progress=False)
        x = inputs(4, seed=4)
        assert same(model(x), capture_path(model, x))
        assert not same(model(x), eager_path(model, x))


def test_warming_up_before_capture_would_have_baked_the_other_path(registered):
    """The seed's order: translate first (outside capture), capture later. SOT bakes what it saw."""
    from paddle.jit.dy2static.pir_partial_program import replace_run_impl_guard
    from paddle.jit.sot.utils.envs import min_graph_size_guard

    with paddle.no_grad():
        model = _model(1)
        programs = []

        def collect(run_impl, ins, params, attrs):
            programs.append(run_impl.__self__.program.forward_program)
            return run_impl(ins, params, attrs)

        warmed = paddle.jit.to_static(TPLayer.forward.__get__(model), full_graph=False)
        with replace_run_impl_guard(collect), min_graph_size_guard(0):
            warmed(inputs(4))  # the seed's warmup, outside the capture phase
        assert programs
        ops = {op.name() for prog in programs for op in prog.global_block().ops}
        # This is the program a guard-skipping replay (FastDeploy calls SOT's generated code directly)
        # would capture and replay: the eager path, inside the graph.
        assert "pd_op.relu" in ops and "pd_op.tanh" not in ops
