"""Soak and faults on Paddle, with simulated graphs: 10,000 random calls across every mode of the mode
table against an undecorated eager twin, RSS flat; an exception injected at each point of the capture
phase and at a replay; two threads calling one model.
"""
import contextlib
import gc
import logging
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt import split, testing  # noqa: E402
from graph_opt.backends.paddle import sot  # noqa: E402
from graph_opt.benchmarks.paddle_demo import demo_attention  # noqa: E402
from graph_opt.cudagraph import EagerStrategy  # noqa: E402

HIDDEN = 16
SIZES = [1, 2, 4, 8]
# float32: a padded batch, or the static path at another size, may take another matmul blocking than
# the unpadded eager run; the real rows then differ from eager in the last bits, never more than this.
ROW_TOLERANCE = 1e-5
# RSS from call 1,000 to call 10,000 (9,000 calls): a leak of 1 KiB per call would add 8.8 MiB.
# Measured on 2 cores: +1.5 to +3.5 MiB, spread over the run. Part of it is Paddle's own: its SOT
# (paddle.jit.sot.symbolic_translate, what to_static(full_graph=False) runs) keeps one small Python
# memory block per frame it runs translated code for, about 90 bytes of RSS with the C++ side (bare
# SOT, no plugin: +1 block per call of this Net, +3 per call of a function with two graph breaks,
# +1.8 MiB per 20,000 calls). So Python's allocated blocks may grow by one per SOT frame run (SOT_FRAMES
# per call at level >= 1) and by at most BLOCK_GROWTH_BOUND more: a leak of one object per call anywhere
# else adds 9,000. (Before the fix in sot.py, the static path also leaked one eval-frame closure per
# call: about 450 bytes and 4 objects.)
RSS_GROWTH_BOUND = 10 * 2**20
BLOCK_GROWTH_BOUND = 2_000
WARNINGS = logging.WARNING

# -- the model: two batch-major arguments, two splitting ops ---------------------------------------
FAULT = {"split": False, "hold": None}


@graph_opt.splitting_op(name="soak_paddle_gate")
def soak_gate(h):
    """A second splitting op; raises once when armed, while a size is being captured; with
    FAULT["hold"] = (thread id, entered, release), blocks that thread in here."""
    if FAULT["split"] and graph_opt.is_capturing():
        FAULT["split"] = False
        raise RuntimeError("injected failure in a splitting op")
    hold = FAULT["hold"]
    if hold is not None and hold[0] == threading.get_ident():
        hold[1].set()
        assert hold[2].wait(30)
    return paddle.nn.functional.sigmoid(h)


