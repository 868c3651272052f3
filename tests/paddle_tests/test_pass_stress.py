"""Stress suite for the program passes: loop programs whose schedules differ, run under load.

Every shape is a static program with the meaning the static API gives it (a loop's operand keeps
its value; ``assign(new, output=loop_var)`` updates the loop's state). Each shape is run RUNS times
as built and RUNS times after the default passes, in one process, on the multi-threaded executor,
with a CPU-busy process alongside. The optimized runs must equal the meaning, computed in numpy,
in every run; the unoptimized failure rate is printed, not asserted (it depends on the machine).
The copies each shape gets inserted and removed are asserted exactly.
"""
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402

_CI_SECONDS = 6  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

N = 4096  # elements per tensor: big enough for the thread pool to interleave
ITERS = 6
RUNS = 50
DEFAULT = list(graph_opt.GraphOptConfig().program_passes)


@pytest.fixture(scope="module", autouse=True)
def static_mode():
    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    yield
    if was_dynamic:
        paddle.disable_static()


@pytest.fixture(scope="module")
def busy_cpu():
    """A process that spins for at most 5 minutes: the executor's threads then interleave more."""
    proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 300\nwhile time.time() < t: pass"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@dataclass
class Shape:
    build: Callable[[], tuple]  # -> (main, startup, fetch list)
    meaning: Callable[[Dict[str, np.ndarray]], List[np.ndarray]]
    inserted: int  # copies the default passes insert
    removed: int  # loop-carried copies they remove
    feeds: tuple = ("a", "b")


def _feed(rng, names):
    return {n: rng.uniform(-1.0, 1.0, N).astype("float32") for n in names}


def _program(fn):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        fetch = fn()
    return main, startup, list(fetch)


def _data(*names):
    return [paddle.static.data(n, [N], "float32") for n in names]


def _counter():
    return paddle.full([1], 0, "int64"), paddle.full([1], ITERS, "int64")


def _step_a(x):  # numpy twins of the loop bodies below
    return (x * 2.0 + 1.0).astype("float32")


def _step_b(x):
    return np.tanh(x).astype("float32")


def _loop_ab(feed, iters=ITERS):
    a, b = feed["a"].copy(), feed["b"].copy()
    for _ in range(iters):
        a, b = _step_a(a), _step_b(b)
    return a, b


def _body3(i, a, b):
    return [paddle.assign(i + 1, output=i), paddle.assign(a * 2.0 + 1.0, output=a),
            paddle.assign(paddle.tanh(b), output=b)]


# -- the shapes ----------------------------------------------------------------------------------------

def read_after(slot):
    """The issue's program: loop over [i, a, b]; the operand of one slot read after the loop."""
    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()
            out = paddle.static.nn.while_loop(lambda i, a, b: i < n, _body3, [i0, a, b])
            return list(out) + [{"i": i0, "a": a, "b": b}[slot] * 1.0]
        return _program(fn)

    def meaning(feed):
        a, b = _loop_ab(feed)
        before = {"i": np.zeros(1, "int64"), "a": feed["a"], "b": feed["b"]}[slot]
        return [np.array([ITERS], "int64"), a, b, before]

    # i's operand is a fill result, not fed: the loop frees it when it starts (E4), so its copy stays.
    return Shape(build, meaning, inserted=1 if slot == "i" else 0, removed=3)


def arg_read_after_copy():
    def body(i, a, b):
        new_a = paddle.assign(a * 2.0 + 1.0, output=a)
        t = a * 0.5  # reads the argument after its copy: the new value
        return [paddle.assign(i + 1, output=i), new_a, paddle.assign(paddle.tanh(b) + t, output=b)]

    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()
            return paddle.static.nn.while_loop(lambda i, a, b: i < n, body, [i0, a, b])
        return _program(fn)

    def meaning(feed):
        a, b = feed["a"].copy(), feed["b"].copy()
        for _ in range(ITERS):
            a = _step_a(a)
            b = (np.tanh(b) + (a * np.float32(0.5))).astype("float32")
        return [np.array([ITERS], "int64"), a, b]

    # a's copy stays (the new value is read after it), so the loop still writes a's buffer: the
    # fed a gets one copy before the loop, since a fetch of a would otherwise see the loop's work.
    return Shape(build, meaning, inserted=1, removed=2)


