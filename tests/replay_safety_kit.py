"""Inference replays never give a silently wrong answer: one test per case of ordinary usage that
once replayed a stale or cut graph. Written once and run per framework: a test module imports these
tests and defines the fixture `F`, a framework shim (tests/torch_tests/test_torch_replay_safety.py, tests/paddle_tests/test_replay_safety.py and, with
real CUDA graphs, tests/gpu/test_gpu_replay_safety.py). Graphs are simulated on CPU: F.graphs().

Every test compares with an undecorated twin holding the same weights, and asserts the way the
plugin answered: a replay (bitwise eager on the same padded rows), a call without graphs with one
warning naming what changed, or a clear error.
"""
from __future__ import annotations

import copy
import dataclasses
import logging

import pytest

import graph_opt
from graph_opt.decorator import state_of

SIZES = [2, 4, 8]
HIDDEN = 8


def pair(F, cls, level=0, full=True, sizes=SIZES, dims=None, config=None, **options):
    """(decorated model, undecorated twin with the same weights)."""
    F.seed(0)
    decorated = graph_opt.support_graph_optimization(type(cls.__name__, (cls,), {}), dynamic_arg_dims=dims, **options)
    settings = dict(graph_opt_level=level, cudagraph_capture_sizes=sizes, full_cuda_graph=full)
    settings.update(config or {})
    model = F.place(decorated(graph_opt_config=graph_opt.GraphOptConfig(**settings)))
    twin = F.place(cls())
    F.copy_weights(twin, model)
    return model, twin


def same(F, level, a, b):
    """A replay's output against eager's: bitwise at levels 0 and 1 (the same kernels on the same
    padded rows, real rows cut), within 1e-5 at level 2 (Inductor fuses kernels)."""
    return F.equal(a, b) if level < 2 else F.close(a, b)


def eager_padded(F, model, *args, sizes=SIZES, batch=(0,), pads=None, **kwargs):
    """What a replay of this call equals bitwise: `model` on the batch arguments (`batch`: positions or
    keyword names) padded with rows of their pad value (`pads`: position or name -> value, else 0) up to
    the captured size the call replays, its tensor outputs cut to the real rows. Eager on the real rows
    alone may round otherwise (BLAS blocks a product of 3 rows otherwise than one of 4)."""
    pads = pads or {}
    first = batch[0]
    real = F.shape(args[first] if isinstance(first, int) else kwargs[first])[0]
    padded = min(s for s in sizes if s >= real)

    def pad(key, a):
        return F.pad_rows(a, padded, pads.get(key, 0)) if key in batch and a is not None else a

    out = model(*[pad(i, a) for i, a in enumerate(args)], **{k: pad(k, a) for k, a in kwargs.items()})

    def cut(out):
        if isinstance(out, dict):
            return type(out)((k, cut(v)) for k, v in out.items())
        if isinstance(out, (tuple, list)):
            return type(out)(cut(v) for v in out)
        shape = F.shape(out) if hasattr(out, "shape") else []
        return F.rows(out, 0, real) if shape and shape[0] == padded else out

    return cut(out)


def capture(F, model, make_inputs, **kw):
    with F.graphs():
        report = graph_opt.capture_model(model, make_inputs, progress=False, **kw)
    assert report.failed is None, report.failed
    return report


def warned(caplog, *fragments):
    msgs = [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]
    return [m for m in msgs if all(f in m for f in fragments)]


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.WARNING, logger="graph_opt")
    return caplog


# -- 1. Python state the forward reads ------------------------------------------------------------------
@pytest.fixture
def M(F):
    return F.models()


