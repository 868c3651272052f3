"""Tests for graph_opt.backends.paddle.passes (remove_loop_carried_copies) on CPU, static mode (PIR)."""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from graph_opt.backends.paddle import passes  # noqa: E402

COPY = '"pd_op.assign_out_"'
N = 8  # elements per state tensor: small and fast


@pytest.fixture(scope="module", autouse=True)
def static_mode():
    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    yield
    if was_dynamic:
        paddle.disable_static()


def _feed(seed=0, names=("c", "h")):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(N).astype("float32") for name in names}


def _build(body_fn, init_fn, iters=5):
    """One while loop over a counter i and the state from init_fn(); returns (main, startup, fetch)."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        n = paddle.full([1], iters, "int64")
        state, extra = init_fn()

        def cond(i, *rest):
            return i < n

        out = paddle.static.nn.while_loop(cond, body_fn, [paddle.full([1], 0, "int64"), *state])
        fetch = list(out) + [f(out) for f in extra]
    return main, startup, fetch


def _run(main, startup, fetch, feed, serial=False):
    """Run in a fresh scope; serial picks the executor's serial mode over its thread pool."""
    fed = {k: v.copy() for k, v in feed.items()}
    old = paddle.get_flags(["FLAGS_new_executor_serial_run"])
    paddle.set_flags({"FLAGS_new_executor_serial_run": serial})
    try:
        exe = paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(paddle.static.Scope()):
            exe.run(startup)
            out = exe.run(main, feed=feed, fetch_list=fetch)
    finally:
        paddle.set_flags(old)
    assert all(np.array_equal(feed[k], fed[k]) for k in feed), "the run wrote into a feed array"
    return out


def _check(make, feed, removed, seeds=(0, 1), semantics="static"):
    """Build the program twice; give both the safety pass, and one also the copy removal.

    The safety pass alone gives the program's meaning (test_pass_stress shows it under load), so
    it is the reference. Check the count, the text and bit-identical outputs. Static programs run
    on the multi-threaded executor and the serial one; eager ones (program order is their meaning,
    and run_program traces it) on the serial one.
    """
    ref = make()
    opt = make()
    with paddle.pir.core.program_guard(ref[0]):
        passes.protect_inplace_writes(ref[0], semantics)
    before = str(opt[0]).count(COPY)
    result = passes.run_passes(opt[0], ["protect_inplace_writes", "remove_loop_carried_copies"], semantics)
    assert result.copies_removed == removed
    assert str(opt[0]).count(COPY) == before - removed + result.copies_inserted  # safety copies use it too
    for seed in seeds:
        f = _feed(seed, tuple(feed))
        for run_serially in (True, False) if semantics == "static" else (True,):
            want = _run(*ref, f, serial=run_serially)
            got = _run(*opt, f, serial=run_serially)
            assert len(want) == len(got)
            for a, b in zip(want, got):
                assert a.dtype == b.dtype and np.array_equal(a, b)
    return opt[0]


def _data(*names):
    return [paddle.static.data(name, [N], "float32") for name in names]


# --- safe patterns -------------------------------------------------------------------------------


def _brief_body(i, c, h):
    return [
        paddle.assign(i + 1, output=i),
        paddle.assign(c * 1.0001 + 0.5, output=c),
        paddle.assign(paddle.tanh(h), output=h),
    ]


def _loops(program):
    found = []

    def walk(block):
        for op in block.ops:
            if op.name() == "pd_op.while":
                found.append(op)
            for sub in op.blocks():
                walk(sub)

    walk(program.global_block())
    return found


def _copies_in(loop):
    """Slots (block-argument indices) whose copy is still in loop's body."""
    body = list(loop.blocks())[0]
    args = [a.id for a in body.args()]
    dsts = [op.operand_source(1).id for op in body.ops if op.name() == "pd_op.assign_out_"]
    return [args.index(d) if d in args else -1 for d in dsts]  # -1: not a block argument


def _yield_producers(loop):
    body = list(loop.blocks())[0]
    return [v.get_defining_op().name() for v in body.ops[-1].operands_source()]


def test_brief_pattern_all_three_copies_removed():
    prog = _check(lambda: _build(_brief_body, lambda: (_data("c", "h"), [])), ["c", "h"], removed=3)
    assert COPY not in str(prog)
    (loop,) = _loops(prog)
    # cf.yield(cond, i, c, h) now carries the computed values; the condition reads i + 1 directly.
    assert _yield_producers(loop) == ["pd_op.less_than", "pd_op.scale", "pd_op.scale", "pd_op.tanh"]
    cond_op = list(loop.blocks())[0].ops[-1].operand_source(0).get_defining_op()
    assert cond_op.operand_source(0).get_defining_op().name() == "pd_op.scale"