def nested_loops():
    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()

            def outer(i, h, s):
                m = paddle.full([1], 3, "int64")

                def inner(j, g):
                    return [paddle.assign(j + 1, output=j), paddle.assign(g * 0.5 + 0.25, output=g)]

                _, g = paddle.static.nn.while_loop(lambda j, g: j < m, inner, [paddle.full([1], 0, "int64"), h])
                return [paddle.assign(i + 1, output=i), paddle.assign(g + 1.0, output=h),
                        paddle.assign(s + h, output=s)]

            out = paddle.static.nn.while_loop(lambda i, h, s: i < n, outer, [i0, a, b])
            return list(out) + [a * 1.0]
        return _program(fn)

    def meaning(feed):
        h, s = feed["a"].copy(), feed["b"].copy()
        for _ in range(ITERS):
            g = h.copy()
            for _ in range(3):
                g = (g * np.float32(0.5) + np.float32(0.25)).astype("float32")
            h = (g + np.float32(1.0)).astype("float32")
            s = (s + h).astype("float32")  # `s + h` comes after h's copy: it reads the new h
        return [np.array([ITERS], "int64"), h, s, feed["a"]]

    # Inner j and g, outer i and s go; outer h stays (read after its copy), so the outer loop
    # still writes the fed a, which is read after it: one copy before the outer loop.
    return Shape(build, meaning, inserted=1, removed=4)


def source_written_in_place():
    def body(i, a, b):
        src = a * 2.0
        new_a = paddle.assign(src, output=a)
        paddle.assign(paddle.full([N], 7.0, "float32"), output=src)  # overwrites the copy's source
        return [paddle.assign(i + 1, output=i), new_a, paddle.assign(paddle.tanh(b) + src, output=b)]

    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()
            return paddle.static.nn.while_loop(lambda i, a, b: i < n, body, [i0, a, b])
        return _program(fn)

    def meaning(feed):
        a, b = feed["a"].copy(), feed["b"].copy()
        for _ in range(ITERS):
            a = (a * np.float32(2.0)).astype("float32")
            b = (np.tanh(b) + np.float32(7.0)).astype("float32")
        return [np.array([ITERS], "int64"), a, b]

    # a's copy stays (its source is overwritten after it): one copy of the fed a before the loop.
    return Shape(build, meaning, inserted=1, removed=2)


def persistable_state():
    """A persistable variable feeds the loop: every run must start from its initial value."""
    def build():
        def fn():
            (b,) = _data("b")
            state = paddle.create_parameter([N], "float32", default_initializer=paddle.nn.initializer.Constant(0.5))
            i0, n = _counter()
            out = paddle.static.nn.while_loop(lambda i, a, b: i < n, _body3, [i0, state, b])
            return list(out) + [state * 1.0]
        return _program(fn)

    def meaning(feed):
        a, b = _loop_ab({"a": np.full(N, 0.5, "float32"), "b": feed["b"]})
        return [np.array([ITERS], "int64"), a, b, np.full(N, 0.5, "float32")]

    # The loop releases a persistable operand when it starts: without its copy the second run fails.
    return Shape(build, meaning, inserted=1, removed=3, feeds=("b",))