def test_a_changed_attribute_runs_without_graphs_with_one_warning_then_replays_again(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
        m.temperature = twin.temperature = 4.0
        for _ in range(2):
            assert F.close(m(x), twin(x)), "a replay ignored the new temperature"
        s = graph_opt.stats(m)
        assert s.fallbacks == 2 and sum(s.fallback_reasons.values()) == 2
        assert len(warned(logs, "temperature")) == 1
        m.temperature = twin.temperature = 1.0  # back to the captured value: replays resume
        replays = graph_opt.stats(m).replays
        assert same(F, level, m(x), eager_padded(F, twin, x))
        assert graph_opt.stats(m).replays == replays + 1


def test_a_parameter_set_to_none_after_capture_is_never_replayed_until_put_back(F, M, level, logs):
    """`lin.bias = None` goes through no registration hook of torch's, and keeps the name registered in
    Paddle: the graphs would add the old bias. Put back, the very tensor the graphs read replays again."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    bias, twin_bias = m.lin.bias, twin.lin.bias
    m.lin.bias = None
    twin.lin.bias = None
    x = F.randn(4, HIDDEN, seed=1)
    with F.no_grad():
        assert F.close(m(x), twin(x))
        assert F.close(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"replaced": 2}, s
    assert len(warned(logs, "lin.bias")) == 1
    m.lin.bias = bias
    twin.lin.bias = twin_bias
    with F.no_grad():
        assert same(F, level, m(x), twin(x))
    assert graph_opt.stats(m).replays == 1


def test_without_the_frameworks_guards_every_level_still_sees_the_models_attributes(F, M, level, logs):
    """guarded_replays: false skips Dynamo's / SOT's guards; the model's own attributes stay watched, as at level 0."""
    m, twin = pair(F, M.Scaled, level, config={"guarded_replays": False})
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
        m.temperature = twin.temperature = 4.0
        assert F.close(m(x), twin(x)), "a replay ignored the new temperature"
        assert graph_opt.stats(m).replays == 1 and len(warned(logs, "temperature")) == 1
        m.temperature = twin.temperature = 1.0
        assert same(F, level, m(x), eager_padded(F, twin, x)) and graph_opt.stats(m).replays == 2


def test_a_submodule_attribute_set_after_capture_runs_without_graphs_then_replays_again_at_level_0(F, M, logs):
    """`model.head.scale = 2.0` (a dropout schedule's `drop.p`): level-0 graphs bake what the forward read
    of a submodule as of the model; the attribute's set is counted, and the replay looks only then."""
    m, twin = pair(F, M.ScaledHead, 0)
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


@pytest.mark.parametrize("level", [0, 1], ids=["level0", "level1"])
def test_a_parameter_s_data_assigned_after_capture_is_never_replayed_stale(F, M, level, logs):
    """`p.data = t` keeps the parameter and moves it onto other memory: the graphs would read the old
    memory. Counted as a conversion; the calls run without graphs until clear_graphs() and a capture."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
        m.lin.weight.data = F.randn(HIDDEN, HIDDEN, seed=5)
        twin.lin.weight.data = F.randn(HIDDEN, HIDDEN, seed=5)
        for _ in range(2):
            assert F.close(m(x), twin(x)), "a replay read the parameter's old memory"
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallback_reasons == {"converted": 2}, s
    assert len(warned(logs, ".data assigned")) == 1
    graph_opt.clear_graphs(m)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
    assert graph_opt.stats(m).replays >= 1


def test_a_changed_global_is_guarded_at_level_1(F, M, logs):
    """Level 0 cannot see a global (README, "What a replay assumes"); level >= 1 guards it."""
    m, twin = pair(F, M.ScaledByGlobal, 1)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(4, HIDDEN, seed=1)
    try:
        with F.no_grad():
            F.set_global_scale(3.0)
            assert F.close(m(x), twin(x)), "a replay ignored the changed global"
            assert graph_opt.stats(m).replays == 0
            assert warned(logs, "GLOBAL_SCALE")
            F.set_global_scale(1.0)
            assert F.equal(m(x), twin(x)) and graph_opt.stats(m).replays == 1
    finally:
        F.set_global_scale(1.0)


def test_a_forward_with_a_closure_replays_and_its_changed_variable_is_guarded_above_level_0(F, M, level, logs):
    """The guards before a replay read the forward's frame: its closure variables (super()'s __class__,
    a variable of the function that made the class) are part of it."""
    m, twin = pair(F, M.ScaledByClosure, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    try:
        with F.no_grad():
            assert same(F, level, m(x), eager_padded(F, twin, x)) and graph_opt.stats(m).replays == 1
            if level >= 1:  # level 0 bakes the value (docs/calls-and-captures.md, "What a replay assumes")
                F.set_closure_scale(3)
                assert F.close(m(x), twin(x)), "a replay ignored the changed closure variable"
                assert graph_opt.stats(m).replays == 1 and warned(logs, "scale")
                F.set_closure_scale(1)
                assert same(F, level, m(x), eager_padded(F, twin, x)) and graph_opt.stats(m).replays == 2
    finally:
        F.set_closure_scale(1)


def test_a_parameter_set_where_there_was_none_is_seen(F, M, level, logs):
    m, twin = pair(F, M.OptionalBias, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
        m.extra = F.parameter([HIDDEN], 0.5)
        twin.extra = F.parameter([HIDDEN], 0.5)
        assert F.close(m(x), twin(x)), "a replay ignored the new parameter"
    assert warned(logs, "extra")


def test_no_level_replays_a_graph_captured_in_the_other_training_mode(F, M, level, logs):
    m, twin = pair(F, M.ModeSwitch, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        for train in (True, False):
            for model in (m, twin):
                model.train() if train else model.eval()
            assert same(F, level, m(x), twin(x)) if not train else F.close(m(x), twin(x))
        twin.train()
        m.train()
        m.inner.eval()  # one submodule alone
        twin.inner.eval()
        assert F.close(m(x), twin(x))
    s = graph_opt.stats(m)
    assert s.fallback_reasons.get("training", 0) >= 1
    assert warned(logs, "training mode")


# -- 3 and 4. Outputs cut on the right dimension, non-tensor outputs ----------------------------------------
def test_outputs_are_cut_on_their_learned_batch_dimension(F, M, level):
    m, twin = pair(F, M.BatchInDim1, level, dims={"x": 1})
    capture(F, m, lambda n: F.randn(6, n, seed=n))
    with F.no_grad():
        for real in (2, 3, 5, 8):
            x = F.randn(6, real, seed=real)
            out, ref = m(x), twin(x)
            assert F.shape(out["y"]) == [6, real]
            assert F.shape(out["w"]) == [8, 8], "a weight returned at batch 8 is not batch-major"
            assert F.close(out["y"], ref["y"]) and F.equal(out["w"], ref["w"])
    assert graph_opt.stats(m).replays == 4


def test_a_non_tensor_output_that_changes_with_the_batch_is_never_replayed_cut(F, M, level, logs):
    m, twin = pair(F, M.CountsRows, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        out = m(F.randn(3, HIDDEN, seed=3))
        assert out["n_rows"] == 3
        out = m(F.randn(4, HIDDEN, seed=4))
        assert out["n_rows"] == 4 and F.close(out["y"], twin(F.randn(4, HIDDEN, seed=4))["y"])
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallback_reasons == {"outputs": 1}
    assert warned(logs, "output['n_rows']")


# -- 5. Non-tensor arguments keyed on type and value --------------------------------------------------------
def test_non_tensor_arguments_are_keyed_on_type_and_value(F, M, level):
    m, twin = pair(F, M.Scales, level)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), 1, 1.0))
    x = F.randn(4, HIDDEN, seed=1)
    with F.no_grad():
        for scale, shift in ((1, 1.0), (1.0, 1.0), (True, 1.0), (1, -0.0), (1, 0.0), (1, float("nan"))):
            if level == 2 and F.inductor_drops_the_sign_of_zero and str(shift) == "-0.0":
                continue  # torch.compile itself answers 1/(x * -0.0) with +inf there (CUDA, torch 2.11)
            out, ref = m(x, scale, shift), twin(x, scale, shift)
            assert F.dtype_name(out["scaled"]) == F.dtype_name(ref["scaled"]), f"scale={scale!r}"
            assert F.equal(out["scaled"], ref["scaled"]), f"scale={scale!r}"
            # Inductor (level 2) may compute the reciprocal in another rounding: the key is what is tested
            assert F.same_with_nan(out["inverse"], ref["inverse"], exact=level != 2), f"shift={shift!r}"


# -- 7. Hooks on the decorated model ----------------------------------------------------------------------
def test_hooks_on_the_decorated_model_run_at_every_call(F, M, level, graphs):
    m, twin = pair(F, M.Scaled, level, config={"use_cudagraph": graphs})
    if graphs:
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    seen = []
    for model in (m, twin):
        F.pre_hook(model, lambda args: seen.append(1) or (F.scale(args[0], 2.0),))
        F.post_hook(model, lambda out: F.scale(out, 3.0))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        for _ in range(3):
            assert F.close(m(x), twin(x))
    assert len(seen) == 6  # three calls of each
    if graphs:
        assert graph_opt.stats(m).replays == 3


def test_a_parameter_replaced_on_a_submodule_after_capture_is_never_replayed_stale(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        for model in (m, twin):
            F.replace_weight(model.lin, 0.25)  # a new Parameter object on a submodule
        assert F.close(m(x), twin(x)), "a replay read the replaced parameter's old data"
    assert graph_opt.stats(m).fallbacks == 1  # copying into the captured parameter would change it
    assert warned(logs, "Scaled.lin.weight was replaced by a new object")


def test_parameters_converted_after_capture_are_never_replayed_stale(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for model in (m, twin):
            F.to_double(model)  # the same Parameter objects, other data
        x = F.to_double(F.randn(3, HIDDEN, seed=1))
        assert F.close(m(x), twin(x)), "a replay read the converted parameters' old data"
    assert graph_opt.stats(m).fallback_reasons == {"converted": 1}
    assert warned(logs, "converted since capture")


def test_hooks_registered_or_removed_on_a_submodule_after_capture_are_never_skipped(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    handles = [F.post_hook(model.lin, lambda out: F.scale(out, 3.0)) for model in (m, twin)]
    with F.no_grad():
        assert F.close(m(x), twin(x)), "a replay skipped the submodule's hook"
        for handle in handles:
            handle.remove()
        assert same(F, level, m(x), eager_padded(F, twin, x))
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallbacks == 1


def test_hooks_the_forward_registers_while_captured_are_expected_by_the_replays(F, M, logs):
    """Level 0 (a traced level cannot trace the registration: its capture fails, one warning)."""
    level = 0
    m, twin = pair(F, M.InstallsHook, level)
    with F.no_grad():
        twin(F.randn(2, HIDDEN, seed=0))  # its own first call registers its hook too
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (3, 8, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert same(F, level, m(x), eager_padded(F, twin, x)), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.replays == 3 and not s.fallback_reasons


def test_requires_grad_changed_after_capture_does_not_stop_replays(F, M, level):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    for p in F.parameters(m):
        F.freeze(p)
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        assert same(F, level, m(x), eager_padded(F, twin, x))
    assert graph_opt.stats(m).replays == 1


# -- 8. In-place writes to inputs ---------------------------------------------------------------------------
def _calls_write_the_callers_tensor(F, m, twin):
    """Calls of a captured size, a padded one and the largest: outputs and the caller's written x as eager's."""
    with F.no_grad():
        for real in (4, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            x_twin = F.clone(x)
            assert F.close(m(x), twin(x_twin))
            assert F.equal(x, x_twin), "the caller's tensor did not see the forward's in-place write"


def test_a_forward_that_writes_its_input_writes_the_callers_tensor(F, M, level, logs):
    m, twin = pair(F, M.WritesInput, level)
    if level >= 1 and not F.static_writes_inputs:
        # Paddle's SOT programs do not write their inputs back ("not support input out tensor"): the
        # capture says so and the model runs eagerly, right.
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert "writes its argument 'x' in place" in report.failed
        assert len(warned(logs, "writes its argument 'x' in place", "graph_opt_level=0")) == 1
        x, x_twin = F.randn(3, HIDDEN, seed=3), F.randn(3, HIDDEN, seed=3)
        with F.no_grad():
            assert F.close(m(x), twin(x_twin)) and F.equal(x, x_twin)
        return
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_write_the_callers_tensor(F, m, twin)
    assert graph_opt.stats(m).replays == 3


def test_a_write_its_version_counter_does_not_show_reaches_the_callers_tensor(F, M, level):
    """Paddle's copy_ and set_value, torch's .data: the capture finds the write by the values it changed."""
    m, twin = pair(F, M.WritesUntracked, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_write_the_callers_tensor(F, m, twin)


def test_an_in_place_op_on_an_intermediate_tensor_is_computed_as_eager(F, M, level, logs):
    """Paddle's SOT drops it: the padded call's check finds the captured size itself wrong, and the
    capture fails (the model runs its plain forward) rather than replay it."""
    m, twin = pair(F, M.AddsInPlace, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    sot = level >= 1 and not F.static_writes_inputs
    if sot:
        assert "in-place op on an intermediate tensor" in report.failed, report.failed
        assert len(warned(logs, "gave other values than the plain forward on the same")) == 1
    else:
        assert report.failed is None, report.failed
    with F.no_grad():
        for real in (4, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            assert same(F, level, m(x), twin(x) if sot else eager_padded(F, twin, x)), f"{real} rows"
    assert graph_opt.stats(m).replays == (0 if sot else 3)


def test_nan_capture_inputs_are_not_taken_for_a_write(F, M, level, monkeypatch):
    """A write is also found by the values a warmup changed: NaN compares equal to NaN there."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n) * float("nan"))
    with F.no_grad():
        for seed in (1, 2):  # the full path replays once and keeps its plan: x is not written back
            x = F.randn(4, HIDDEN, seed=seed)
            assert same(F, level, m(x), twin(x))
        _shortcut_taken(m, monkeypatch)
        x = F.randn(4, HIDDEN, seed=3)
        assert same(F, level, m(x), twin(x))
    assert graph_opt.stats(m).replays == 3


def test_the_same_tensor_passed_twice_and_written_runs_without_graphs(F, M, level):
    m, twin = pair(F, M.WritesFirst, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (test above)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    x = F.randn(3, HIDDEN, seed=1)
    x_twin = F.clone(x)
    with F.no_grad():
        assert F.close(m(x, x), twin(x_twin, x_twin)), "two arguments sharing memory got separate buffers"
        assert F.equal(x, x_twin)
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 1}


def test_arguments_overlapping_from_another_first_row_and_written_run_without_graphs(F, M, level):
    m, twin = pair(F, M.WritesFirst, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (above)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    base = F.randn(5, HIDDEN, seed=1)
    base_twin = F.clone(base)
    with F.no_grad():  # b starts one row after a: their first addresses differ, their rows overlap
        assert F.close(m(F.rows(base, 0, 4), F.rows(base, 1, 5)), twin(F.rows(base_twin, 0, 4), F.rows(base_twin, 1, 5)))
        assert F.equal(base, base_twin)
        assert F.close(m(F.rows(base, 1, 5), F.rows(base, 0, 4)), twin(F.rows(base_twin, 1, 5), F.rows(base_twin, 0, 4)))
        assert F.equal(base, base_twin)
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 2}


def test_an_output_fed_back_into_a_forward_that_writes_its_argument_runs_without_graphs(F, M, level):
    """The argument is the last replay's output: the replay writes the new output there, so writing the
    argument back after it would overwrite the output (and the argument would not hold eager's write)."""
    m, twin = pair(F, M.WritesInput, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails (above)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        y = m(F.randn(4, HIDDEN, seed=4))
        y_twin = F.clone(y)
        for _ in range(3):  # a loop feeding each output back: every other output is the graph's
            want = twin(y_twin)
            y_next = m(y)
            assert F.close(y_next, want) and F.equal(y, y_twin), "the output or the argument's write differs"
            y, y_twin = y_next, F.clone(want)
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"aliased": 2}, s


