"""The soak and fault suite, once for both frameworks, with simulated graphs: 10,000 random calls across
every mode of the mode table against an undecorated eager twin, RSS flat; an exception injected at each
point of the capture phase and at a replay; two threads calling one model.

Each framework brings its model and eager twin, how it makes inputs and compares outputs, and its own
fault point (SOT's translation callback, the Dynamo backend) as a SoakKit: the fixture `kit`
(tests/both/conftest.py; tests/torch_zoo/soak.py, tests/paddle_zoo/soak.py).
"""
import contextlib
import gc
import os
import random
import sys
import threading
import time

import pytest

import graph_opt
from graph_opt import testing
from graph_opt.capture import split
from graph_opt.capture.level0 import EagerStrategy
from soak_support import (BLOCK_GROWTH_BOUND, CALLS, FAULT, FAULT_MODES, HIDDEN, MODES, ROW_TOLERANCE,
                          RSS_GROWTH_BOUND, SIZES, WARNINGS, leftover_capture_state)

_CI_SECONDS = 27  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

# the modes of the two-threads-one-model test
THREAD_MODES = {"torch": ["L1-graphs-piecewise", "L0-graphs-full", "L1-nographs-full"],
                "paddle": ["L1-graphs-full", "L0-graphs-piecewise", "L1-nographs-full"]}


