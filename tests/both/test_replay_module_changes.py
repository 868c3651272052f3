"""Inference replays never silently wrong when the model changes after capture: an attribute, a global or
a closure variable the forward reads, a parameter set, replaced, converted or frozen, hooks added or
removed, the training mode, a copy of the model. On both frameworks (the fixture `fw`), graphs simulated
on CPU: F.graphs().

Every test compares with an undecorated twin holding the same weights, and asserts the way the plugin
answered: a replay (bitwise eager on the same padded rows), a call without graphs with one warning naming
what changed, or a clear error.
"""
import copy

import pytest

import graph_opt
from graph_opt.decorator import state_of
from replay_support import HIDDEN, SIZES, capture, eager_padded, pair, same, warned

_CI_SECONDS = 4  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch here only where Inductor's kernels change what a replay must get right; tests/gpu runs
# every case at every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {
    "test_a_changed_attribute_runs_without_graphs_with_one_warning_then_replays_again",
}


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


@pytest.mark.per_framework("level", {"torch": [1, 2], "paddle": [1]})
def test_a_decorated_submodule_fails_the_capture_clearly(F, M, level, logs):
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


def test_an_attribute_the_forward_never_reads_set_after_capture_keeps_the_replays(F, M, level, logs):
    """A step counter or a run name set on the model (torch.compile(m) sets a marker too) is nothing the
    graphs read: replays go on. One the forward reads (temperature) still stops them."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        for step in range(3):
            m.step, m.run_name = step, f"run-{step}"
            assert same(F, level, m(x), eager_padded(F, twin, x))
        assert graph_opt.stats(m).replays == 3 and graph_opt.stats(m).fallbacks == 0
        m.temperature = twin.temperature = 2.0
        assert F.close(m(x), twin(x)) and graph_opt.stats(m).replays == 3
    assert not warned(logs, "step") and len(warned(logs, "temperature")) == 1