def test_a_returned_input_fed_back_as_another_argument_is_read_before_any_copy(F, M, level):
    """x_next, x = m(x, x_prev), the returned x passed back as the next x_prev: it is a view of the graph's
    buffer for x, which copying the new x in would overwrite before x_prev is read."""
    m, twin = pair(F, M.Steps, level)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    with F.no_grad():
        for real in (4, 3):  # a captured size, a padded one
            s = (F.randn(real, HIDDEN, seed=real), F.randn(real, HIDDEN, seed=real + 9))
            t = (F.clone(s[0]), F.clone(s[1]))
            for step in range(4):
                s, t = m(*s), twin(*t)
                assert F.close(s[0], t[0]) and F.close(s[1], t[1]), f"step {step} of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.replays == 8 and stats.fallbacks == 0, stats


def test_returned_inputs_fed_back_through_shrinking_sizes_captured_at_calls(F, M, level):
    """No capture_model: each smaller size is captured at a call whose arguments are views of the last
    call's static buffers."""
    m, twin = pair(F, M.Steps, level)
    s = (F.randn(8, HIDDEN, seed=1), F.randn(8, HIDDEN, seed=2))
    t = (F.clone(s[0]), F.clone(s[1]))
    with F.graphs(), F.no_grad():
        for real in (8, 7, 5, 3, 3, 2, 1):
            s, t = m(F.rows(s[0], 0, real), F.rows(s[1], 0, real)), twin(F.rows(t[0], 0, real), F.rows(t[1], 0, real))
            assert F.close(s[0], t[0]) and F.close(s[1], t[1]), f"a call of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.lazy_captures == 3 and stats.replays == 7 and stats.fallbacks == 0, stats


def test_a_returned_input_fed_back_over_its_own_buffer_is_read_before_the_padding_is_filled(F, M, level, logs):
    """xs = m(x)[0][1:]: the padding row of the next call is xs's last row."""
    m, twin = pair(F, M.PassesThrough, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        out, _ = m(F.randn(8, HIDDEN, seed=8))
        xs = F.rows(out, 1, 8)
        want = twin(F.clone(xs))[1]
        assert F.close(m(xs)[1], want)
    stats = graph_opt.stats(m)
    assert stats.replays == 2 and stats.fallbacks == 0 and not warned(logs, "")
    assert state_of(m).runner.disabled_reason is None


def test_an_input_written_and_returned_is_the_caller_s_tensor_as_in_eager(F, M, level):
    """`h = m(h, y)` with `h.add_(...); return h`: eager returns the caller's h, updated; so does a replay,
    and the next call, given that h, replays too (the static copy fed back would be refused as aliased)."""
    m, twin = pair(F, M.AddsIntoAndReturns, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 50)))
    with F.no_grad():
        for real in (4, 3):
            h0 = F.randn(real, HIDDEN, seed=1)
            t0 = F.clone(h0)
            h, t = h0, t0
            for step in range(3):
                y = F.randn(real, HIDDEN, seed=10 + step)
                h, t = m(h, y), twin(t, y)
                assert h is h0 and t is t0 and F.close(h0, t0), f"step {step} of {real} rows"
    stats = graph_opt.stats(m)
    assert stats.replays == 6 and stats.fallbacks == 0, stats


def test_a_refused_call_has_written_nothing_when_it_runs_without_graphs(F, M, level):
    """The written argument is the last output (refused: "aliased"); the second is the last call's returned
    z, a view of the graph's buffer for z, which copying the third in would overwrite before eager reads it."""
    m, twin = pair(F, M.WritesAndPasses, level)
    if level >= 1 and not F.static_writes_inputs:
        return  # Paddle's SOT drops the write: the capture fails
    capture(F, m, lambda n: tuple(F.randn(n, HIDDEN, seed=n + k) for k in (0, 50, 90)))
    with F.no_grad():
        a, b, c = (F.randn(4, HIDDEN, seed=k) for k in (1, 2, 3))
        o, zo = m(F.clone(a), b, c)
        o_t, zo_t = twin(F.clone(a), b, c)
        z = F.randn(4, HIDDEN, seed=7)
        args, args_t = (o, zo, z), (F.clone(o_t), F.clone(zo_t), z)
        got, want = m(*args), twin(*args_t)
        assert F.close(got[0], want[0]) and F.close(got[1], want[1]) and F.equal(args[0], args_t[0])
    assert graph_opt.stats(m).fallback_reasons == {"aliased": 1}


# -- 9. Padding rows -----------------------------------------------------------------------------------------
def test_padding_rows_hold_the_pad_value_never_an_earlier_calls_rows(F, M, level):
    trash = 15  # the cache slot padding rows may write: kernels skip it, as vLLM's slot -1
    m, twin = pair(F, M.KVCache, level, sizes=[4, 8], pad_values={"pos": trash})
    if level >= 1 and not F.static_writes_inputs:  # Paddle's SOT drops the write into the buffer: named
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)), progress=False)
        assert "the model's buffer 'cache' in place" in report.failed
        return
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)))
    F.zero_buffer(m.cache)
    F.zero_buffer(twin.cache)
    with F.no_grad():
        for real, first in ((8, 0), (3, 9), (2, 12), (3, 4)):
            x, pos = F.randn(real, HIDDEN, seed=real + first), F.arange(real, start=first)
            want = eager_padded(F, twin, x, pos, sizes=[4, 8], batch=(0, 1), pads={1: trash})
            assert F.close(m(x, pos), want)
            assert F.equal(F.rows(m.cache, 0, trash), F.rows(twin.cache, 0, trash)), \
                f"cache slots differ from eager after a call of {real} rows at {first}"
    runner = state_of(m).runner
    (sig,) = runner.signatures.values()
    pos_buffer = sig.buffers[1]
    assert F.tolist(pos_buffer)[3:] == [trash] * 5, "padding rows must hold the pad value"
    assert graph_opt.stats(m).replays == 4


def test_padding_rows_are_filled_only_where_an_earlier_call_left_rows(F, M, monkeypatch):
    m, twin = pair(F, M.Scaled, 0, sizes=[4, 8])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    adapter = state_of(m).adapter
    fills = []
    real_fill = adapter.fill_rows
    monkeypatch.setattr(adapter, "fill_rows", lambda t, d, a, b, v: (fills.append((a, b)), real_fill(t, d, a, b, v)))
    with F.no_grad():
        for real in (3, 3, 3, 8, 5, 5, 2, 7):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x))
    # The capture ended with a check of size 4 for a call of 1 row (capture_checks): rows 1..3 hold the
    # pad value. 3 rows: none to fill; 5 after 8: rows 5..7; 2 after 5: rows 2..4; 7: none.
    assert fills == [(5, 8), (2, 5)]
    assert graph_opt.stats(m).replays == 8


def test_a_forward_whose_real_rows_depend_on_other_rows_replays_only_captured_sizes(F, M, level, logs):
    m, twin = pair(F, M.BatchMean, level)
    report = capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "gave other values than eager in output", "capture every batch size")
    assert any("other values than eager" in note for note in report.notes)
    with F.no_grad():
        for real in (3, 8, 5, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"outputs": 2}  # 8 and 4 replay; 3 and 5 run eagerly
    ok, _ = pair(F, M.Scaled, level)
    logs.clear()
    capture(F, ok, lambda n: F.randn(n, HIDDEN, seed=n))
    assert not warned(logs, "other values than eager")


def _calls_keep_the_buffer_as_eager(F, m, twin, name, sizes):
    """Calls of these sizes against the twin (given the buffers as the capture left them): the outputs,
    and the buffer `name` after each call."""
    F.copy_weights(twin, m)
    with F.no_grad():
        for real in sizes:
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(getattr(m, name), getattr(twin, name)), f"after a call of {real} rows"