# -- 1. soak --------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_ten_thousand_random_calls_across_every_mode(kit):
    rng = random.Random(2024)
    source = kit.rng(2024)
    with testing.simulate_cuda_graphs(), kit.no_grad():
        models = {}
        for name, cfg in MODES.items():
            model, twin = kit.build(**cfg)
            # Sizes 4 and 1 are left out of capture_model: the warm-up below captures them lazily.
            report = kit.capture(model, sizes=[8, 2] if cfg["use_cudagraph"] else None)
            assert report.failed is None, (name, report.failed)
            models[name] = (model, twin)
        names = list(models)
        # Inputs made once: paddle.to_tensor itself leaks a small list per call in Paddle 3.3.1, which
        # would blur what is measured here.
        pool = {bs: [kit.make_inputs(bs, rng=source) for _ in range(4)] for bs in range(0, 2 * max(SIZES) + 8)}
        calls = {n: 0 for n in names}
        worst = {}  # (mode, "captured" / "padded" / "above max") -> largest |difference| to the twin
        empty = refused = 0
        mismatches = []
        rss, objects, compiled = {}, {}, {}
        # Every mode meets every size once before the random calls: lazy captures, the static path's
        # first traces (batch 0, above the max) and the first refusal happen here, not mid-soak.
        for name in names:
            model, _ = models[name]
            for bs in range(0, 2 * max(SIZES) + 5):
                model(*pool[bs][0])
            with contextlib.suppress(ValueError, RuntimeError):
                model(pool[3][0][0], pool[4][0][1])
        trend = []  # RSS in MiB every 1,000 calls, printed
        frames_run = 0  # frames_per_call summed after call 1,000 (see BLOCK_GROWTH_BOUND)
        start = time.perf_counter()
        for i in range(1, CALLS + 1):
            name = rng.choice(names)
            model, twin = models[name]
            calls[name] += 1
            frames = kit.frames_per_call.get(name, 0) if i > 1_000 else 0
            bs = rng.randint(0, 2 * max(SIZES) + 4)  # 0, captured, padded (3, 5-7) and above the max (9-20)
            if rng.random() < 0.03 and name not in kit.no_mismatch:  # dynamic dims that disagree
                x, g = rng.choice(pool[bs])[0], rng.choice(pool[bs + rng.randint(1, 3)])[1]
                try:
                    want = kit.read(twin(x, g))  # broadcasts when g has 1 row, else raises
                except kit.eager_error:
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
                    out = kit.read(model(x, g))
                    if not kit.diff(out, want) <= ROW_TOLERANCE:
                        mismatches.append((i, name, bs, "broadcast", kit.diff(out, want)))
                elif name.startswith("L0"):  # transparent: the framework's own error
                    with pytest.raises(kit.eager_error, match=kit.eager_error_match):
                        model(x, g)
                    refused += 1
                else:  # the static path failed: the plugin names the arguments instead of the trace
                    with pytest.raises(graph_opt.GraphOptInputError) as err:
                        model(x, g)
                    assert f"'x' has {bs} (dim 0), 'g' has {g.shape[0]} (dim 0)" in str(err.value)
                    assert kit.eager_error_match in str(err.value.__cause__)
                    refused += 1
            else:
                x, g = rng.choice(pool[bs])
                out = kit.read(model(x, g))  # valid until the next call: read it now
                want = kit.read(twin(x, g))
                if out.shape != (bs, HIDDEN):
                    mismatches.append((i, name, bs, "shape", tuple(out.shape)))
                elif bs == 0:
                    empty += 1
                else:
                    kind = "captured" if bs in SIZES else "padded" if bs < max(SIZES) else "above max"
                    d = kit.diff(out, want)
                    worst[name, kind] = max(worst.get((name, kind), 0.0), d)
                    if not d <= (0.0 if (name, kind) in kit.bitwise else ROW_TOLERANCE):
                        mismatches.append((i, name, bs, kind, d))
            frames_run += frames
            if i % 1_000 == 0:
                trend.append(round(rss_bytes() / 2**20, 1))
            if i in (1_000, 10_000):
                gc.collect()
                rss[i], objects[i], compiled[i] = rss_bytes(), sys.getallocatedblocks(), kit.compile_count()
        seconds = time.perf_counter() - start
        growth = rss[10_000] - rss[1_000]
        print(f"\n{kit.name} soak: {CALLS} calls in {seconds:.1f} s over {len(names)} modes {sorted(calls.values())}; "
              f"empty {empty}, refused {refused}; RSS at call 1,000 {rss[1_000] / 2**20:.1f} MiB, at call 10,000 "
              f"{rss[10_000] / 2**20:.1f} MiB, growth {growth / 2**20:+.2f} MiB; "
              f"Python memory blocks {objects[1_000]} -> "
              f"{objects[10_000]} ({frames_run} frames run); RSS every 1,000 calls {trend}")
        for (name, kind), d in sorted(worst.items()):
            bitwise = " (bitwise)" if (name, kind) in kit.bitwise else ""
            print(f"  {name:24} {kind:10} max |out - eager| {d:.3g}{bitwise}")
        assert mismatches == []
        assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB from call 1,000 to call 10,000"
        assert objects[10_000] - objects[1_000] < BLOCK_GROWTH_BOUND + frames_run, (objects, frames_run)
        assert compiled[10_000] == compiled[1_000], kit.recompile_message
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
def inject(kit, point, level):
    """Arms the fault `point` for the capture_model call in the block; yields the message it raises."""
    strategy_cls = EagerStrategy if level == 0 else kit.strategy
    with contextlib.ExitStack() as stack:
        if point == "first warmup":
            message = "injected failure in the first warmup"
            stack.enter_context(patched(strategy_cls, "warmup", _fail_at(strategy_cls.warmup, 1, _raise(message))))
        elif point == "translation":
            # SOT's translation callback, or the torch.compile backend Dynamo calls once it has traced
            # the forward: during the first warmup.
            owner, attr, message = kit.translation
            stack.enter_context(patched(owner, attr, _fail_at(getattr(owner, attr), 1, _raise(message))))
        elif point == "capture of the 2nd size":
            # The 2nd size's capture fails inside the strategy, where its first graph is made (level 1:
            # inside a piece, inside SOT's frames or Dynamo's compiled forward), after its warmups ran.
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


def check_outputs(kit, model, twin, sizes=(1, 3, 8, 12, 0)):
    for bs in sizes:
        x, g = kit.make_inputs(bs, rng=kit.rng(100 + bs))
        out = kit.read(model(x, g))
        assert out.shape == (bs, HIDDEN)
        assert kit.diff(out, kit.read(twin(x, g))) <= ROW_TOLERANCE, bs