class Net(paddle.nn.Layer):
    """Undecorated: the eager twin. Rows stay independent, so padding rows cannot leak."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(hidden)
        self.qkv = paddle.nn.Linear(hidden, 3 * hidden)
        self.proj = paddle.nn.Linear(hidden, hidden)
        self.gate = paddle.nn.Linear(hidden, hidden)

    def forward(self, x, g):
        a = demo_attention(self.qkv(self.norm(x)), 2)
        return x + self.proj(a) * soak_gate(self.gate(g))


GraphNet = graph_opt.support_graph_optimization(type("GraphNet", (Net,), {}))

# level x use_cudagraph x full_cuda_graph: every row of the mode table (full_cuda_graph is meaningless
# without graphs; both values are run anyway). Level 2 is level 1 on this CPU build (no CINN).
MODES = {
    f"L{level}-{'graphs' if use else 'nographs'}-{'full' if full else 'piecewise'}":
        dict(graph_opt_level=level, use_cudagraph=use, full_cuda_graph=full)
    for level in (0, 1, 2) for use in (False, True) for full in (True, False)
}


def build(seed=0, **cfg):
    paddle.seed(seed)
    twin = Net()
    twin.eval()
    model = GraphNet(graph_opt_config=graph_opt.GraphOptConfig(
        cudagraph_capture_sizes=list(SIZES), program_passes=[], **cfg))
    model.set_state_dict(twin.state_dict())
    model.eval()
    return model, twin


def make_inputs(bs, rows_g=None, rng=None):
    rng = rng or np.random.default_rng(bs)
    x = rng.standard_normal((bs, HIDDEN), dtype=np.float32)
    g = rng.standard_normal((bs if rows_g is None else rows_g, HIDDEN), dtype=np.float32)
    return paddle.to_tensor(x), paddle.to_tensor(g)


def capture(model, **kwargs):
    return graph_opt.capture_model(model, lambda bs: dict(zip("xg", make_inputs(bs))), progress=False, **kwargs)


def diff(out, want) -> float:
    """Largest |out - want|; inf when the shapes differ, 0 for empty outputs of the same shape."""
    if out.shape != want.shape:
        return float("inf")
    return float(np.abs(out - want).max()) if out.size else 0.0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def leftover_capture_state():
    from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

    return {
        "is_capturing": graph_opt.is_capturing(),
        "sot_warmup": graph_opt.in_sot_warmup_mode(),
        "split_hook": split._split_hook is not None,
        "run_impl_hook": PartialProgramLayer.HOOKED_RUN_IMPL is not None,
        "eval_frame": paddle.framework.core.set_eval_frame(None) is not None,
    }


# SOT frames one call runs at level >= 1: the forward, plus, with piecewise graphs, the two resume
# functions after the graph breaks at the splitting ops (without graphs nothing splits).
SOT_FRAMES = {name: 0 if cfg["graph_opt_level"] == 0 else 3 if cfg["use_cudagraph"] and not cfg["full_cuda_graph"]
              else 1 for name, cfg in MODES.items()}

# Where a call's path runs the same kernels as the twin on the same rows, it must be bitwise equal:
# level 0 (the eager forward, replayed or not) at captured sizes and above the max (no padding); and,
# as measured on this build, the piecewise graphs of levels 1-2, whose SOT programs hold only the
# linear and norm layers (the attention and the gate run eagerly between them). A whole-forward SOT
# program may run other kernels than dygraph (last-bit differences, up to 5e-7 here), and a padded
# size multiplies more rows: those are checked within ROW_TOLERANCE.
BITWISE = {(name, kind) for name in MODES for kind in ("captured", "above max")
           if name.startswith("L0") or name.endswith("graphs-piecewise") and "nographs" not in name}

# -- 1. soak --------------------------------------------------------------------------------------
CALLS = 10_000


def test_soak_ten_thousand_random_calls_across_every_mode():
    rng = random.Random(2024)
    nrng = np.random.default_rng(2024)
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        models = {}
        for name, cfg in MODES.items():
            model, twin = build(**cfg)
            # Sizes 4 and 1 are left out of capture_model: the warm-up below captures them lazily.
            report = capture(model, sizes=[8, 2] if cfg["use_cudagraph"] else None)
            assert report.failed is None, (name, report.failed)
            models[name] = (model, twin)
        names = list(models)
        # Inputs made once: paddle.to_tensor itself leaks a small list per call in Paddle 3.3.1, which
        # would blur what is measured here.
        pool = {bs: [make_inputs(bs, rng=nrng) for _ in range(4)] for bs in range(0, 2 * max(SIZES) + 8)}
        calls = {n: 0 for n in names}
        worst = {}  # (mode, "captured" / "padded" / "above max") -> largest |difference| to the twin
        empty = refused = 0
        mismatches = []
        rss, objects, translations = {}, {}, {}
        # Every mode meets every size once before the random calls: lazy captures, the static path's
        # first traces (batch 0, above the max) and the first refusal happen here, not mid-soak.
        for name in names:
            model, _ = models[name]
            for bs in range(0, 2 * max(SIZES) + 5):
                model(*pool[bs][0])
            with contextlib.suppress(ValueError, RuntimeError):
                model(pool[3][0][0], pool[4][0][1])
        trend = []  # RSS in MiB every 1,000 calls, printed
        sot_frames = 0  # SOT frames run after call 1,000 (see BLOCK_GROWTH_BOUND)
        start = time.perf_counter()
        for i in range(1, CALLS + 1):
            name = rng.choice(names)
            model, twin = models[name]
            calls[name] += 1
            frames = SOT_FRAMES[name] if i > 1_000 else 0
            bs = rng.randint(0, 2 * max(SIZES) + 4)  # 0, captured, padded (3, 5-7) and above the max (9-20)
            if rng.random() < 0.03:  # dynamic dims that disagree: x and g with other batch sizes
                x, g = rng.choice(pool[bs])[0], rng.choice(pool[bs + rng.randint(1, 3)])[1]
                try:
                    want = twin(x, g).numpy()  # broadcasts when g has 1 row, else raises
                except ValueError:
                    want = None
                if MODES[name]["use_cudagraph"]:
                    # With graphs the batch dims must agree (one padded size, one static buffer per
                    # argument): a clear error naming both, before anything is copied or replayed.
                    with pytest.raises(graph_opt.GraphOptInputError) as err:
                        model(x, g)
                    assert f"'x' has {bs} (dim 0), 'g' has {g.shape[0]} (dim 0)" in str(err.value)
                    refused += 1
                    frames = 0  # refused before anything ran
                elif want is not None:  # without graphs the forward decides, as without the plugin
                    out = model(x, g).numpy()
                    if not diff(out, want) <= ROW_TOLERANCE:
                        mismatches.append((i, name, bs, "broadcast", diff(out, want)))
                elif name.startswith("L0"):  # transparent: the framework's own error
                    with pytest.raises(ValueError, match="Broadcast dimension mismatch"):
                        model(x, g)
                    refused += 1
                else:  # the static path failed: the plugin names the arguments instead of SOT's trace
                    with pytest.raises(graph_opt.GraphOptInputError) as err:
                        model(x, g)
                    assert f"'x' has {bs} (dim 0), 'g' has {g.shape[0]} (dim 0)" in str(err.value)
                    assert "Broadcast dimension mismatch" in str(err.value.__cause__)
                    refused += 1
            else:
                x, g = rng.choice(pool[bs])
                out = model(x, g).numpy()  # valid until the next call: read it now
                want = twin(x, g).numpy()
                if out.shape != (bs, HIDDEN):
                    mismatches.append((i, name, bs, "shape", out.shape))
                elif bs == 0:
                    empty += 1
                else:
                    kind = "captured" if bs in SIZES else "padded" if bs < max(SIZES) else "above max"
                    d = diff(out, want)
                    worst[name, kind] = max(worst.get((name, kind), 0.0), d)
                    if not d <= (0.0 if (name, kind) in BITWISE else ROW_TOLERANCE):
                        mismatches.append((i, name, bs, kind, d))
            sot_frames += frames
            if i % 1_000 == 0:
                trend.append(round(rss_bytes() / 2**20, 1))
            if i in (1_000, 10_000):
                gc.collect()
                rss[i], objects[i] = rss_bytes(), sys.getallocatedblocks()
                translations[i] = sot.translate_count()
        seconds = time.perf_counter() - start
        growth = rss[10_000] - rss[1_000]
        print(f"\npaddle soak: {CALLS} calls in {seconds:.1f} s over {len(names)} modes {sorted(calls.values())}; "
              f"empty {empty}, refused {refused}; RSS at call 1,000 {rss[1_000] / 2**20:.1f} MiB, at call 10,000 "
              f"{rss[10_000] / 2**20:.1f} MiB, growth {growth / 2**20:+.2f} MiB; "
              f"Python memory blocks {objects[1_000]} -> "
              f"{objects[10_000]} ({sot_frames} SOT frames run); RSS every 1,000 calls {trend}")
        for (name, kind), d in sorted(worst.items()):
            print(f"  {name:24} {kind:10} max |out - eager| {d:.3g}{' (bitwise)' if (name, kind) in BITWISE else ''}")
        assert mismatches == []
        assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB from call 1,000 to call 10,000"
        assert objects[10_000] - objects[1_000] < BLOCK_GROWTH_BOUND + sot_frames, (objects, sot_frames)
        assert translations[10_000] == translations[1_000], "SOT translated again after warm-up"
        assert min(calls.values()) > 600 and refused > 100 and empty > 300
        for name, (model, _) in models.items():
            st = graph_opt.stats(model)
            assert st.capture_failures == 0 and st.replay_failures == 0 and st.disabled_reason is None, name
            if MODES[name]["use_cudagraph"]:
                assert st.captured_sizes == SIZES and st.lazy_captures == 2, name
                assert st.replays > 200 and st.fallbacks > 200, name  # above the max, and batch 0
            else:
                assert st.replays == 0 and st.captures == 0, name


# -- 2. faults ------------------------------------------------------------------------------------
FAULT_MODES = {  # level 2 is level 1 on this CPU build: not repeated here
    "L0-full": dict(graph_opt_level=0, full_cuda_graph=True),
    "L0-piecewise": dict(graph_opt_level=0, full_cuda_graph=False),
    "L1-full": dict(graph_opt_level=1, full_cuda_graph=True),
    "L1-piecewise": dict(graph_opt_level=1, full_cuda_graph=False),
}
FAULT_BITWISE = {"L0-full", "L0-piecewise", "L1-piecewise"}  # at captured sizes; see BITWISE


class RaisingComm:
    """A custom all-reduce whose capture() raises on enter, once."""

    def __init__(self):
        self.armed = True

    @contextlib.contextmanager
    def capture(self):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure entering comm.capture()")
        yield


@contextlib.contextmanager
def patched(owner, attr, value):
    """owner.attr = value for the block (pytest's monkeypatch.undo() would also undo conftest's env cleanup)."""
    real = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield real
    finally:
        setattr(owner, attr, real)


def _fail_at(real, at, fail):
    """A wrapper of `real` whose `at`-th call runs fail() first (which raises, or arms a deeper fault)."""
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == at:
            fail()
        return real(*args, **kwargs)

    return wrapper


def _raise(message):
    def fail():
        raise RuntimeError(message)

    return fail


@contextlib.contextmanager
def inject(point, level):
    """Arms the fault `point` for the capture_model call in the block; yields the message it raises."""
    strategy_cls = EagerStrategy if level == 0 else sot.SotStrategy
    with contextlib.ExitStack() as stack:
        if point == "first warmup":
            message = "injected failure in the first warmup"
            stack.enter_context(patched(strategy_cls, "warmup", _fail_at(strategy_cls.warmup, 1, _raise(message))))
        elif point == "translation":
            message = "injected failure in SOT's translation"
            stack.enter_context(patched(sot, "eval_frame_callback",
                                        _fail_at(sot.eval_frame_callback, 1, _raise(message))))
        elif point == "capture of the 2nd size":
            # The 2nd size's capture fails inside the strategy, where its first graph is made (for SOT:
            # inside run_program, inside SOT's frames), after its warmups ran.
            message = "injected failure capturing the 2nd size"
            real_init = testing.HostGraph.__init__
            stack.callback(setattr, testing.HostGraph, "__init__", real_init)

            def failing_init(self, *a, **k):
                testing.HostGraph.__init__ = real_init
                raise RuntimeError(message)

            def arm():
                testing.HostGraph.__init__ = failing_init

            stack.enter_context(patched(strategy_cls, "capture", _fail_at(strategy_cls.capture, 2, arm)))
        elif point == "splitting op":
            message = "injected failure in a splitting op"
            FAULT["split"] = True
            stack.callback(FAULT.__setitem__, "split", False)
        elif point == "comm.capture()":
            message = "injected failure entering comm.capture()"
            comm = graph_opt.register_custom_allreduce(RaisingComm())
            stack.callback(graph_opt.unregister_custom_allreduce, comm)
        else:
            raise AssertionError(point)
        yield message


def _check_outputs(model, twin, sizes=(1, 3, 8, 12, 0)):
    for bs in sizes:
        x, g = make_inputs(bs, rng=np.random.default_rng(100 + bs))
        out = model(x, g).numpy()
        assert out.shape == (bs, HIDDEN)
        assert diff(out, twin(x, g).numpy()) <= ROW_TOLERANCE, bs


def _check_recovers(model, twin, mode):
    """clear_graphs + capture_model: graphs replayed again, outputs right (bitwise where the path is)."""
    graph_opt.clear_graphs(model)
    report = capture(model)
    assert report.failed is None and report.captured_sizes == SIZES
    before = graph_opt.stats(model)
    assert before.disabled_reason is None
    for bs in (1, 2, 3, 8):
        x, g = make_inputs(bs, rng=np.random.default_rng(200 + bs))
        out = model(x, g).numpy()
        want = twin(x, g).numpy()
        assert np.array_equal(out, want) if bs in SIZES and mode in FAULT_BITWISE else diff(out, want) <= ROW_TOLERANCE
    after = graph_opt.stats(model)
    assert after.replays - before.replays == 4 and after.fallbacks == before.fallbacks


CAPTURE_FAULTS = [
    pytest.param(point, mode, id=f"{point}-{mode}")
    for point in ("first warmup", "translation", "capture of the 2nd size", "splitting op", "comm.capture()")
    for mode in FAULT_MODES
    if not (point == "translation" and mode.startswith("L0")) and not (point == "splitting op" and "full" in mode)
]


@pytest.mark.parametrize("point,mode", CAPTURE_FAULTS)
def test_a_fault_in_the_capture_phase_warns_once_keeps_the_model_right_and_recovers(
        point, mode, graph_opt_warnings):
    cfg = FAULT_MODES[mode]
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model, twin = build(**cfg)
        with inject(point, cfg["graph_opt_level"]) as message:
            report = capture(model)
        assert report.failed and message in report.failed, report.failed
        assert leftover_capture_state() == {k: False for k in leftover_capture_state()}
        warnings = graph_opt_warnings(WARNINGS)
        assert len(warnings) == 1 and message in warnings[0], warnings
        st = graph_opt.stats(model)
        assert st.capture_failures == 1 and st.captured_sizes == [] and message in st.disabled_reason
        _check_outputs(model, twin)
        assert graph_opt.stats(model).fallbacks == 5 and graph_opt.stats(model).replays == 0
        _check_recovers(model, twin, mode)
        assert len(graph_opt_warnings(WARNINGS)) == 1


@contextlib.contextmanager
def replay_fault():
    """HostGraph.replay raises once when armed. Patched before capture: level 0 binds graph.replay then."""
    real = testing.HostGraph.replay
    state = {"armed": False, "raised": 0}

    def replay(self):
        if state["armed"]:
            state["armed"] = False
            state["raised"] += 1
            raise RuntimeError("injected failure in a replay")
        return real(self)

    with patched(testing.HostGraph, "replay", replay):
        yield state


@pytest.mark.parametrize("mode", list(FAULT_MODES))
def test_a_replay_that_raises_answers_eagerly_warns_once_and_recovers(mode, graph_opt_warnings):
    with testing.simulate_cuda_graphs(), paddle.no_grad(), replay_fault() as fault:
        model, twin = build(**FAULT_MODES[mode])
        assert capture(model).failed is None
        _check_outputs(model, twin, sizes=(2,))
        fault["armed"] = True
        x, g = make_inputs(3, rng=np.random.default_rng(7))
        out = model(x, g).numpy()  # the replay raises: answered by the eager forward
        assert fault["raised"] == 1
        assert diff(out, twin(x, g).numpy()) <= ROW_TOLERANCE
        warnings = graph_opt_warnings(WARNINGS)
        assert len(warnings) == 1 and "replay of size 4 failed" in warnings[0] and "injected" in warnings[0]
        st = graph_opt.stats(model)
        assert st.replay_failures == 1 and "injected failure in a replay" in st.disabled_reason
        assert st.captured_sizes == [] and st.replays == 1 and st.fallbacks == 1
        _check_outputs(model, twin)
        assert graph_opt.stats(model).fallbacks == 6
        _check_recovers(model, twin, mode)
        assert len(graph_opt_warnings(WARNINGS)) == 1


def test_a_replay_failing_on_the_callers_inputs_raises_their_error_and_keeps_the_graphs(graph_opt_warnings):
    """A splitting op runs eagerly at every piecewise replay: an error it raises for these inputs is
    the caller's (the plain forward raises it too), so it propagates and the graphs stay."""
    calls = {"n": 0}

    @graph_opt.splitting_op(name="soak_paddle_picky")
    def picky(h):
        if not graph_opt.is_capturing() and float(h.abs().max()) > 1e3:
            raise ValueError("picky: values above 1e3")
        calls["n"] += 1
        return h * 2.0

    class Picky(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return picky(self.lin(x)) + 1.0

    Model = graph_opt.support_graph_optimization(type("PickyModel", (Picky,), {}))
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model = Model(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=0, full_cuda_graph=False, cudagraph_capture_sizes=SIZES))
        graph_opt.capture_model(model, lambda bs: paddle.randn([bs, HIDDEN]), progress=False)
        with pytest.raises(ValueError, match="picky: values above 1e3") as err:
            model(paddle.full([2, HIDDEN], 1e6))
        assert err.value.__suppress_context__
        x = paddle.randn([3, HIDDEN])
        assert np.allclose(model(x).numpy(), (Picky.forward(model, x)).numpy(), atol=ROW_TOLERANCE)
        st = graph_opt.stats(model)
        assert st.disabled_reason is None and st.replay_failures == 0 and st.replays == 1
        assert graph_opt_warnings(WARNINGS) == []