def test_a_step_counter_the_forward_advances_replays_padded_calls_and_counts_as_eager(F, M, level, logs):
    """The check's two runs each advance the counter: compared from one state, they agree."""
    m, twin = pair(F, M.CountsSteps, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert not warned(logs, "other values than eager")
    _calls_keep_the_buffer_as_eager(F, m, twin, "steps", (3, 8, 5, 1, 4))
    s = graph_opt.stats(m)
    assert s.replays == 5 and not s.fallback_reasons


def test_sizes_captured_at_calls_advance_a_step_counter_once_per_call(F, M, level):
    """No capture_model: each new size is captured at its first call, which runs the forward several
    times (warmups, the capture, its check); the counter is put back, and the call advances it once."""
    m, twin = pair(F, M.CountsSteps, level)
    with F.graphs():
        _calls_keep_the_buffer_as_eager(F, m, twin, "steps", (4, 3, 8, 4, 2, 8))
    s = graph_opt.stats(m)
    assert s.lazy_captures == 3 and s.replays == 6 and not s.fallback_reasons


def test_sizes_captured_at_calls_advance_a_counter_held_in_an_object_once_per_call(F, M, level):
    m, twin = pair(F, M.CountsInObject, level)
    with F.graphs(), F.no_grad():
        for real in (4, 3, 8, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(m.state.steps, twin.state.steps), f"after a call of {real} rows"
    assert graph_opt.stats(m).lazy_captures == 2


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_python_value_the_forward_sets_at_every_call_is_never_replayed_stale(F, M, level, logs, at_calls):
    """`self.calls += 1; return y * self.calls`: a level-0 replay runs no Python, so it would neither count
    nor compute with the new count. Its capture fails with one warning naming the attribute, and every
    call answers as eager, the counter advanced once per call. At level >= 1 the translated code makes
    the store. Captured at a call, the capture's runs must not advance it either."""
    m, twin = pair(F, M.CountsCalls, level)
    if not at_calls:
        with F.graphs():  # at level 1 Paddle's SOT may refuse the forward: that too answers as eager
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert report.failed is not None or level >= 1
        twin.calls = m.calls
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4, 8, 2)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.close(m(x), twin(x)), f"step {step}"
            assert m.calls == twin.calls, f"step {step}: the counter"
    if level == 0:
        assert len(warned(logs, "sets Python state as it runs", "'calls'")) == 1
        assert graph_opt.stats(m).replays == 0


def test_a_python_list_the_forward_appends_to_is_never_left_behind_at_level_0(F, M, logs):
    m, twin = pair(F, M.LogsCalls, 0)
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.equal(m(x), twin(x)), f"step {step}"
            assert m.seen == twin.seen, f"step {step}: the list"
    assert warned(logs, "sets Python state as it runs", "'seen'")


def in_place_counter(kind):
    """A new count of `kind` a forward advances in place: a set, a numpy array, a bytearray, an array.array."""
    import array

    import numpy
    return {"set": set, "numpy": lambda: numpy.zeros(1), "bytearray": bytearray, "array": lambda: array.array("d")}[kind]()


def advance_in_place(counter) -> float:
    """Advance the count in place (no new binding) and return it."""
    if isinstance(counter, set):
        counter.add(len(counter))
        return float(len(counter))
    if hasattr(counter, "dtype"):  # numpy
        counter += 1
        return float(counter[0])
    counter.append(1)
    return float(len(counter))


class CountsInPlaceMixin:
    """A count kept in an object the forward changes in place (a set, a numpy array ...: `kind`). Mixed
    into each framework's Scaled (self.lin)."""

    kind = "set"

    def __init__(self):
        super().__init__()
        self.seen = in_place_counter(self.kind)

    def forward(self, x):
        return self.lin(x) * advance_in_place(self.seen)


class KeepsRowsMixin:
    """Records the rows of its last call in a Python value (not read by the math)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def forward(self, x):
        self.rows = x.shape[0]
        return self.lin(x)


@pytest.mark.parametrize("kind", ["set", "numpy", "bytearray", "array"])
@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_count_the_forward_keeps_in_a_set_or_array_changed_in_place_is_never_replayed_stale(F, M, logs, kind, at_calls):
    """No binding changes, only the value inside the object: its capture fails naming it, and every call
    answers as eager, the count advanced once per call (a capture at a call puts it back)."""
    m, twin = pair(F, type(f"Counts_{kind}", (M.CountsInPlace,), {"kind": kind}), 0)
    if not at_calls:
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert report.failed is not None and "'seen'" in report.failed
        twin.seen = copy.copy(m.seen)
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 4, 8)):
            x = F.randn(real, HIDDEN, seed=step)
            assert F.equal(m(x), twin(x)), f"step {step}"
            assert advance_in_place(copy.copy(m.seen)) == advance_in_place(copy.copy(twin.seen)), f"step {step}: the count"
    assert len(warned(logs, "sets Python state as it runs", "'seen'")) == 1
    assert graph_opt.stats(m).replays == 0


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
def test_a_python_value_the_forward_sets_per_call_is_never_left_stale(F, M, level, logs, at_calls):
    """`self.rows = x.shape[0]`: each size's capture leaves it as its warmups found it, but a replay would
    leave another call's value: a level-0 replay makes no store, and torch's translated code stores the
    padded size's. Where a second size's capture sees it change, every graph goes; where the check of
    padded calls sees a replay leave another value than eager, padded calls run without graphs."""
    m, twin = pair(F, M.KeepsRows, level)
    calls = (4, 4, 8, 3, 2, 8, 5)
    if not at_calls:
        capture_ok = level >= 1 and F.static_makes_python_stores  # torch: its translated code makes the store
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        assert (report.failed is None) == capture_ok and (capture_ok or "'rows'" in report.failed), report.failed
        calls = calls[1:]
    with F.graphs(), F.no_grad():
        for step, real in enumerate(calls):
            x = F.randn(real, HIDDEN, seed=step)
            assert same(F, level, m(x), twin(x)), f"step {step}"
            assert m.rows == twin.rows, f"step {step}: the value"
    assert warned(logs, "'rows'")


def test_a_flag_the_forward_sets_at_its_first_call_only_still_replays(F, M, level, logs):
    m, twin = pair(F, M.ReadyOnce, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    twin.ready = m.ready
    with F.graphs(), F.no_grad():
        for step, real in enumerate((4, 3, 8)):
            x = F.randn(real, HIDDEN, seed=step)
            assert same(F, level, m(x), eager_padded(F, twin, x)), f"step {step}"
    assert m.ready is True
    assert graph_opt.stats(m).replays == 3 and not warned(logs, "sets Python state")


def test_a_model_writing_more_state_than_a_call_copies_aside_is_captured_only_by_capture_model(F, M, level, logs):
    """Each of a capture's runs would advance the large buffer, and it is too large to put back."""
    m, twin = pair(F, M.HoldsLargeBuffer, level)
    with F.graphs():
        _calls_keep_the_buffer_as_eager(F, m, twin, "table", (4, 3, 4))
    assert warned(logs, "captured at a call only where", "buffer 'table'", "capture_model()")
    s = graph_opt.stats(m)
    assert s.lazy_captures == 0 and s.replays == 0 and s.fallback_reasons.get("lazy_state", 0) >= 2
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _calls_keep_the_buffer_as_eager(F, m, twin, "table", (4,))  # the buffer as the capture left it, both
    assert graph_opt.stats(m).replays == 1


def test_a_step_counter_reset_by_a_new_tensor_after_capture_is_the_one_advanced(F, M, level):
    """`m.steps = zeros` after capture_model (the natural reset): replays advance the new tensor, or run
    without graphs; never the captured one in its place."""
    m, twin = pair(F, M.AdvancesInPlace, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    m.steps = F.clone(m.steps) * 0
    twin.steps = F.clone(twin.steps) * 0
    with F.no_grad():
        for real in (4, 3, 8, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
            assert F.equal(m.steps, twin.steps), f"the counter after a call of {real} rows"


def test_a_count_of_rows_seen_replays_only_captured_sizes_and_counts_as_eager(F, M, level, logs):
    """Padding rows run through the forward: a count of rows would count them. The check compares the
    state the two runs leave, and padded calls run without graphs."""
    m, twin = pair(F, M.TalliesRows, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "buffer 'rows_seen'", "padding rows change state")
    _calls_keep_the_buffer_as_eager(F, m, twin, "rows_seen", (3, 8, 5, 1, 4))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"outputs": 3}  # 8 and 4 replay


def test_a_buffer_written_only_at_small_sizes_keeps_captured_sizes_and_counts_as_eager_at_level_0(F, M, logs):
    """A padded call of 3 rows would replay size 4, whose graph never writes the buffer."""
    m, twin = pair(F, M.CountsSmallBatches, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "buffer 'small_batches'")
    _calls_keep_the_buffer_as_eager(F, m, twin, "small_batches", (4, 8, 3, 2, 5))
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallback_reasons == {"outputs": 2}  # 4, 8 and 2 replay; 3 and 5 do not


def _state_as_eager(F, m, twin, call, state_of_pair, sizes, level=0):
    """Calls of these sizes, each against the twin run on the real rows alone: the outputs (within
    rounding: a padded batch may round otherwise) and the state after each call (bitwise: a padded call
    that runs without graphs, or a replay of a captured size, leaves exactly what eager leaves; at level
    2 within rounding, as Inductor's fused kernels round otherwise, with or without graphs). A padding
    row's write into another sequence's row is far outside that rounding."""
    same = F.equal if level < 2 else F.close
    with F.no_grad():
        for step, real in enumerate(sizes):
            got, want = call(m, real, step), call(twin, real, step)
            assert F.close(got, want), f"call {step} of {real} rows"
            mine, theirs = state_of_pair()
            assert same(mine, theirs), f"the state after call {step} of {real} rows differs from eager's"


def _written_by_padding(F, logs, report, level, name, failure):
    """A capture that succeeded warned once that padding rows write `name` where a later call reads; one
    that failed (Paddle's SOT drops the write into the state at level >= 1) says `failure`."""
    if report.failed is None:
        assert len(warned(logs, name, "padding rows write")) == 1, [r.getMessage() for r in logs.records]
    elif level >= 1 and not F.static_writes_inputs:
        assert failure in report.failed
    else:
        raise AssertionError(report.failed)


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_per_row_state_buffer_is_never_written_by_padding_rows(F, M, level, full, logs):
    """`self.h[:n] = f(self.h[:n], x)`: a call of 3 rows replayed at 4 would write h[3] too, which the
    next call of 4 rows reads. Padded calls run without graphs; captured sizes replay."""
    m, twin = pair(F, M.RowState, level, full=full)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'h'", "buffer 'h'")
    F.copy_weights(twin, m)
    _state_as_eager(F, m, twin, lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step)),
                    lambda: (m.h, twin.h), (3, 4, 3, 8, 5, 8, 2))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 4 and s.fallback_reasons == {"outputs": 3}, s  # 4, 8, 8 and 2 replay


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_per_row_state_passed_as_a_marked_argument_is_never_written_by_padding_rows(F, M, level, full, logs):
    m, twin = pair(F, M.ArgRowState, level, full=full)
    state = graph_opt.mark_static_address(F.randn(8, HIDDEN, seed=99))
    state_twin = F.clone(state)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), state), progress=False)
    _written_by_padding(F, logs, report, level, "argument 'state'", "'state' in place")
    assert F.equal(state, state_twin), "capturing left the marked state other than it found it"
    _state_as_eager(F, m, twin,
                    lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step), state if model is m else state_twin),
                    lambda: (state, state_twin), (3, 4, 3, 8, 5, 8, 2))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 4 and s.fallback_reasons == {"outputs": 3}, s


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_count_per_token_id_is_never_advanced_by_padding_rows(F, M, level, full, logs):
    """A repetition penalty's counts, `counts.index_add_(0, ids, ones)`: padding rows hold id 0 and would
    count it at every padded call, and later logits would be penalized."""
    m, twin = pair(F, M.PenaltyCounts, level, full=full)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.arange(n, start=1), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'counts'", "buffer 'counts'")
    F.copy_weights(twin, m)
    _state_as_eager(F, m, twin, lambda model, n, step: model(F.arange(n, start=1 + step)),
                    lambda: (m.counts, twin.counts), (3, 3, 5, 4, 8, 3))
    s = graph_opt.stats(m)
    if report.failed is None:
        assert s.replays == 2 and s.fallback_reasons == {"outputs": 4}, s