def slice_of_carried_value():
    def body(i, a, b):
        head = a[0:8]  # a slice of the argument, taken before its copy and read after it
        new_a = paddle.assign(a * 2.0 + 1.0, output=a)
        return [paddle.assign(i + 1, output=i), new_a, paddle.assign(paddle.tanh(b) + paddle.sum(head), output=b)]

    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()
            out = paddle.static.nn.while_loop(lambda i, a, b: i < n, body, [i0, a, b])
            return list(out) + [a[4:12] * 1.0]
        return _program(fn)

    def meaning(feed):
        a, b = feed["a"].copy(), feed["b"].copy()
        for _ in range(ITERS):
            head = np.sum(a[0:8], dtype="float32")
            a, b = _step_a(a), (np.tanh(b) + head).astype("float32")
        return [np.array([ITERS], "int64"), a, b, feed["a"][4:12]]

    return Shape(build, meaning, inserted=0, removed=3)


def intermediate_fetched():
    """The loop's operand is an intermediate value that is also fetched."""
    def build():
        def fn():
            a, b = _data("a", "b")
            mid = a * 3.0
            i0, n = _counter()
            out = paddle.static.nn.while_loop(lambda i, a, b: i < n, _body3, [i0, mid, b])
            return list(out) + [mid]
        return _program(fn)

    def meaning(feed):
        mid = (feed["a"] * np.float32(3.0)).astype("float32")
        a, b = _loop_ab({"a": mid, "b": feed["b"]})
        return [np.array([ITERS], "int64"), a, b, mid]

    # Once the loop no longer writes mid, a fetch of it needs no copy (fetches are not freed early).
    return Shape(build, meaning, inserted=0, removed=3)


def carried_value_in_condition():
    def build():
        def fn():
            a, b = _data("a", "b")
            i0, n = _counter()
            limit = paddle.full([1], 1e30, "float32")

            def cond(i, a, b):
                return paddle.logical_and(i < n, paddle.max(paddle.abs(a)) < limit)

            out = paddle.static.nn.while_loop(cond, _body3, [i0, a, b])
            return list(out) + [a * 1.0]
        return _program(fn)

    def meaning(feed):
        a, b = _loop_ab(feed)
        return [np.array([ITERS], "int64"), a, b, feed["a"]]

    return Shape(build, meaning, inserted=0, removed=3)


def two_loops_share_an_input():
    def build():
        def fn():
            a, b = _data("a", "b")
            n = paddle.full([1], ITERS, "int64")

            def body(i, x):
                return [paddle.assign(i + 1, output=i), paddle.assign(x * 2.0 + 1.0, output=x)]

            _, x1 = paddle.static.nn.while_loop(lambda i, x: i < n, body, [paddle.full([1], 0, "int64"), a])
            _, x2 = paddle.static.nn.while_loop(lambda i, x: i < n, body, [paddle.full([1], 0, "int64"), a])
            return [x1, x2, a + b]
        return _program(fn)

    def meaning(feed):
        a, _ = _loop_ab(feed)
        return [a, a, (feed["a"] + feed["b"]).astype("float32")]

    return Shape(build, meaning, inserted=0, removed=4)


def no_block_arguments():
    """The body returns the very values it got: the while has no block arguments, and its
    assign_out_ ops are the state update itself; they stay."""
    def body(i, a):
        paddle.assign(i + 1, output=i)
        paddle.assign(a * 2.0 + 1.0, output=a)
        return [i, a]

    def build():
        def fn():
            a, b = _data("a", "b")
            state = a * 1.0
            i0, n = _counter()
            paddle.static.nn.while_loop(lambda i, a: i < n, body, [i0, state])
            return [state, b * 1.0]
        return _program(fn)

    def meaning(feed):
        a, _ = _loop_ab(feed)
        return [a, feed["b"]]

    return Shape(build, meaning, inserted=0, removed=0)


def write_into_cond_result():
    """Not a loop: an in-place write into an if's result writes the buffer of the value the
    taken branch yielded (the executor shares it), unordered against that value's other reads."""
    def build():
        def fn():
            a, b = _data("a", "b")
            pick = paddle.full([1], True, "bool")
            y = paddle.static.nn.cond(pick, lambda: a, lambda: b)
            y2 = paddle.assign(b * 2.0 + 1.0, output=y)
            return [y2, a * 1.0, y * 1.0]  # y after its write reads the written value
        return _program(fn)

    def meaning(feed):
        written = (feed["b"] * np.float32(2.0) + np.float32(1.0)).astype("float32")
        return [written, feed["a"], written]

    return Shape(build, meaning, inserted=1, removed=0)