# -- 3. two threads -------------------------------------------------------------------------------
def test_a_call_from_a_second_thread_while_one_replays_is_a_clear_error():
    inside, go = threading.Event(), threading.Event()
    real = testing.HostGraph.replay

    def blocking_replay(self):
        if not inside.is_set():
            inside.set()
            assert go.wait(30)
        return real(self)

    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model, twin = build(graph_opt_level=1, full_cuda_graph=True)
        capture(model)
        stack = contextlib.ExitStack()
        stack.enter_context(patched(testing.HostGraph, "replay", blocking_replay))
        x1, g1 = make_inputs(4, rng=np.random.default_rng(1))
        result = {}

        def first():
            with paddle.no_grad():
                result["out"] = model(x1, g1).numpy()

        t = threading.Thread(target=first)
        t.start()
        assert inside.wait(30)
        x2, g2 = make_inputs(2, rng=np.random.default_rng(2))
        busy = r"GraphNet is being called from two threads at once; graph replay is not thread-safe"
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            model(x2, g2)
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            graph_opt.clear_graphs(model)
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            capture(model)
        go.set()
        t.join(30)
        stack.close()
        assert diff(result["out"], twin(x1, g1).numpy()) <= ROW_TOLERANCE
        assert diff(model(x2, g2).numpy(), twin(x2, g2).numpy()) <= ROW_TOLERANCE
        st = graph_opt.stats(model)
        assert st.replays == 2 and st.captured_sizes == SIZES and st.disabled_reason is None