def test_an_unmarked_argument_the_forward_writes_keeps_what_eager_leaves_in_its_other_rows(F, M, level, logs):
    """`last[:n] = y` into an argument without a batch dimension that is not marked: its static copy is
    written back whole after a replay, so padding rows' writes would reach the caller's rows of other
    slots. Padded calls run without graphs; captured sizes replay."""
    m, twin = pair(F, M.ArgLastRows, level, dims={"x": 0})
    last = F.randn(8, HIDDEN, seed=99)
    mine, theirs = F.clone(last), F.clone(last)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.clone(last)), progress=False)
    if report.failed is not None:
        assert level >= 1 and not F.static_writes_inputs, report.failed
        return
    assert len(warned(logs, "argument 'last'", "padding rows write")) == 1
    _state_as_eager(F, m, twin,
                    lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step), mine if model is m else theirs),
                    lambda: (mine, theirs), (8, 3, 4, 3, 8, 5, 2), level)
    assert graph_opt.stats(m).fallback_reasons == {"outputs": 3}, graph_opt.stats(m)


@pytest.mark.parametrize("pads", [None, {"x": 1.0}, {"slots": 15}], ids=["default", "other_argument", "reserved"])
def test_a_slot_padding_rows_write_is_checked_unless_its_own_pad_value_is_reserved(F, M, level, pads, logs):
    """Padding rows write the cache at slot 0, which a real call's row may own: padded calls run without
    graphs, also when pad_values names only another argument (a value for `x`). A slot reserved for
    padding (pad_values={"slots": 15}) is written by padding rows alone, and padded calls replay."""
    m, twin = pair(F, M.SlotCache, level, pad_values=pads)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n, start=1)),
                                         progress=False)
    if report.failed is not None:
        assert level >= 1 and not F.static_writes_inputs, report.failed
        return
    F.copy_weights(twin, m)
    with F.no_grad():
        for step, slots in enumerate([[0, 9, 10, 11], [5, 6, 7], [12, 13], [0, 3, 4]]):
            x = F.randn(len(slots), HIDDEN, seed=20 + step)
            assert F.close(m(x, F.ids(slots)), twin(x, F.ids(slots))), step
            # every slot but the reserved one (15) as eager leaves it (within rounding: a padded replay's
            # rows round as a batch of the padded size does); another row's values are far outside it
            assert F.close(m.cache[:15], twin.cache[:15]), f"the cache after call {step}"
    s = graph_opt.stats(m)
    if pads == {"slots": 15}:
        assert s.replays == 4 and not s.fallback_reasons, s
    else:
        assert s.fallback_reasons.get("outputs", 0) >= 1, s


@pytest.mark.parametrize("at_calls", [False, True], ids=["capture_model", "at_calls"])
@pytest.mark.parametrize("kind, name", [("DecayRowState", "h"), ("RowAverage", "avg"), ("LastRows", "last")])
def test_padding_rows_writing_state_as_it_was_or_state_only_the_caller_reads_are_seen(F, M, level, kind, name,
                                                                                       at_calls, logs):
    """A state of zeros that padding rows of zeros write as zeros (the check also starts from a shifted
    state), a running average the caller reads but the output does not (the check compares the state
    later calls leave), and rows the forward only writes, for the caller (a later call writes them too:
    they hold a call's data): padded calls would change rows of other sequences, so they run without
    graphs."""
    m, twin = pair(F, getattr(M, kind), level)
    report = None
    if not at_calls:
        with F.graphs():
            report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
        _written_by_padding(F, logs, report, level, f"buffer '{name}'", f"buffer '{name}'")
    F.copy_weights(twin, m)
    with F.graphs():
        _state_as_eager(F, m, twin, lambda model, n, step: model(F.randn(n, HIDDEN, seed=10 + step)),
                        lambda: (getattr(m, name), getattr(twin, name)), (3, 4, 3, 8, 5, 8, 3, 4), level)
    if (report is None or report.failed is None) and (level == 0 or F.static_writes_inputs):
        assert graph_opt.stats(m).fallback_reasons.get("outputs", 0) >= 3, graph_opt.stats(m)


def test_counts_read_only_at_the_calls_own_ids_are_never_advanced_by_padding_rows(F, M, level, logs):
    """Capture inputs of random ids in range never hold id 0, the padding rows' id: the check also runs a
    call whose rows all hold the pad values, as a real call holding token 0 would."""
    m, twin = pair(F, M.PenaltyAtIds, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.arange(n, start=5), progress=False)
    _written_by_padding(F, logs, report, level, "buffer 'counts'", "buffer 'counts'")
    F.copy_weights(twin, m)
    with F.graphs():
        _state_as_eager(F, m, twin, lambda model, n, step: model(F.arange(n, start=step)),
                        lambda: (m.counts, twin.counts), (3, 5, 4, 3, 8))


def test_each_call_hands_out_its_own_output_objects_and_one_tensor_twice_stays_one(F, M, level):
    """`return y, y`: one object in both places at every call, as in eager, kept together; a caller's
    in-place change of an output's shape (`unsqueeze_`) does not reach the next call's output."""
    m, twin = pair(F, M.ReturnsTwice, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x1, x2 = F.randn(4, HIDDEN, seed=1), F.randn(4, HIDDEN, seed=2)
    with F.graphs(), F.no_grad():
        a, b = m(x1)
        assert a is b
        c, d = m(x2)
        assert c is d and c is not a
        assert F.close(a, twin(x1)[0]) and F.close(c, twin(x2)[0])  # a was kept
        c.unsqueeze_(0)
        e, _ = m(x1)
        assert F.shape(e) == F.shape(x1) and F.close(e, twin(x1)[0])
    assert graph_opt.stats(m).replays == 3


def test_an_output_that_is_rows_of_a_marked_argument_stays_a_view_of_it(F, M, level):
    """Eager returns a view of the caller's cache, which later calls write: so does the replay's output,
    kept or not (the argument is the caller's memory, not the graphs')."""
    if level >= 1 and not F.static_writes_inputs:
        pytest.skip("Paddle's SOT returns a copy of an argument's slice (docs/calls-and-captures.md)")
    m, twin = pair(F, M.ReturnsRowsOfMarked, level)
    cache = graph_opt.mark_static_address(F.randn(8, HIDDEN, seed=9))
    cache_twin = F.clone(cache)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), cache))
    x1, x2 = F.randn(4, HIDDEN, seed=1), F.randn(4, HIDDEN, seed=2)
    with F.graphs(), F.no_grad():
        a, w = m(x1, cache), twin(x1, cache_twin)
        m(x2, cache), twin(x2, cache_twin)
        assert F.close(a, w) and F.close(a, F.rows(cache, 0, 4))  # both views show the second call's write


# -- branches on tensor values ---------------------------------------------------------------------------
@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("kind", ["BranchOnValue", "LoopOnValue"])
def test_a_branch_or_loop_on_a_tensor_value_answers_as_eager_on_every_path(F, M, level, full, kind, logs):
    """A call of a captured size that takes another path than the capture did (the branch not taken, a
    loop's other number of turns) gets eager's answer: Paddle's SOT runs the frames it did not record as
    plain Python, and their result is the call's. A padded call would decide such a branch over the
    padding rows too (`x.min()` sees the pad value 0): where the translator shows the branch (level >= 1)
    padded calls run without graphs; at level 0 a real capture fails on the branch's host sync (tests/gpu),
    while the host stand-in re-runs it on the padded rows, so padded calls are checked only there."""
    m, twin = pair(F, getattr(M, kind), level, full=full)
    with F.graphs():
        simulated = graph_opt.testing.simulation_enabled()
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    calls = [(4, "mixed"), (4, "positive"), (8, "large"), (8, "mixed"), (8, "positive"), (4, "large")]
    if level >= 1 or not simulated:
        calls += [(3, "positive"), (5, "large"), (3, "mixed")]
    with F.graphs(), F.no_grad():
        for real, kind_of_x in calls:
            x = F.randn(real, HIDDEN, seed=real)
            x = {"mixed": x, "positive": x * x + 0.1, "large": x * 10.0}[kind_of_x]
            assert F.close(m(x), twin(x)), f"a call of {real} {kind_of_x} rows"
    if report.failed is None and level >= 1 and not F.static_writes_inputs:  # Paddle's SOT traced the branch
        assert warned(logs, "reads a tensor's value on the host")


