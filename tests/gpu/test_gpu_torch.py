"""The core runtime and the torch frontend on real CUDA graphs. Skipped without a CUDA device.

    python -m pytest tests/gpu -q

Model: the benchmark's decoder, small (hidden 128, 3 layers), fp32, on the GPU.
"""
import contextlib
import gc
import logging

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import graph_opt  # noqa: E402
from graph_opt.backends.torch.adapter import ADAPTER  # noqa: E402
from graph_opt.benchmarks.torch_gpu import build, level_config, make_kv  # noqa: E402
from graph_opt.backends.torch.dynamo import graphs_compiled  # noqa: E402
from graph_opt.decorator import state_of  # noqa: E402

SIZES = [1, 2, 4, 8, 16]
REALS = [1, 3, 4, 11, 16]
DIMS = dict(hidden=128, heads=4, mlp=256)
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32; a padded batch may pick another GEMM kernel than the unpadded one
L1_SPLIT = ["graph_opt_bench::attention"]


@pytest.fixture(scope="module")
def kv():
    return make_kv(layers=3, max_batch=32, heads=4, cache_len=16, hidden=128, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _x(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + n)
    return torch.randn(n, DIMS["hidden"], device="cuda", generator=g)


def _eager(m, *args):
    with torch.no_grad():
        return type(m).forward(m, *args)


def _same_kernels(m, args):
    """The replayed kernels run without graphs on the same inputs: eager at levels 0-1, the Inductor pieces at 2."""
    state = state_of(m)
    if state.config.graph_opt_level < 2:
        return _eager(m, *args)
    (sig,) = state.runner.signatures.values()
    with graph_opt.sot_warmup_guard(True), graph_opt.capture_custom_allreduce(), torch.no_grad():
        return state.runner.strategy.warmup(args, {}, args[0].shape[0], sig)


MODES = [  # level, full, splitting ops, graphs per size
    pytest.param(0, True, None, 1, id="L0-full"),
    pytest.param(0, False, None, 4, id="L0-piecewise"),
    pytest.param(1, True, None, 1, id="L1-full"),
    pytest.param(1, False, L1_SPLIT, 4, id="L1-piecewise"),
    pytest.param(2, True, None, 1, id="L2-full"),
    pytest.param(2, False, L1_SPLIT, 4, id="L2-piecewise"),
]


@pytest.mark.parametrize("level,full,split_ops,graphs", MODES)
def test_every_mode_matches_eager_and_replays_bitwise(kv, level, full, split_ops, graphs):
    m = build(level_config(level, full, SIZES, split_ops), kv, torch.float32, **DIMS)
    report = graph_opt.capture_model(m, _x, progress=False)
    assert report.failed is None and report.captured_sizes == SIZES
    assert graph_opt.stats(m).graphs == {s: graphs for s in SIZES}
    assert "simulated" not in graph_opt.stats(m).mode
    compiled = graphs_compiled()
    tol = TOL if level < 2 else dict(rtol=1e-3, atol=1e-3)  # Inductor fuses, so it rounds differently
    runner = state_of(m).runner
    (sig,) = runner.signatures.values()
    with torch.no_grad():
        for real in REALS:
            x = _x(real, seed=10)
            y = m(x)
            torch.testing.assert_close(y, _eager(m, x), **tol)
        for padded, entry in sorted(sig.entries.items()):
            m(_x(padded, seed=20))
            expected = _same_kernels(m, [t.clone() for t in entry.inputs])
            assert torch.equal(entry.captured.outputs, expected), f"size {padded}: replay is not bitwise equal"
        assert graphs_compiled() == compiled, "a call at or below the max size recompiled"
        y = m(_x(SIZES[-1] + 1))  # above the max: no graph
        torch.testing.assert_close(y, _eager(m, _x(SIZES[-1] + 1)), **tol)
    s = graph_opt.stats(m)
    assert s.fallbacks == 1 and s.replays == len(REALS) + len(SIZES)
    assert s.graph_memory_bytes is not None and s.graph_memory_bytes >= 0


@pytest.mark.parametrize("level", [0, 1])
def test_without_graphs(kv, level):
    cfg = graph_opt.GraphOptConfig(graph_opt_level=level, use_cudagraph=False, cudagraph_capture_sizes=SIZES)
    m = build(cfg, kv, torch.float32, **DIMS)
    graph_opt.capture_model(m, _x, progress=False)
    with torch.no_grad():
        for real in (1, 5, 20):
            torch.testing.assert_close(m(_x(real)), _eager(m, _x(real)), **TOL)
    assert graph_opt.stats(m).captures == 0


# -- failure mid-capture -------------------------------------------------------------------------
FAIL = {"armed": False, "captures": 0}


@torch.library.custom_op("graph_opt_gpu_test::checkpoint", mutates_args=())
def checkpoint(x: torch.Tensor) -> torch.Tensor:
    """Raises inside the third stream capture while armed: an error half-way through recording a graph."""
    if FAIL["armed"] and torch.cuda.is_current_stream_capturing():
        FAIL["captures"] += 1
        if FAIL["captures"] == 3:
            raise RuntimeError("injected failure mid-capture")
    return x.clone()


@checkpoint.register_fake
def _(x):
    return torch.empty_like(x)


@graph_opt.support_graph_optimization
class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.ops.graph_opt_gpu_test.checkpoint(torch.relu(self.a(x))))