SHAPES = {
    "slot_i_read_after_loop": read_after("i"),
    "slot_a_read_after_loop": read_after("a"),
    "slot_b_read_after_loop": read_after("b"),
    "block_arg_read_after_copy": arg_read_after_copy(),
    "nested_loops": nested_loops(),
    "inplace_op_on_copy_source": source_written_in_place(),
    "persistable_state": persistable_state(),
    "slice_of_carried_value": slice_of_carried_value(),
    "intermediate_value_fetched": intermediate_fetched(),
    "carried_value_in_condition": carried_value_in_condition(),
    "two_loops_share_an_input": two_loops_share_an_input(),
    "no_block_arguments": no_block_arguments(),
    "write_into_cond_result": write_into_cond_result(),
}


def _matches(got, want) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and np.allclose(g, w, rtol=1e-6, atol=1e-6) for g, w in zip(got, want))


def _runs(shape, optimize, seed):
    """(runs that equal the meaning, runs that raised) out of RUNS, one scope per program."""
    main, startup, fetch = shape.build()
    result = graph_opt.optimize_program(main) if optimize else None
    exe = paddle.static.Executor(paddle.CPUPlace())
    rng = np.random.default_rng(seed)
    good = raised = 0
    with paddle.static.scope_guard(paddle.static.Scope()):
        exe.run(startup)
        for _ in range(RUNS):
            feed = _feed(rng, shape.feeds)
            try:
                got = exe.run(main, feed=dict(feed), fetch_list=fetch)
            except Exception:  # noqa: BLE001 - the unoptimized program may fail (E4); counted
                raised += 1
                continue
            good += _matches(got, shape.meaning(feed))
    return good, raised, result


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_default_passes_give_the_meaning_in_every_run(name, busy_cpu):
    shape = SHAPES[name]
    good, raised, _ = _runs(shape, optimize=False, seed=1)
    print(f"\n{name}: unoptimized {RUNS - good}/{RUNS} wrong ({raised} raised)")
    good, raised, result = _runs(shape, optimize=True, seed=1)
    assert (result["copies_inserted"], result["copies_removed"]) == (shape.inserted, shape.removed)
    assert raised == 0 and good == RUNS, f"{name}: {RUNS - good} of {RUNS} optimized runs wrong"


@pytest.mark.parametrize("fetch_known, inserted", [(True, 1), (False, 3)])
def test_safety_pass_alone_gives_the_meaning(fetch_known, inserted):
    """Without copy removal the safety pass copies what the loop writes and something else sees:
    told what is fetched, only a (read after the loop); else i, a and b (any may be fetched)."""
    shape = SHAPES["slot_a_read_after_loop"]
    main, startup, fetch = shape.build()
    result = graph_opt.optimize_program(main, ["protect_inplace_writes"], fetch_list=fetch if fetch_known else None)
    assert result == {"copies_inserted": inserted, "reads_rewired": 0, "copies_removed": 0}
    exe = paddle.static.Executor(paddle.CPUPlace())
    rng = np.random.default_rng(3)
    with paddle.static.scope_guard(paddle.static.Scope()):
        for _ in range(RUNS):
            feed = _feed(rng, shape.feeds)
            assert _matches(exe.run(main, feed=dict(feed), fetch_list=fetch), shape.meaning(feed))


def test_the_shapes_cover_the_cases_the_passes_must_tell_apart():
    assert len(SHAPES) >= 10
    assert {s.removed for s in SHAPES.values()} >= {0, 2, 3}
    assert {s.inserted for s in SHAPES.values()} >= {0, 1}