def _hammer(model, twin, seed, calls, started, results, check_all=False):
    """Calls `model` from this thread; checks every output whose window no other call overlapped (all of
    them with check_all: without graphs every call returns fresh tensors)."""
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for _ in range(calls):
            bs = int(rng.integers(1, 2 * max(SIZES) + 1))
            x, g = make_inputs(bs, rng=rng)
            want = twin(x, g).numpy()
            with started["lock"]:
                started["n"] += 1
                before = started["n"]
            try:
                out = model(x, g).numpy()
            except graph_opt.GraphOptError as exc:
                assert "two threads at once" in str(exc)
                results["refused"] += 1
                continue
            with started["lock"]:
                clean = started["n"] == before  # no other call began while this one ran and was read
            results["answered"] += 1
            if clean or check_all:
                results["checked"] += 1
                if not diff(out, want) <= ROW_TOLERANCE:
                    results["wrong"] += 1


@pytest.mark.parametrize("mode", ["L1-graphs-full", "L0-graphs-piecewise", "L1-nographs-full"])
def test_two_threads_calling_one_model_get_right_answers_or_a_clear_error(mode):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that calls overlap
    try:
        with testing.simulate_cuda_graphs(), paddle.no_grad():
            model, twin = build(**MODES[mode])
            capture(model)
            started = {"lock": threading.Lock(), "n": 0}
            results = [dict(refused=0, answered=0, checked=0, wrong=0) for _ in range(2)]
            errors = []

            def run(i):
                try:
                    _hammer(model, twin, i, 150, started, results[i], check_all=not MODES[mode]["use_cudagraph"])
                except BaseException as exc:  # reported below, with the thread's traceback
                    errors.append(exc)
                    raise

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            total = {k: sum(r[k] for r in results) for k in results[0]}
            print(f"\n{mode}: {total}")
            assert total["wrong"] == 0 and total["answered"] + total["refused"] == 300
            assert total["checked"] > 0
            if not MODES[mode]["use_cudagraph"]:
                assert total["refused"] == 0 and total["checked"] == 300  # no shared buffers: all answered
            st = graph_opt.stats(model)
            assert st.replays + st.fallbacks == (total["answered"] if MODES[mode]["use_cudagraph"] else 0)
            _check_outputs(model, twin)
    finally:
        sys.setswitchinterval(old)