# -- outputs a caller keeps (graph_opt/handed_outputs.py) ------------------------------------------------
@pytest.mark.parametrize("outer", ["plain", "decorated"])
def test_a_decorated_block_called_twice_in_one_forward_gives_eager_s_answer(F, M, level, outer, logs):
    """`a = self.block(x); b = self.block(y)`: the second replay writes where the first one's output is;
    the first is kept (its values copied) before it runs. The same inside a decorated outer model, whose
    level-0 capture records the block's replays and the copy between them."""
    block, block_twin = pair(F, M.Scaled, level)
    capture(F, block, lambda n: F.randn(n, HIDDEN, seed=n))
    twin = F.place(M.CallsTwice(block_twin))
    if outer == "plain":
        model = F.place(M.CallsTwice(block))
    else:
        Outer = graph_opt.support_graph_optimization(type("Outer", (M.CallsTwice,), {}))
        model = F.place(Outer(block, graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=SIZES)))
        capture(F, model, lambda n: (F.randn(n, HIDDEN, seed=n), F.randn(n, HIDDEN, seed=n + 1)))
    with F.graphs(), F.no_grad():
        for real in (4, 3, 8):
            x, y = F.randn(real, HIDDEN, seed=real), F.randn(real, HIDDEN, seed=real + 50)
            assert F.close(model(x, y), twin(x, y)), f"a call of {real} rows"
    assert graph_opt.stats(block).fallbacks == 0 and graph_opt.stats(block).capture_failures == 0
    if outer == "plain":
        assert graph_opt.stats(block).replays == 6
    else:  # the outer graph holds the block's work (the block ran its plain forward inside that capture)
        assert graph_opt.stats(model).replays == 3


def test_outputs_kept_across_calls_keep_their_values_unless_keep_outputs_is_off(F, M, level):
    """Every size's outputs share the largest size's storage: each later call writes where the earlier
    ones' outputs are. Kept outputs keep their values; with keep_outputs=False they are overwritten."""
    for keep in (True, False):
        m, twin = pair(F, M.Scaled, level, config={"keep_outputs": keep})
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
        xs = [F.randn(n, HIDDEN, seed=10 + n + i) for i, n in enumerate((3, 8, 4, 3))]
        with F.graphs(), F.no_grad():
            outs = [m(x) for x in xs]
            wants = [twin(x) for x in xs]
        assert graph_opt.stats(m).replays == 4
        if keep:
            for i, (out, want) in enumerate(zip(outs, wants)):
                assert F.close(out, want), f"output {i}"
        else:  # documented: valid until the next call
            assert not F.close(outs[0], wants[0])


def test_dummy_capture_inputs_of_zeros_do_not_hide_a_forward_that_mixes_rows(F, M, level, logs):
    """Captured with all-zero inputs (a serving engine's dummy run): padding rows hold the pad value 0
    too, so the check must probe with rows that differ from them."""
    m, twin = pair(F, M.BatchMean, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n) * 0.0)
    assert warned(logs, "gave other values than eager")
    with F.no_grad():
        for real in (3, 5):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).fallback_reasons == {"outputs": 2}


def test_dummy_token_ids_of_zeros_do_not_hide_a_forward_that_mixes_rows(F, M, level, logs):
    """make_inputs gives all-zero ids, as the padding rows hold: the check cannot tell rows apart, so
    padded calls run without graphs, and the warning says how to keep them."""
    m, twin = pair(F, M.EmbedsBatchMean, level)
    capture(F, m, lambda n: F.arange(n) * 0)
    assert warned(logs, "could not be checked", "holds the pad value", "rows that differ")
    with F.no_grad():
        for real in (3, 5, 4):
            ids = F.arange(real, start=1)
            assert F.close(m(ids), twin(ids)), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"outputs": 2} and s.replays == 1


def test_token_ids_whose_rows_differ_from_the_padding_keep_padded_replays(F, M, level, logs):
    """Rows of distinct ids, or every row the largest id (a pad token at the vocabulary's end): the check
    runs on the ids as given (never another id, which could be out of the embedding's range)."""
    for make in (lambda n: F.arange(n, start=1), lambda n: F.arange(n) * 0 + 31):
        m, twin = pair(F, M.Embeds, level)
        logs.clear()
        capture(F, m, make)
        assert not warned(logs, "could not be checked") and not warned(logs, "other values than eager")
        with F.no_grad():
            for real in (3, 5, 4, 1):
                ids = F.arange(real, start=1)
                assert F.close(m(ids), twin(ids)), f"a call of {real} rows"  # padded: other kernels' rounding
        s = graph_opt.stats(m)
        assert s.fallback_reasons == {} and s.replays == 4


def test_a_scalar_output_of_a_batch_statistic_blocks_padded_calls(F, M, level, logs):
    """A 0-d loss beside the rows: the padded check compares it too (Paddle's comparison of 0-d arrays
    used to raise and leave the size captured and unchecked)."""
    m, twin = pair(F, M.MeanLoss, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "other values than eager")
    with F.no_grad():
        for real in (3, 4, 5):
            x = F.randn(real, HIDDEN, seed=real)
            (y, loss), (want_y, want_loss) = m(x), twin(x)
            assert F.close(y, want_y) and F.close(loss, want_loss), f"a call of {real} rows"
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"outputs": 2} and s.replays == 1


def test_padded_calls_the_check_cannot_run_do_not_replay(F, M, level, logs):
    """The plain forward cannot run 3 rows (it pairs rows): nothing checked size 4's padded calls, so a
    call of 3 rows runs eagerly and fails as eager does, instead of replaying size 4."""
    m, twin = pair(F, M.PairsRows, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "could not be checked", "3 rows")
    x3 = F.randn(3, HIDDEN, seed=3)
    with F.no_grad():
        with pytest.raises(Exception):
            twin(x3)
        with pytest.raises(Exception):
            m(x3)
        for real in (4, 2, 8):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).replays == 3


def test_a_forward_that_branches_on_the_batch_size_replays_only_captured_sizes(F, M, level, logs):
    m, twin = pair(F, M.BranchOnBatch, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert warned(logs, "other values than eager")
    with F.no_grad():
        for real in (5, 7, 8, 3):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).fallback_reasons.get("outputs", 0) >= 2


def test_the_check_runs_for_every_size_even_when_the_first_capture_is_size_1(F, M, level, logs):
    m, twin = pair(F, M.BatchMean, level, sizes=[1, 2, 4, 8])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n), sizes=[1])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (3, 5, 7):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
    assert graph_opt.stats(m).replays == 0


def test_a_pad_value_its_argument_cannot_hold_is_an_error_naming_it(F, M):
    m, _ = pair(F, M.KVCache, 0, sizes=[4, 8], pad_values={"pos": 2 ** 70})
    with F.graphs(), pytest.raises(graph_opt.GraphOptConfigError, match=r"pad_values\['pos'\]=1180591620717411303424 "
                                                                      r"does not fit argument 'pos' of dtype"):
        graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)), progress=False)
    assert graph_opt.stats(m).captures == 0


# -- 10. Broadcast outputs ------------------------------------------------------------------------------------
def test_a_broadcast_output_replays_at_every_size(F, M, level, logs):
    m, twin = pair(F, M.Positions, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (8, 2, 3, 4, 7):
            x = F.randn(real, HIDDEN, seed=real)
            out, ref = m(x), twin(x)
            assert F.equal(out["pos"], ref["pos"]) and F.close(out["y"], ref["y"])
    s = graph_opt.stats(m)
    assert s.replays == 5 and s.replay_failures == 0 and s.disabled_reason is None


def test_host_outputs_are_cut_on_their_learned_batch_dimension(F, M, level):
    m, twin = pair(F, M.HostShapes, level, host_outputs=["fixed", "by_column"])
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (3, 8, 5):
            x = F.randn(real, HIDDEN, seed=real)
            out, ref = m(x), twin(x)
            fixed, by_column = out["fixed"].result(), out["by_column"].result()
            assert fixed.shape == (8,), "an output of 8 values at batch 8 is not batch-major"
            assert by_column.shape == (6, real)
            assert (fixed == F.numpy(ref["fixed"])).all() and (by_column == F.numpy(ref["by_column"])).all()
    assert graph_opt.stats(m).replays == 3


# -- containers and objects as arguments ----------------------------------------------------------------------
def test_a_dict_or_list_a_caller_changes_is_not_the_next_calls(F, M, level):
    """Each call gets its own containers: the replay's stored outputs are never handed out themselves."""
    m, twin = pair(F, M.ReturnsContainers, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (3, 4, 3, 8):
            out = m(F.randn(real, HIDDEN, seed=real))
            out["y"] = F.scale(out["y"], 3.0)
            del out["parts"][0]
            x = F.randn(real, HIDDEN, seed=10 + real)
            got, want = m(x), eager_padded(F, twin, x)
            assert sorted(got) == ["parts", "y"] and len(got["parts"]) == 1, f"a call of {real} rows"
            assert same(F, level, got["y"], want["y"]) and same(F, level, got["parts"][0], want["parts"][0])
    assert graph_opt.stats(m).replays == 8


def test_an_output_object_holding_tensors_runs_without_graphs_with_one_warning(F, M, level, logs):
    """An object graph_opt cannot rebuild would come back as the capture's own, with its tensors."""
    m, twin = pair(F, M.ReturnsObject, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    assert report.failed and "Result object" in report.failed
    assert warned(logs, "output (a Result object)", "Return the tensors")
    with F.no_grad():
        for real in (4, 3, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.equal(m(x).y, twin(x).y), f"a call of {real} rows"
    assert graph_opt.stats(m).replays == 0


def test_dataclasses_model_outputs_and_dict_subclasses_carry_every_call_s_tensors(F, M, level):
    m, twin = pair(F, M.TakesContainers, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.containers(n, seed=n), progress=False)
    # Paddle's SOT cannot read a dataclass attribute that is not a field: the capture says so, eager answers
    refused = report.failed is not None
    assert not refused or (level >= 1 and not F.static_writes_inputs and "has no attribute scale" in report.failed)
    with F.no_grad():
        for real in (8, 3, 4, 5):
            args = F.containers(real, seed=100 + real)
            out, ref = m(*args), twin(*args)
            for key in ("y", "z"):
                assert F.close(out[key], ref[key]), f"{key} at {real} rows"
                assert F.close(out.get(key) if hasattr(out, "get") else out[key], ref[key])
            assert F.close(out.to_tuple()[0], ref.to_tuple()[0]), "indexing a ModelOutput-like result"
    assert graph_opt.stats(m).replays == (0 if refused else 4)


@pytest.mark.parametrize("callable_", [False, True], ids=["object", "callable-object"])
def test_an_object_argument_is_refused_at_level_0_and_guarded_at_level_1(F, M, level, logs, callable_):
    m, twin = pair(F, M.TakesState, level)
    state = F.state_object()
    if callable_:  # a logits processor or a module passed in: still an object whose attributes the forward reads
        state.__class__ = type("State", (type(state),), {"__call__": lambda self, x: x})
    if level == 0:
        with F.graphs(), pytest.raises(graph_opt.GraphOptInputError, match=r"forward argument state \(a State\): at "
                                                                              r"graph_opt_level=0 a replay cannot see"):
            graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), state), progress=False)
    else:
        capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), state))
    x = F.randn(3, HIDDEN, seed=1)
    with F.graphs(), F.no_grad():
        for step in range(3):
            state.bias = F.full_like_row(x, float(step))  # mutated between calls, the same object
            assert F.close(m(x, state), twin(x, state)), f"step {step}"