def test_pass_is_idempotent_and_counts_per_program():
    main, _, _ = _build(_brief_body, lambda: (_data("c", "h"), []))
    assert passes.remove_loop_carried_copies(main).copies_removed == 3
    assert passes.remove_loop_carried_copies(main).copies_removed == 0


def test_constant_source_and_matmul_source():
    # matmul reads h while producing the new h: it must never be given h's buffer as output.
    weights = {}

    def init():
        weights["w"] = paddle.assign(np.linspace(-1, 1, N * N).astype("float32").reshape(N, N) / N)
        return _data("c", "h"), []

    def body(i, c, h):
        return [
            paddle.assign(i + 1, output=i),
            paddle.assign(paddle.full([N], 3.0, "float32") + c, output=c),
            paddle.assign(paddle.matmul(h.reshape([1, N]), weights["w"]).reshape([N]), output=h),
        ]

    _check(lambda: _build(body, init), ["c", "h"], removed=3)


def test_two_loops_in_sequence():
    def make():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            (c,) = _data("c")
            n = paddle.full([1], 4, "int64")
            cond = lambda i, x: i < n  # noqa: E731

            def body(i, x):
                return [paddle.assign(i + 1, output=i), paddle.assign(x * 0.5 + 1, output=x)]

            _, x1 = paddle.static.nn.while_loop(cond, body, [paddle.full([1], 0, "int64"), c * 2.0])
            out = paddle.static.nn.while_loop(cond, body, [paddle.full([1], 0, "int64"), x1 + 1.0])
        return main, startup, list(out) + [x1]

    _check(make, ["c"], removed=4)


# --- unsafe patterns: outputs unchanged, copy kept -----------------------------------------------


def test_slot_read_after_copy_is_kept():
    # `s + c` runs after c's copy, so it reads the new c through the alias; only i and s go.
    def body(i, c, s):
        new_c = paddle.assign(c * 2.0 + 1.0, output=c)
        s2 = s + c
        return [paddle.assign(i + 1, output=i), new_c, paddle.assign(s2, output=s)]

    prog = _check(lambda: _build(body, lambda: (_data("c", "h"), [])), ["c", "h"], removed=2)
    assert _copies_in(_loops(prog)[0]) == [1]


@pytest.mark.parametrize("semantics, removed, kept", [("static", 3, []), ("eager", 3, [])])
def test_outer_value_read_after_loop(semantics, removed, kept):
    # The loop's first block argument shares the operand's buffer, so c's copy writes into c.
    # Eager: exp(c) after the loop is meant to see that; the safety pass has it read the loop's
    # result (the same buffer), and then c's copy can go. Static: exp(c) means the value that
    # fed the loop, and dropping the copy gives exactly that. c and h are loop-local (c * 1.0).
    def init():
        c, h = _data("c", "h")
        c, h = c * 1.0, h * 1.0
        return [c, h], [lambda out: paddle.exp(c)]

    prog = _check(lambda: _build(_brief_body, init), ["c", "h"], removed=removed, semantics=semantics)
    assert _copies_in(_loops(prog)[0]) == kept


@pytest.mark.parametrize("semantics, removed, kept", [("static", 3, []), ("eager", 2, [1])])
def test_outer_value_read_inside_body(semantics, removed, kept):
    # The body reads the operand c itself while its argument, sharing c's buffer, is written.
    # Eager: later iterations are meant to see those writes, so c's copy stays; static: the
    # safety pass gives the loop its own copy of c, and c's loop copy goes.
    def init():
        c, h = _data("c", "h")
        c, h = c * 1.0, h * 1.0
        init.c = c
        return [c, h], []

    def body(i, c, h):
        return [
            paddle.assign(i + 1, output=i),
            paddle.assign(c * 0.5 + init.c, output=c),
            paddle.assign(paddle.tanh(h), output=h),
        ]

    prog = _check(lambda: _build(body, init), ["c", "h"], removed=removed, semantics=semantics)
    assert _copies_in(_loops(prog)[0]) == kept


