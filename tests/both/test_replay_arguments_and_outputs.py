"""Inference replays never silently wrong in what a call passes and gets back: non-tensor arguments keyed on
type and value, containers and objects as arguments, new values bounded at call time or captured by
capture_model, outputs cut on their batch dimension, output objects each call's own, broadcast and host
outputs. On both frameworks (the fixture `fw`), graphs simulated on CPU: F.graphs().
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
    "test_outputs_are_cut_on_their_learned_batch_dimension",
    "test_a_broadcast_output_replays_at_every_size",
}


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


def test_a_call_above_the_largest_capture_size_warns_once_and_counts(F, M, level, logs):
    """More rows than the largest size: eager's answer, counted under "above_max", one warning per model
    naming the size and the setting to raise."""
    m, twin = pair(F, M.Scaled, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        for rows in (SIZES[-1] + 3, SIZES[-1] + 7):
            x = F.randn(rows, HIDDEN, seed=rows)
            assert F.close(m(x), twin(x))
        x = F.randn(SIZES[-1], HIDDEN, seed=1)
        assert same(F, level, m(x), eager_padded(F, twin, x))
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"above_max": 2} and s.replays == 1, s
    (message,) = warned(logs, "above the largest capture size")
    assert f"{SIZES[-1] + 3} rows" in message and "max_capture_size" in message, message
    graph_opt.clear_graphs(m)  # captured again: the next such call says so again, with its own size
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    with F.no_grad():
        x = F.randn(SIZES[-1] + 5, HIDDEN, seed=5)
        assert F.close(m(x), twin(x))
    assert f"{SIZES[-1] + 5} rows" in warned(logs, "above the largest capture size")[-1]