def test_two_models_in_two_threads_do_not_disturb_each_other():
    """Each model in its own thread: no refusal, every output right (SOT's hooks are process-wide)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with testing.simulate_cuda_graphs(), paddle.no_grad():
            pairs = [build(seed=i, graph_opt_level=1, full_cuda_graph=i == 0) for i in range(2)]
            for model, _ in pairs:
                capture(model)
            started = [{"lock": threading.Lock(), "n": 0} for _ in range(2)]
            results = [dict(refused=0, answered=0, checked=0, wrong=0) for _ in range(2)]
            errors = []

            def run(i):
                try:
                    _hammer(*pairs[i], i, 150, started[i], results[i])
                except BaseException as exc:
                    errors.append(exc)
                    raise

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            assert results == [dict(refused=0, answered=150, checked=150, wrong=0)] * 2
    finally:
        sys.setswitchinterval(old)


def test_eager_code_in_another_thread_during_a_replay_leaves_no_flag_set():
    """The capture flags and the split hook are process-wide. A level-0 replay (simulated: the eager
    forward again, with is_capturing() true in its pieces) is held inside a piece while another thread
    runs an eager model that calls the same splitting op, and leaves after the replay. That thread must
    not go through the replay's split hook: it would save is_capturing() true on entry and restore it
    after the replay ended, leaving it true for good (every later capture and call then takes the
    capture branch)."""
    with testing.simulate_cuda_graphs(), paddle.no_grad():
        model, twin = build(graph_opt_level=0, full_cuda_graph=False)
        capture(model)
        in_piece, release_replay = threading.Event(), threading.Event()
        held = {"on": False}

        def hold_in_piece(layer, inputs):
            if held["on"] and graph_opt.is_capturing():
                held["on"] = False
                in_piece.set()
                assert release_replay.wait(30)

        handle = model.gate.register_forward_pre_hook(hold_in_piece)
        x, g = make_inputs(4)
        result = {}

        def replay():
            with paddle.no_grad():
                result["out"] = model(x, g).numpy()

        entered, release_eager = threading.Event(), threading.Event()

        def eager():
            FAULT["hold"] = (threading.get_ident(), entered, release_eager)  # blocks this thread in soak_gate
            with paddle.no_grad():
                result["eager"] = twin(x, g).numpy()

        try:
            held["on"] = True
            a = threading.Thread(target=replay)
            a.start()
            assert in_piece.wait(30)
            b = threading.Thread(target=eager)
            b.start()
            assert entered.wait(30)  # the eager thread is inside the splitting op
            release_replay.set()
            a.join(30)  # the replay has ended
            release_eager.set()
            b.join(30)
        finally:
            FAULT["hold"] = None
            release_replay.set()
            release_eager.set()
            handle.remove()
        assert leftover_capture_state() == {k: False for k in leftover_capture_state()}
        assert np.array_equal(result["out"], result["eager"])
        assert graph_opt.stats(model).replays == 1