def test_inplace_state_without_block_args_is_untouched():
    def body(i, c):
        paddle.assign(i + 1, output=i)
        paddle.assign(c * 2.0, output=c)
        return [i, c]

    def make():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            (c,) = _data("c")
            i = paddle.full([1], 0, "int64")
            n = paddle.full([1], 3, "int64")
            out = paddle.static.nn.while_loop(lambda i, c: i < n, body, [i, c])
        return main, startup, list(out)

    main = make()[0]
    (loop,) = _loops(main)
    assert len(list(loop.blocks())[0].args()) == 0 and loop.num_results() == 0
    before = str(main)
    assert passes.remove_loop_carried_copies(main).copies_removed == 0
    assert str(main) == before and before.count(COPY) == 2
    _check(make, ["c"], removed=0)


@pytest.mark.parametrize("semantics, removed, kept", [("static", 3, []), ("eager", 2, [2])])
def test_persistable_outer_value(semantics, removed, kept):
    # Paddle 3.3.1 frees a persistable operand's buffer once the loop has taken it, so the safety
    # pass always gives the loop a copy of it, and p's loop copy then goes. Eager keeps h's: h is
    # fed, and a fed tensor is the caller's under run_program.
    def init():
        const = paddle.nn.initializer.Constant(0.25)
        p = paddle.create_parameter([N], "float32", default_initializer=const)
        (h,) = _data("h")
        return [p, h], []

    def body(i, p, h):
        return [
            paddle.assign(i + 1, output=i),
            paddle.assign(p * 1.5, output=p),
            paddle.assign(paddle.tanh(h), output=h),
        ]

    prog = _check(lambda: _build(body, init), ["h"], removed=removed, semantics=semantics)
    assert _copies_in(_loops(prog)[0]) == kept


def test_source_written_in_place_after_copy_is_kept():
    def body(i, c, h):
        new_c = c * 2.0
        r = paddle.assign(new_c, output=c)
        paddle.assign(paddle.full([N], 7.0, "float32"), output=new_c)  # overwrites the source
        return [paddle.assign(i + 1, output=i), r, paddle.assign(paddle.tanh(h), output=h)]

    prog = _check(lambda: _build(body, lambda: (_data("c", "h"), [])), ["c", "h"], removed=2)
    assert _copies_in(_loops(prog)[0]) == [1, -1]


def test_source_that_is_another_block_argument_is_kept():
    # a <- b copies another argument; b <- a * 2 then reads a after a's copy. Only i and b go.
    def body(i, a, b):
        new_a = paddle.assign(b, output=a)
        return [paddle.assign(i + 1, output=i), new_a, paddle.assign(a * 2.0, output=b)]

    prog = _check(lambda: _build(body, lambda: (_data("c", "h"), [])), ["c", "h"], removed=2)
    assert _copies_in(_loops(prog)[0]) == [1]


# --- nested loops --------------------------------------------------------------------------------


def _nested(variant):
    def make():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            (c0,) = _data("c")
            n = paddle.full([1], 3, "int64")

            def body(i, c, s):
                m = paddle.full([1], 4, "int64")

                def ibody(j, c2):
                    return [paddle.assign(j + 1, output=j), paddle.assign(c2 * 0.75 + 0.5, output=c2)]

                j0 = paddle.full([1], 0, "int64")
                _, c3 = paddle.static.nn.while_loop(lambda j, c2: j < m, ibody, [j0, c])
                if variant == "read_outer_arg":
                    s2 = s + c  # reads the inner loop's operand after the inner loop
                    new_c = paddle.assign(c3 + 1.0, output=c)
                elif variant == "read_inner_result_after_copy":
                    new_c = paddle.assign(c3 + 1.0, output=c)
                    s2 = s + c3  # c3 shares c's buffer, which the outer copy has just written
                else:
                    s2 = s + c3
                    new_c = paddle.assign(c3 + 1.0, output=c)
                return [paddle.assign(i + 1, output=i), new_c, paddle.assign(s2, output=s)]

            init = [paddle.full([1], 0, "int64"), c0, paddle.zeros([N], "float32")]
            out = paddle.static.nn.while_loop(lambda i, c, s: i < n, body, init)
        return main, startup, list(out)

    return make


def test_nested_loops_inner_and_outer_copies_removed():
    # inner: j and c2; outer: i, c and s.
    prog = _check(_nested("plain"), ["c"], removed=5)
    outer, inner = _loops(prog)
    assert _copies_in(outer) == [] and _copies_in(inner) == []


