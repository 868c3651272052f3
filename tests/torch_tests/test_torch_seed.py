"""Seed 001 on torch: a custom all-reduce that branches on is_capturing() must be replayed on its
capture branch, which needs tracing and warmup inside the capture phase."""

import pytest
import torch

import graph_opt
from graph_opt.replay.signature import Signature
from graph_opt.backends.torch.adapter import ADAPTER
from graph_opt.backends.torch.dynamo import DynamoStrategy, graphs_compiled
from torch_zoo.small import COMM, HIDDEN, SIZES, Reduced, make_x


@pytest.fixture
def comm():
    graph_opt.register_custom_allreduce(COMM)
    COMM.captures_entered = 0
    yield COMM
    graph_opt.unregister_custom_allreduce(COMM)


def _cfg(level, full=True):
    return graph_opt.GraphOptConfig(graph_opt_level=level, full_cuda_graph=full, cudagraph_capture_sizes=SIZES)


@pytest.mark.parametrize("level,full", [(0, True), (0, False), (1, True), (1, False)])
def test_replay_runs_the_capture_branch_of_the_custom_allreduce(comm, level, full):
    m = Reduced(graph_opt_config=_cfg(level, full))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    assert comm.captures_entered == len(SIZES)  # one capture phase per size, warmups and capture inside
    compiled = graphs_compiled()
    with torch.no_grad():
        for real in (1, 3, 8):
            x = make_x(real, seed=7)
            torch.testing.assert_close(m(x), m.proj(x) * 2, rtol=1e-5, atol=1e-5)  # * 3 if the wrong branch ran
    assert graph_opt.stats(m).replays == 3
    assert graphs_compiled() == compiled  # Dynamo's guard on is_capturing() was never evaluated


def _strategy_call(m, inside_capture_phase):
    """Warm up and capture size 4 through the Dynamo strategy, inside the capture phase or not."""
    strategy = DynamoStrategy(m, Reduced.forward, m._graph_opt_state.config, ADAPTER, None)
    args = (make_x(4),)
    sig = Signature(1, None, [0], (args, {}))
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        if inside_capture_phase:
            with graph_opt.sot_warmup_guard(True), graph_opt.capture_custom_allreduce():
                strategy.warmup(args, {}, 4, sig)
                captured = strategy.capture(args, {}, 4, sig, None)
        else:
            strategy.warmup(args, {}, 4, sig)
            captured = strategy.capture(args, {}, 4, sig, None)
        return captured.replay(), m.proj(args[0])


def test_tracing_outside_the_capture_phase_would_have_baked_the_other_branch(comm):
    m = Reduced(graph_opt_config=_cfg(1))
    out, proj = _strategy_call(m, inside_capture_phase=False)
    assert torch.equal(out, proj * 3)  # what seed 001 shipped: the non-capture kernel inside the graph
    out, proj = _strategy_call(m, inside_capture_phase=True)
    assert torch.equal(out, proj * 2)


def test_calls_above_the_max_run_the_non_capture_branch(comm):
    m = Reduced(graph_opt_config=_cfg(1))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    with torch.no_grad():
        x = make_x(9)
        torch.testing.assert_close(m(x), m.proj(x) * 3, rtol=1e-5, atol=1e-5)  # no graph: the ordinary all-reduce
    assert graph_opt.stats(m).fallbacks == 1


@graph_opt.support_graph_optimization
class _NoFlags(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return torch.relu(self.proj(x))


def test_a_replays_check_sets_the_capture_flags_only_where_a_guard_reads_them(comm, monkeypatch):
    """Setting the flags around Dynamo's guards costs ~0.4 µs a call: only a forward that branched on
    is_capturing() (its guard holds with the flags on alone) has them set at every check."""
    from graph_opt.backends.torch import guard_check

    calls = []
    real = guard_check.as_captured
    monkeypatch.setattr(guard_check, "as_captured", lambda *a: calls.append(1) or real(*a))
    plain, branching = _NoFlags(graph_opt_config=_cfg(1)), Reduced(graph_opt_config=_cfg(1))
    with graph_opt.testing.simulate_cuda_graphs():
        for m in (plain, branching):
            graph_opt.capture_model(m, make_x, progress=False)
    with torch.no_grad():
        x = make_x(3, seed=7)
        before = len(calls)
        for _ in range(3):
            torch.testing.assert_close(plain(x), torch.relu(plain.proj(x)), rtol=1e-5, atol=1e-5)
        assert len(calls) == before
        for _ in range(3):
            torch.testing.assert_close(branching(x), branching.proj(x) * 2, rtol=1e-5, atol=1e-5)
        assert len(calls) == before + 3
    assert graph_opt.stats(plain).replays == graph_opt.stats(branching).replays == 3