def _check_recovers(kit, model, twin, mode):
    """clear_graphs + capture_model: graphs replayed again, outputs right (bitwise where the path is)."""
    bitwise = (mode.replace("-", "-graphs-"), "captured") in kit.bitwise  # "L0-full": "L0-graphs-full"
    graph_opt.clear_graphs(model)
    report = kit.capture(model)
    assert report.failed is None and report.captured_sizes == SIZES
    before = graph_opt.stats(model)
    assert before.disabled_reason is None
    for bs in (1, 2, 3, 8):
        x, g = kit.make_inputs(bs, rng=kit.rng(200 + bs))
        out, want = kit.read(model(x, g)), kit.read(twin(x, g))
        assert kit.equal(out, want) if bs in SIZES and bitwise else kit.diff(out, want) <= ROW_TOLERANCE
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
        kit, point, mode, graph_opt_warnings):
    cfg = FAULT_MODES[mode]
    with testing.simulate_cuda_graphs(), kit.no_grad():
        model, twin = kit.build(**cfg)
        with inject(kit, point, cfg["graph_opt_level"]) as message:
            report = kit.capture(model)
        assert report.failed and message in report.failed, report.failed
        assert leftover_capture_state(kit, model) == {k: False for k in leftover_capture_state(kit, model)}
        warnings = graph_opt_warnings(WARNINGS)
        assert len(warnings) == 1 and message in warnings[0], warnings
        st = graph_opt.stats(model)
        assert st.capture_failures == 1 and st.captured_sizes == [] and message in st.disabled_reason
        check_outputs(kit, model, twin)
        assert graph_opt.stats(model).fallbacks == 5 and graph_opt.stats(model).replays == 0
        _check_recovers(kit, model, twin, mode)
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
def test_a_replay_that_raises_answers_eagerly_warns_once_and_recovers(kit, mode, graph_opt_warnings):
    with testing.simulate_cuda_graphs(), kit.no_grad(), replay_fault() as fault:
        model, twin = kit.build(**FAULT_MODES[mode])
        assert kit.capture(model).failed is None
        check_outputs(kit, model, twin, sizes=(2,))
        fault["armed"] = True
        x, g = kit.make_inputs(3)
        out = kit.read(model(x, g))  # the replay raises: answered by the eager forward
        assert fault["raised"] == 1
        assert kit.diff(out, kit.read(twin(x, g))) <= ROW_TOLERANCE
        warnings = graph_opt_warnings(WARNINGS)
        assert len(warnings) == 1 and "replay of size 4 failed" in warnings[0] and "injected" in warnings[0]
        st = graph_opt.stats(model)
        assert st.replay_failures == 1 and "injected failure in a replay" in st.disabled_reason
        assert st.captured_sizes == [] and st.replays == 1 and st.fallbacks == 1
        check_outputs(kit, model, twin)
        assert graph_opt.stats(model).fallbacks == 6
        _check_recovers(kit, model, twin, mode)
        assert len(graph_opt_warnings(WARNINGS)) == 1


# -- 3. two threads -------------------------------------------------------------------------------
def test_a_call_from_a_second_thread_while_one_replays_is_a_clear_error(kit):
    inside, go, armed = threading.Event(), threading.Event(), threading.Event()
    real = testing.HostGraph.replay

    def blocking_replay(self):
        if armed.is_set() and not inside.is_set():
            inside.set()
            assert go.wait(30)
        return real(self)

    # Patched before the capture: a replay may hold the graphs' bound replay methods from then on.
    with testing.simulate_cuda_graphs(), kit.no_grad(), patched(testing.HostGraph, "replay", blocking_replay):
        model, twin = kit.build(**MODES[kit.busy_mode])
        kit.capture(model)
        armed.set()
        x1, g1 = kit.make_inputs(4, rng=kit.rng(1))
        result = {}

        def first():
            with kit.no_grad():
                result["out"] = kit.read(model(x1, g1))

        t = threading.Thread(target=first)
        t.start()
        assert inside.wait(30)
        x2, g2 = kit.make_inputs(2, rng=kit.rng(2))
        busy = r"GraphNet is being called from two threads at once; graph replay is not thread-safe"
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            model(x2, g2)
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            graph_opt.clear_graphs(model)
        with pytest.raises(graph_opt.GraphOptError, match=busy):
            kit.capture(model)
        go.set()
        t.join(30)
        if (kit.busy_mode, "captured") in kit.bitwise:
            assert kit.equal(result["out"], kit.read(twin(x1, g1)))
            assert kit.equal(kit.read(model(x2, g2)), kit.read(twin(x2, g2)))
        else:
            assert kit.diff(result["out"], kit.read(twin(x1, g1))) <= ROW_TOLERANCE
            assert kit.diff(kit.read(model(x2, g2)), kit.read(twin(x2, g2))) <= ROW_TOLERANCE
        st = graph_opt.stats(model)
        assert st.replays == 2 and st.captured_sizes == SIZES and st.disabled_reason is None