@pytest.mark.parametrize("semantics, removed", [("static", 5), ("eager", 3)])
def test_nested_outer_argument_read_after_inner_loop(semantics, removed):
    # `s + c` reads the inner loop's operand after the inner loop, whose copy writes that buffer
    # (the unmodified program races under the multi-threaded executor). Eager: that write is
    # meant; `s + c` is rewired to the inner result and c2's copy stays, and so does the outer
    # c's (its operand is fed: the caller's tensor). Static: `s + c` means the old c; all go.
    prog = _check(_nested("read_outer_arg"), ["c"], removed=removed, semantics=semantics)
    outer, inner = _loops(prog)
    kept = [] if semantics == "static" else [1]
    assert _copies_in(outer) == kept and _copies_in(inner) == kept


@pytest.mark.parametrize("semantics, removed", [("static", 5), ("eager", 3)])
def test_nested_inner_result_read_after_outer_copy(semantics, removed):
    # c3 shares c's buffer, which the outer copy writes before `s + c3` reads it. Eager: that is
    # meant, and both c copies stay. Static: `s + c3` means the inner loop's value; the inner
    # loop gets its own copy of c, both c copies go, and then the inner one is not needed.
    prog = _check(_nested("read_inner_result_after_copy"), ["c"], removed=removed, semantics=semantics)
    outer, inner = _loops(prog)
    kept = [] if semantics == "static" else [1]
    assert _copies_in(outer) == kept and _copies_in(inner) == kept


# --- guards and the pass registry ----------------------------------------------------------------


def test_no_rewrite_when_garbage_collection_is_off():
    main = _build(_brief_body, lambda: (_data("c", "h"), []))[0]
    old = paddle.get_flags(["FLAGS_eager_delete_tensor_gb"])
    paddle.set_flags({"FLAGS_eager_delete_tensor_gb": -1.0})
    try:
        assert passes.remove_loop_carried_copies(main).copies_removed == 0
    finally:
        paddle.set_flags(old)
    assert passes.remove_loop_carried_copies(main).copies_removed == 3


def test_rejects_a_non_pir_program():
    with pytest.raises(TypeError, match="PIR program"):
        passes.remove_loop_carried_copies(object())


def test_program_without_loops():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        (c,) = _data("c")
        paddle.assign(c * 2.0, output=paddle.zeros([N], "float32"))
    assert passes.remove_loop_carried_copies(main).copies_removed == 0


def test_run_passes_and_registry():
    assert set(passes.PROGRAM_PASSES) == {"protect_inplace_writes", "remove_loop_carried_copies"}
    main = _build(_brief_body, lambda: (_data("c", "h"), []))[0]
    assert passes.run_passes(main, ["remove_loop_carried_copies"]).as_dict() == {
        "copies_inserted": 0, "reads_rewired": 0, "copies_removed": 3}
    assert passes.run_passes(main, []).as_dict() == {"copies_inserted": 0, "reads_rewired": 0, "copies_removed": 0}
    with pytest.raises(ValueError, match="no_such_pass.*remove_loop_carried_copies"):
        passes.run_passes(main, ["remove_loop_carried_copies", "no_such_pass"])
    with pytest.raises(ValueError, match="semantics='lazy'.*static, eager"):
        passes.run_passes(main, [], semantics="lazy")


@pytest.mark.parametrize("names", [["protect_inplace_writes"], ["protect_inplace_writes", "remove_loop_carried_copies"]],
                         ids=["safety pass", "both passes"])
def test_one_tensor_passed_as_two_loop_operands_gets_a_buffer_per_slot(names):
    """while_loop(cond, body, [i, a, a]): both slots start as a's buffer. As built, the body's write of
    one slot was the other's too (both results equal, every run); the passes raised a bare KeyError."""
    def make():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            (a,) = _data("c")
            n = paddle.full([1], 5, "int64")

            def body(i, x, y):
                return [paddle.assign(i + 1, output=i), paddle.assign(x * 2.0, output=x),
                        paddle.assign(y + 1.0, output=y)]

            out = paddle.static.nn.while_loop(lambda i, x, y: i < n, body, [paddle.full([1], 0, "int64"), a, a])
        return main, startup, list(out)

    main, startup, fetch = make()
    passes.run_passes(main, names, "static")
    for seed in (0, 1):
        feed = _feed(seed, ("c",))
        for serial in (True, False):
            _, x, y = _run(main, startup, fetch, feed, serial=serial)
            want_x, want_y = feed["c"].copy(), feed["c"].copy()
            for _ in range(5):  # as the loop rounds, step by step in float32
                want_x, want_y = want_x * np.float32(2.0), want_y + np.float32(1.0)
            np.testing.assert_array_equal(x, want_x)
            np.testing.assert_array_equal(y, want_y)