def test_an_object_the_forward_advances_is_advanced_once_per_call(F, M, level):
    """No capture_model: a size is not captured at a call passing an object, whose state every run of the
    forward would change (the warmups and the capture too)."""
    m, twin = pair(F, M.AdvancesState, level)
    with F.graphs(), F.no_grad():
        for real in (4, 3):
            state, state_twin = F.state_object(), F.state_object()
            for step in range(3):
                x = F.randn(real, HIDDEN, seed=step + 1)
                assert F.close(m(x, state), twin(x, state_twin)), f"{real} rows, step {step}"
                assert F.close(state.bias, state_twin.bias), f"{real} rows, step {step}: the object's state"
    s = graph_opt.stats(m)
    assert s.captures == 0 and s.fallback_reasons == {"object_argument": 6}, s


# -- 12. Copies of a decorated model --------------------------------------------------------------------------
def test_deepcopy_and_pickle_give_a_working_model_without_graphs(F, level):
    m = F.picklable_model(level)
    x = F.randn(3, HIDDEN, seed=1)
    for captured in (False, True):
        if captured:
            capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
        for twin in (copy.deepcopy(m), F.save_load(m), copy.copy(m)):
            assert type(twin) is type(m)
            assert graph_opt.stats(twin).captured_sizes == []  # graphs belong to the original
            with F.no_grad():
                assert F.close(twin(x), type(m).forward(m, x))
            assert state_of(twin).model is twin and state_of(twin) is not state_of(m)
            capture(F, twin, lambda n: F.randn(n, HIDDEN, seed=n))
            replays = graph_opt.stats(twin).replays  # a device captured size 4 at the first call already
            with F.no_grad():
                assert F.close(twin(x), type(m).forward(m, x))
            assert graph_opt.stats(twin).replays == replays + 1
    with F.no_grad():
        assert F.close(m(x), type(m).forward(m, x))
    assert graph_opt.stats(m).replays == 1  # the original still replays its own graphs


# -- 13 and 14. New non-tensor values: bounded at call time, explicit in capture_model -----------------------
def test_graphs_per_value_captured_at_call_time_are_bounded(F, M, logs):
    m, twin = pair(F, M.Scales, 0, config={"cudagraph_max_signatures": 3})
    x = F.randn(4, HIDDEN, seed=1)
    with F.graphs(), F.no_grad():
        for i in range(12):
            scale = 1.0 + i / 8
            assert F.equal(m(x, scale, 1.0)["scaled"], twin(x, scale, 1.0)["scaled"])
    s = graph_opt.stats(m)
    assert len(state_of(m).runner.signatures) == 3 and s.captures == 3
    assert s.fallback_reasons == {"signature_limit": 9}
    assert len(warned(logs, "cudagraph_max_signatures=3", "scale")) == 1


def test_a_second_capture_model_with_another_value_captures_it(F, M, level):
    m, twin = pair(F, M.Scales, level)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), 1, 1.0))
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), 2, 1.0))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        for scale in (1, 2):
            assert F.equal(m(x, scale, 1.0)["scaled"], twin(x, scale, 1.0)["scaled"])
        assert F.equal(m(x, 3, 1.0)["scaled"], twin(x, 3, 1.0)["scaled"])
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"new_signature": 1}


# -- 15. Without copied inputs, the caller's buffer with its strides ------------------------------------------
def test_without_copied_inputs_a_transposed_view_of_the_buffer_does_not_replay(F, M, level):
    m, twin = pair(F, M.Square, level, sizes=[HIDDEN], config={"cudagraph_copy_inputs": False})
    buf = F.randn(HIDDEN, HIDDEN, seed=3)
    capture(F, m, lambda n: buf)
    with F.no_grad():
        assert same(F, level, m(buf), twin(buf))
        transposed = F.transpose(buf)
        assert F.close(m(transposed), twin(transposed))
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallback_reasons == {"mismatch": 1}


# -- 16. The common call's shortcut (graph_opt/fast_replay.py) --------------------------------------------------
def _shortcut_taken(m, monkeypatch):
    """From here on a call that is not answered by the shortcut fails the test."""
    def full_path(*a, **k):
        raise AssertionError("the call took the full dispatch")
    monkeypatch.setattr(state_of(m).runner, "_dispatch", full_path)


def test_the_common_call_replays_through_its_plan_and_equals_eager(F, M, level, monkeypatch):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for real in (8, 3):  # the full path replays each size once and keeps its plan
            x = F.randn(real, HIDDEN, seed=real)
            assert same(F, level, m(x), eager_padded(F, twin, x))
        runner = state_of(m).runner
        assert runner.shortcut is not None and sorted(runner.shortcut.plans) == [3, 8]
        _shortcut_taken(m, monkeypatch)
        for real in (8, 3, 3, 8):
            x = F.randn(real, HIDDEN, seed=10 + real)
            assert same(F, level, m(x), eager_padded(F, twin, x)), f"a call of {real} rows through the shortcut"
    assert graph_opt.stats(m).replays == 6


def test_a_call_the_shortcut_refuses_has_written_nothing(F, M):
    m, twin = pair(F, M.KVCache, 0, sizes=[4, 8], pad_values={"pos": 15})
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), F.arange(n)))
    with F.no_grad():
        x, pos = F.randn(8, HIDDEN, seed=1), F.arange(8)
        assert F.close(m(x, pos), twin(x, pos))
        (sig,) = state_of(m).runner.signatures.values()
        assert state_of(m).runner.shortcut.plans
        before = [F.clone(b) for b in sig.buffers]
        with pytest.raises(graph_opt.GraphOptInputError, match="pos"):
            m(F.randn(8, HIDDEN, seed=2), F.randn(8, seed=3))  # pos of another dtype
        assert all(F.equal(a, b) for a, b in zip(before, sig.buffers)), "a refused call wrote a static buffer"
        assert F.close(m(x, pos), twin(x, pos))


def test_the_plans_go_with_the_graphs(F, M, level, monkeypatch):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(4, HIDDEN, seed=4)
    with F.no_grad():
        m(x)
        assert state_of(m).runner.shortcut is not None
        graph_opt.clear_graphs(m)
        assert state_of(m).runner is None or state_of(m).runner.shortcut is None
        capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
        assert same(F, level, m(x), twin(x))
        _shortcut_taken(m, monkeypatch)
        assert same(F, level, m(x), twin(x))


def test_a_replay_that_raises_in_the_shortcut_answers_eagerly_and_drops_the_graphs(F, M, level, logs):
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(8, HIDDEN, seed=8)
    with F.no_grad():
        m(x)
        plans = state_of(m).runner.shortcut.plans

        def broken():
            raise RuntimeError("device lost")
        plans[8] = dataclasses.replace(plans[8], replay=broken)
        assert F.close(m(x), twin(x))
        assert F.close(m(x), twin(x))
    s = graph_opt.stats(m)
    assert "replay of size 8 failed: RuntimeError: device lost" in s.disabled_reason
    assert s.replay_failures == 1 and len(warned(logs, "device lost")) == 1