def _hammer(kit, model, twin, seed, calls, started, results, check_all=False):
    """Calls `model` from this thread; checks every output whose window no other call overlapped (all of
    them with check_all: without graphs every call returns fresh tensors)."""
    source = kit.rng(seed)
    rng = random.Random(seed)
    with kit.no_grad():
        for _ in range(calls):
            x, g = kit.make_inputs(rng.randint(1, 2 * max(SIZES)), rng=source)
            want = kit.read(twin(x, g))
            with started["lock"]:
                started["n"] += 1
                before = started["n"]
            try:
                out = kit.read(model(x, g))
            except graph_opt.GraphOptError as exc:
                assert "two threads at once" in str(exc)
                results["refused"] += 1
                continue
            with started["lock"]:
                clean = started["n"] == before  # no other call began while this one ran and was read
            results["answered"] += 1
            if clean or check_all:
                results["checked"] += 1
                if not kit.diff(out, want) <= ROW_TOLERANCE:
                    results["wrong"] += 1


def _in_two_threads(target, args_of):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so that calls overlap
    errors = []

    def run(i):
        try:
            target(*args_of(i))
        except BaseException as exc:  # reported below
            errors.append(exc)
            raise

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert errors == []


@pytest.mark.per_framework("mode", THREAD_MODES)
def test_two_threads_calling_one_model_get_right_answers_or_a_clear_error(kit, mode):
    with testing.simulate_cuda_graphs(), kit.no_grad():
        model, twin = kit.build(**MODES[mode])
        kit.capture(model)
        started = {"lock": threading.Lock(), "n": 0}
        results = [dict(refused=0, answered=0, checked=0, wrong=0) for _ in range(2)]
        graphs = MODES[mode]["use_cudagraph"]
        _in_two_threads(_hammer, lambda i: (kit, model, twin, i, 150, started, results[i], not graphs))
        total = {k: sum(r[k] for r in results) for k in results[0]}
        print(f"\n{mode}: {total}")
        assert total["wrong"] == 0 and total["answered"] + total["refused"] == 300
        assert total["checked"] > 0
        if not graphs:
            assert total["refused"] == 0 and total["checked"] == 300  # no shared buffers: all answered
        st = graph_opt.stats(model)
        assert st.replays + st.fallbacks == (total["answered"] if graphs else 0)
        check_outputs(kit, model, twin)


def test_two_models_in_two_threads_do_not_disturb_each_other(kit):
    """Each model in its own thread: no refusal, every output right (SOT's hooks are process-wide)."""
    with testing.simulate_cuda_graphs(), kit.no_grad():
        pairs = [kit.build(seed=i, graph_opt_level=1, full_cuda_graph=i == 0) for i in range(2)]
        for model, _ in pairs:
            kit.capture(model)
        started = [{"lock": threading.Lock(), "n": 0} for _ in range(2)]
        results = [dict(refused=0, answered=0, checked=0, wrong=0) for _ in range(2)]
        _in_two_threads(_hammer, lambda i: (kit, *pairs[i], i, 150, started[i], results[i]))
        assert results == [dict(refused=0, answered=150, checked=150, wrong=0)] * 2