@pytest.mark.parametrize("level", [0, 1])
def test_an_exception_mid_capture_leaves_a_working_model(level, caplog):
    torch.manual_seed(0)
    m = Checkpointed(graph_opt_config=level_config(level, True, SIZES)).cuda()
    make = lambda n: torch.randn(n, 64, device="cuda")  # noqa: E731
    FAIL.update(armed=True, captures=0)
    try:
        with caplog.at_level(logging.WARNING, logger="graph_opt"):
            report = graph_opt.capture_model(m, make, progress=False)
    finally:
        FAIL["armed"] = False
    assert not torch.cuda.is_current_stream_capturing()
    assert len([r for r in caplog.records if "injected failure" in r.getMessage()]) == 1
    s = graph_opt.stats(m)
    assert "injected failure mid-capture" in s.disabled_reason and report.failed == s.disabled_reason
    with torch.no_grad():
        for real in (1, 7, 16):
            x = make(real)
            torch.testing.assert_close(m(x), m.b(torch.relu(m.a(x))), **TOL)
    # the device is healthy: another model captures and replays
    other = Checkpointed(graph_opt_config=level_config(level, True, SIZES)).cuda()
    assert graph_opt.capture_model(other, make, progress=False).failed is None
    with torch.no_grad():
        x = make(5)
        torch.testing.assert_close(other(x), other.b(torch.relu(other.a(x))), **TOL)
    assert graph_opt.stats(other).replays == 1


# -- memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("level,full,split_ops", [(0, True, None), (1, False, L1_SPLIT)])
def test_twenty_clear_and_recapture_cycles_keep_memory_flat(kv, level, full, split_ops):
    m = build(level_config(level, full, SIZES, split_ops), kv, torch.float32, **DIMS)
    reserved = []
    x = _x(3)
    with torch.no_grad():
        expected = _eager(m, x)
        for _ in range(20):
            graph_opt.clear_graphs(m)
            assert graph_opt.capture_model(m, _x, progress=False).failed is None
            torch.testing.assert_close(m(x), expected, **TOL)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    growth = reserved[-1] - reserved[1]
    assert growth <= 2 * 2**20, f"memory_reserved grew by {growth / 2**20:.1f} MiB over 19 cycles: {reserved}"


def _pool_bytes(m) -> int:
    pool = tuple(state_of(m).runner.pool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


@pytest.mark.parametrize("level,full,split_ops", [(0, True, None), (0, False, None), (1, True, None),
                                                  (1, False, L1_SPLIT)])
def test_the_graph_pool_of_35_sizes_stays_within_1_2x_the_largest_alone(level, full, split_ops):
    """The benchmark's decoder (hidden 1024, 24 layers, bf16). Piecewise, the tensors a splitting op
    reads from earlier pieces and the pieces' outputs are held weakly from their capture on; held
    until the size's capture ended, every layer's were live at once (62 MiB for size 256 alone, 88 MiB
    for all sizes, where a full graph needs 24)."""
    big = make_kv(layers=24, max_batch=256)
    pools = {}
    for sizes in ([256], None):
        m = build(level_config(level, full, sizes, split_ops), big)
        assert graph_opt.capture_model(m, lambda bs: torch.randn(bs, 1024, device="cuda", dtype=torch.bfloat16),
                                       progress=False).failed is None
        pools["largest" if sizes else "all"] = _pool_bytes(m)
        del m
        gc.collect()
    ratio = pools["all"] / pools["largest"]
    assert ratio <= 1.2, f"graph pool {pools['all'] / 2**20:.0f} MiB for 35 sizes, {pools['largest'] / 2**20:.0f} MiB for the largest"
    assert pools["all"] <= 32 * 2**20  # the full graph's own need is 24-26 MiB


def test_one_capture_stream_and_no_collection_per_graph(kv, monkeypatch):
    collects = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(1) or real_collect(*a))
    m = build(level_config(0, False, SIZES), kv, torch.float32, **DIMS)
    graph_opt.capture_model(m, _x, progress=False)
    stream = ADAPTER._stream
    assert stream is not None
    n = build(level_config(1, False, SIZES, L1_SPLIT), kv, torch.float32, **DIMS)
    graph_opt.capture_model(n, _x, progress=False)
    assert ADAPTER._stream is stream  # warmups and captures of every size of every model share it
    # one collection per capture_model (paused_gc), none per size or per graph (4 graphs x 5 sizes each)
    assert len(collects) == 2