def test_a_parameter_replaced_after_capture_is_never_run_stale_by_other_fallbacks(F, M, level):
    """Calls that run without graphs for another reason (autograd on, a size above the max) after a
    replacement: the plain forward, never a translated program traced with the old parameter."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    for model in (m, twin):
        F.replace_weight(model.lin, 0.25)
    x, big = F.randn(3, HIDDEN, seed=1), F.randn(12, HIDDEN, seed=2)
    assert F.close(m(x), twin(x)), "a call with autograd on ran the old parameter"
    with F.no_grad():
        assert F.close(m(big), twin(big)), "a call above the largest size ran the old parameter"
        assert F.close(m(x), twin(x))


def test_a_decode_loop_feeding_outputs_back_captures_lazily_and_equals_eager(F, M, level):
    """x = m(x)[:n] without capture_model: each new size is captured at its first call, and the check
    after that capture replays it, writing the outputs x is a view of, before x is copied in."""
    m, twin = pair(F, M.Scaled, level)
    x = F.randn(8, HIDDEN, seed=1)
    with F.graphs(), F.no_grad():
        for n in (8, 8, 4, 4, 2, 2):
            x = F.rows(x, 0, n)
            want = twin(F.clone(x))
            out = m(x)
            assert F.close(out, want), f"the call of {n} rows"
            x = out
    s = graph_opt.stats(m)
    assert s.lazy_captures == 3 and s.replays == 6, s


def test_a_forward_that_writes_its_input_writes_it_once_when_captured_at_the_call(F, M, level):
    """Without capture_model: the size is captured at the first call, and the check after the capture
    replays it. The caller's tensor gets the forward's write once, as in eager; where the capture fails
    (Paddle's SOT drops the write) the call that found it is answered by the plain forward too."""
    m, twin = pair(F, M.WritesInput, level)
    with F.graphs(), F.no_grad():
        for real in (3, 3, 8):
            x = F.randn(real, HIDDEN, seed=real)
            x_twin = F.clone(x)
            assert F.close(m(x), twin(x_twin)), f"the call of {real} rows"
            assert F.equal(x, x_twin), f"the call of {real} rows wrote its argument other than eager did"


# -- 17. Arguments read in place: graph_opt.mark_static_address ---------------------------------------------
SLOTS = 16  # the cache's rows; padding rows write the last one, which no real call uses


def _cache_pair(F, M, level, **kw):
    m, twin = pair(F, M.ArgCache, level, pad_values={"slots": SLOTS - 1}, **kw)
    cache = graph_opt.mark_static_address(F.randn(SLOTS, HIDDEN, seed=99))
    return m, twin, cache, F.clone(cache)


def _cache_inputs(F, cache, n, start=0, seed=0):
    return F.randn(n, HIDDEN, seed=seed or n), cache, F.arange(n, start=start)


def _sot_drops_the_write(F, level):
    return level >= 1 and not F.static_writes_inputs  # Paddle's SOT: the capture fails, eager answers (case 8)


def _twin_call(F, level, twin, x, cache, slots):
    """The twin's answer to a call, run once (it adds into the cache): on the rows the replay runs."""
    if _sot_drops_the_write(F, level):
        return twin(x, cache, slots)
    return eager_padded(F, twin, x, cache, slots, batch=(0, 2), pads={2: SLOTS - 1})


def test_a_marked_cache_is_written_in_place_once_per_call_and_left_as_found_by_the_capture(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: _cache_inputs(F, cache, n), progress=False)
    if _sot_drops_the_write(F, level):
        assert "writes its argument 'cache' in place" in report.failed
    else:
        assert report.failed is None, report.failed
        assert state_of(m).runner.buffer_bytes() < 8 * SLOTS * HIDDEN, "the cache was given a static buffer"
    assert F.equal(cache, cache_twin), "capturing left the marked cache other than it found it"
    with F.no_grad():
        for real, start in ((3, 0), (8, 4), (2, 12), (3, 0), (8, 4)):
            x, _, slots = _cache_inputs(F, cache, real, start, seed=real + start)
            assert F.close(m(x, cache, slots), _twin_call(F, level, twin, x, cache_twin, slots)), \
                f"the call of {real} rows at {start}"
            assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1)), \
                f"the cache after the call of {real} rows at {start} differs from eager's"
    s = graph_opt.stats(m)
    assert s.replays == (0 if _sot_drops_the_write(F, level) else 5), s


def test_a_marked_cache_captured_at_its_first_call_is_written_once(F, M, level):
    """No capture_model: the warmups, the capture and its check run on the caller's cache, which gets the
    call's one write all the same."""
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    with F.graphs(), F.no_grad():
        for real, start in ((3, 0), (3, 4), (8, 7), (2, 0)):
            x, _, slots = _cache_inputs(F, cache, real, start, seed=real + start)
            assert F.close(m(x, cache, slots), _twin_call(F, level, twin, x, cache_twin, slots)), \
                f"the call of {real} rows at {start}"
            assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1)), \
                f"the cache after the call of {real} rows at {start} differs from eager's"
    s = graph_opt.stats(m)
    assert s.replays + s.fallbacks == 4 and (s.replays > 0) != _sot_drops_the_write(F, level), s


def test_another_tensor_in_a_marked_argument_runs_without_graphs_and_the_marked_one_is_untouched(F, M, level, logs):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    if _sot_drops_the_write(F, level):
        return  # no graphs to refuse: the first test of this section
    capture(F, m, lambda n: _cache_inputs(F, cache, n))
    other, other_twin = F.randn(SLOTS, HIDDEN, seed=5), F.randn(SLOTS, HIDDEN, seed=5)
    with F.no_grad():
        for _ in range(2):
            x, _, slots = _cache_inputs(F, other, 3)
            assert F.close(m(x, other, slots), twin(x, other_twin, slots))
            assert F.equal(other, other_twin)
        assert F.equal(cache, cache_twin), "a call with another tensor wrote the marked one"
        x, _, slots = _cache_inputs(F, cache, 3)
        assert F.close(m(x, cache, slots), twin(x, cache_twin, slots))  # the marked one replays again
    s = graph_opt.stats(m)
    assert s.replays == 1 and s.fallback_reasons == {"moved": 2}, s
    assert len(warned(logs, "'cache'", "mark_static_address")) == 1


def test_a_marked_read_only_table_replays_through_the_shortcut_and_sees_the_callers_writes(F, M, level, monkeypatch):
    m, twin = pair(F, M.ReadsTable, level)
    table = graph_opt.mark_static_address(F.randn(HIDDEN, seed=4))
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), table))
    with F.no_grad():
        x = F.randn(3, HIDDEN, seed=1)
        assert same(F, level, m(x, table), eager_padded(F, twin, x, table))
        _shortcut_taken(m, monkeypatch)
        for scale in (2.0, 3.0):
            F.zero_buffer(table)  # the caller writes its table: the graph reads it where it is
            x = F.randn(3, HIDDEN, seed=int(scale))
            assert same(F, level, m(x, table), eager_padded(F, twin, x, table))
    assert graph_opt.stats(m).replays == 3


def test_marked_arguments_that_cannot_be_read_in_place_are_errors_naming_them(F, M):
    m, _ = pair(F, M.ReadsTable, 0, dims={"x": 0, "table": 0})
    table = graph_opt.mark_static_address(F.randn(HIDDEN, seed=4))
    with pytest.raises(graph_opt.GraphOptConfigError, match="dynamic_arg_dims\\['table'\\]=0.*mark_static_address"):
        capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), table))
    m, _ = pair(F, M.ReadsTable, 0)
    with F.graphs():
        report = graph_opt.capture_model(
            m, lambda n: (F.randn(n, HIDDEN, seed=n), graph_opt.mark_static_address(F.randn(HIDDEN, seed=n))),
            progress=False)
    assert report.failed is not None and "'table'" in report.failed and "same tensor for every size" in report.failed
    with pytest.raises(TypeError, match="mark_static_address takes a torch.Tensor or paddle.Tensor; got list"):
        graph_opt.mark_static_address([1.0])


def test_another_tensor_in_a_marked_argument_at_a_new_size_is_not_captured_and_graphs_stay(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    other, other_twin = F.randn(SLOTS, HIDDEN, seed=5), F.randn(SLOTS, HIDDEN, seed=5)
    with F.graphs(), F.no_grad():
        for real, c, c_twin in ((3, cache, cache_twin), (8, other, other_twin), (3, cache, cache_twin),
                                (8, cache, cache_twin)):
            x, _, slots = _cache_inputs(F, c, real)
            assert F.close(m(x, c, slots), _twin_call(F, level, twin, x, c_twin, slots))
            assert F.equal(F.rows(c, 0, SLOTS - 1), F.rows(c_twin, 0, SLOTS - 1))
    s = graph_opt.stats(m)
    if not _sot_drops_the_write(F, level):
        assert s.disabled_reason is None and s.lazy_captures == 2 and s.fallback_reasons == {"moved": 1}, s


def test_arguments_sharing_memory_with_a_marked_cache_the_forward_writes_never_take_the_shortcut(F, M, level):
    m, twin, cache, cache_twin = _cache_pair(F, M, level)
    if _sot_drops_the_write(F, level):
        return  # no graphs (the first test of this section)
    capture(F, m, lambda n: _cache_inputs(F, cache, n))
    with F.no_grad():
        x, _, slots = _cache_inputs(F, cache, 4, start=8)
        assert F.close(m(x, cache, slots), twin(x, cache_twin, slots))  # a replay: the plan for 4 rows is kept
        slots = F.arange(4)
        want = twin(F.rows(cache_twin, 0, 4), cache_twin, slots)  # x is a view of the rows the forward adds to
        translations = graph_opt.stats(m).translations
        assert F.close(m(F.rows(cache, 0, 4), cache, slots), want)
        assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1))
        slots = F.arange(4, start=4)  # x overlaps the rows the forward adds to from another first address
        want = twin(F.rows(cache_twin, 2, 6), cache_twin, slots)
        assert F.close(m(F.rows(cache, 2, 6), cache, slots), want)
        assert F.equal(F.rows(cache, 0, SLOTS - 1), F.rows(cache_twin, 0, SLOTS - 1))
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"aliased": 2}
    assert s.translations == translations  # the plain forward answers it: nothing compiled for the aliasing


def check_a_decorated_submodule_fails_the_capture_clearly(F, M, level, logs):
    """Level >= 1 cannot trace into another decorated model's call: one warning that says so and what to
    do, and the model answers as its undecorated twin (an undecorated inner one included)."""
    outer = graph_opt.support_graph_optimization(type("HoldsDecorated", (M.HoldsDecorated,), {}))
    F.seed(0)
    m = F.place(outer(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=SIZES)))
    twin = F.place(M.HoldsDecorated(inner=M.Scaled()))
    F.copy_weights(twin, m)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    assert "HoldsDecorated.inner is itself a model decorated" in report.failed
    assert warned(logs, "Decorate only one of them")
    with F.no_grad():
        for real in (3, 4):
            x = F.randn(real, HIDDEN, seed=real)
            assert F.close(m(x), twin(x)), f"a call of {real} rows"