# -- host metadata ---------------------------------------------------------------------------------
@torch.library.custom_op("graph_opt_gpu_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Reads a host tensor of sequence lengths: a graph would bake the lengths it saw at capture."""
    scale = torch.tensor([float(n) for n in lens.tolist()], dtype=x.dtype, device=x.device)
    return x * scale.unsqueeze(1)


@row_scale.register_fake
def _(x, lens):
    return torch.empty_like(x)


@graph_opt.splitting_op(name="gpu_row_scale")
def scale_rows(x, lens):
    return torch.ops.graph_opt_gpu_test.row_scale(x, lens)


@graph_opt.support_graph_optimization(dynamic_arg_dims={"x": 0, "lens": 0})
class HostMeta(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 64)

    def forward(self, x, lens):
        return self.out(scale_rows(torch.relu(self.inp(x)), lens))


@pytest.mark.parametrize("level,full,split_ops", [
    pytest.param(0, False, None, id="L0-piecewise"),
    pytest.param(1, False, ["graph_opt_gpu_test::row_scale"], id="L1-piecewise"),
    pytest.param(1, True, None, id="L1-full-host-op-kept-out"),
])
def test_a_split_op_reading_host_lengths_is_right_at_every_size(level, full, split_ops):
    torch.manual_seed(0)
    m = HostMeta(graph_opt_config=level_config(level, full, SIZES, split_ops)).cuda()
    make = lambda n: (torch.randn(n, 64, device="cuda"), torch.arange(1, n + 1))  # noqa: E731
    report = graph_opt.capture_model(m, make, progress=False)
    assert report.failed is None and report.notes == []
    assert graph_opt.stats(m).graphs == {s: 2 for s in SIZES}
    with torch.no_grad():
        for real in range(1, SIZES[-1] + 1):
            x, lens = torch.randn(real, 64, device="cuda"), torch.randint(1, 50, (real,))
            torch.testing.assert_close(m(x, lens), _eager(m, x, lens), **TOL)
    assert graph_opt.stats(m).replays == SIZES[-1]


# -- seed 001: the custom all-reduce --------------------------------------------------------------
class FakeComm:
    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def capture(self):
        self.entered += 1
        yield

    def all_reduce(self, x):
        return x * 2 if graph_opt.is_capturing() else x * 3


COMM = FakeComm()


@graph_opt.support_graph_optimization
class Reduced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        return COMM.all_reduce(self.proj(x))


@pytest.mark.parametrize("level,full", [(0, True), (0, False), (1, True), (1, False), (2, True)])
def test_the_replayed_graph_runs_the_capture_branch_of_the_custom_allreduce(level, full):
    graph_opt.register_custom_allreduce(COMM)
    try:
        torch.manual_seed(0)
        m = Reduced(graph_opt_config=level_config(level, full, SIZES)).cuda()
        COMM.entered = 0
        graph_opt.capture_model(m, lambda n: torch.randn(n, 64, device="cuda"), progress=False)
        assert COMM.entered == len(SIZES)
        with torch.no_grad():
            for real in (1, 6, 16):
                x = torch.randn(real, 64, device="cuda")
                torch.testing.assert_close(m(x), m.proj(x) * 2, **TOL)
    finally:
        graph_opt.unregister_custom_allreduce(COMM)
    assert graph_opt.stats(m).replays == 3


def test_a_graph_captured_outside_the_capture_phase_bakes_the_other_branch():
    torch.manual_seed(0)
    m = Reduced(graph_opt_config=graph_opt.GraphOptConfig(use_cudagraph=False)).cuda()
    x = torch.randn(4, 64, device="cuda")
    graphs = {}
    with torch.no_grad():
        for inside in (False, True):
            type(m).forward(m, x)  # warmup
            g = torch.cuda.CUDAGraph()
            phase = graph_opt.capture_custom_allreduce() if inside else contextlib.nullcontext()
            with phase, torch.cuda.graph(g):
                out = type(m).forward(m, x)
            g.replay()
            graphs[inside] = out.clone()
    torch.testing.assert_close(graphs[False], m.proj(x) * 3, **TOL)  # seed 001: the non-capture kernel
    torch.testing.assert_close(graphs[True], m.proj(x) * 2, **TOL)
