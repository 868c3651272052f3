"""The specification of graph_opt.autocudagraph, run on each framework through the fixture `T`
(tests/both/conftest.py), the framework's training shim (tests/torch_zoo/training.py,
tests/paddle_zoo/training.py); tests/gpu/test_gpu_training.py runs it on real graphs. Eager references are
undecorated twins with the same weights: the block given to autocudagraph is patched, its twin is not.
"""
from __future__ import annotations

import pytest

import graph_opt
from training_support import assert_same_step, graph_warnings, run_step, same_grad, twins


# -- 1. bitwise equality over several steps, every warmup_steps ----------------------------------
@pytest.mark.parametrize("warmup_steps", [0, 1, 2, 3])
def test_outputs_and_grads_are_bitwise_eager_over_steps(T, warmup_steps, steps=5):
    ref, m = twins(T, warmup_steps=warmup_steps, dropout=0.0)
    for step in range(steps):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    s = graph_opt.stats(m)
    assert (s.warmups, s.captures, s.keys, s.graphs) == (warmup_steps, 1, 1, 2)
    assert s.replays == s.backward_replays == steps - warmup_steps
    assert s.fallbacks == 0


# -- 2. gradient accumulation across micro-batches --------------------------------------------------
def test_grad_accumulation_across_micro_batches_with_capture_mid_step(T, warmup_steps=1, micro_batches=4, steps=3):
    """Capture happens at micro-batch warmup_steps+1 of the first step; parameters after every
    optimizer step equal the eager twin's."""
    ref, m = twins(T, warmup_steps=warmup_steps, dropout=0.0)
    opt_ref, opt = T.sgd(ref), T.sgd(m)
    for step in range(steps):
        for mb in range(micro_batches):
            x = T.randn([2, 6, T.hidden], seed=100 * step + mb)
            run_step(T, ref, x, seed=mb)
            run_step(T, m, x, seed=mb)
            if step == 0 and mb == warmup_steps:
                assert graph_opt.stats(m).captures == 1  # captured mid-step, grads already accumulated
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert T.equal(T.grad(p), T.grad(p_ref)), f"step {step}: accumulated grad of {name} differs"
        opt_ref.step(), opt.step()
        opt_ref.clear_grad(), opt.clear_grad()
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert T.equal(p, p_ref), f"after step {step}: {name} differs by {T.max_diff(p, p_ref)}"
    assert graph_opt.stats(m).backward_replays == steps * micro_batches - warmup_steps


# -- 3. inputs and outputs of every shape -----------------------------------------------------------
def test_nested_inputs_and_outputs_grad_and_no_grad_strided_unused_shared(T):
    """Several tensors, some without grad, nested dict/list/tuple in and out, an unused input, a
    strided input, and a parameter shared by two layers."""
    ref = T.nested_block()
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=1)
    for step in range(4):
        base = T.randn([4, 2 * T.hidden], seed=step)
        a = T.randn([4, T.hidden], seed=50 + step)
        c = T.randn([4, T.hidden], seed=70 + step)

        def call(model):
            x = T.leaf(base, True)
            strided = T.strided(x)  # a non-contiguous view of a grad-carrying tensor
            a_leaf, c_leaf = T.leaf(a, True), T.leaf(c, False)
            unused = T.leaf(a, True)
            out = model({"x": strided, "pair": [a_leaf, (c_leaf, 3)]}, unused)
            loss = T.loss(out["sum"]) + T.loss(out["parts"][0]) * 0.5 + T.loss(out["parts"][1][0])
            loss.backward()
            return out, T.grad(x), T.grad(a_leaf), T.grad(unused)

        T.zero_grads(ref), T.zero_grads(m)
        out_ref, gx_ref, ga_ref, gu_ref = call(ref)
        out, gx, ga, gu = call(m)
        assert out["count"] == out_ref["count"] == 3
        assert T.equal(out["sum"], out_ref["sum"]) and T.equal(out["parts"][0], out_ref["parts"][0])
        assert T.equal(out["parts"][1][0], out_ref["parts"][1][0])
        assert T.equal(gx, gx_ref) and T.equal(ga, ga_ref)
        assert gu is None and gu_ref is None  # the unused input gets no gradient, as in eager
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert T.equal(T.grad(p), T.grad(p_ref)), f"step {step}: grad of {name} differs"
    assert graph_opt.stats(m).backward_replays == 3


def test_a_graphed_function_of_tensors(T):
    """@autocudagraph on a function of tensors: w is an input, its gradient flows to the caller's w."""

    def block(x, w):
        return T.tanh(T.matmul(x, w)) * 2.0

    graphed = graph_opt.autocudagraph(block, warmup_steps=1)
    for step in range(4):
        x = T.randn([3, T.hidden], seed=step)
        w0 = T.randn([T.hidden, T.hidden], seed=10 + step)
        w_ref, w = T.leaf(w0, True), T.leaf(w0, True)
        x_ref, x_g = T.leaf(x, True), T.leaf(x, True)
        T.loss(block(x_ref, w_ref)).backward()
        T.loss(graphed(x_g, w)).backward()
        assert T.equal(T.grad(w), T.grad(w_ref)) and T.equal(T.grad(x_g), T.grad(x_ref))
    s = graph_opt.stats(graphed)
    assert (s.captures, s.replays, s.backward_replays) == (1, 3, 3)


# -- 4. objects --------------------------------------------------------------------------------------
def test_two_instances_do_not_share_graphs_or_buffers(T):
    ref_a, a = twins(T, warmup_steps=0, dropout=0.0)
    ref_b, b = twins(T, warmup_steps=0, dropout=0.0, seed=7)
    for step in range(3):
        x = T.randn([4, 6, T.hidden], seed=step)
        T.zero_grads(ref_a), T.zero_grads(a), T.zero_grads(ref_b), T.zero_grads(b)
        ya, _ = run_step(T, a, x, seed=step)
        yb, _ = run_step(T, b, x, seed=step)  # b's replay must not overwrite what a returned
        ya_ref, _ = run_step(T, ref_a, x, seed=step)
        yb_ref, _ = run_step(T, ref_b, x, seed=step)
        assert T.equal(ya, ya_ref) and T.equal(yb, yb_ref)
        assert not T.equal(ya, yb)
    assert graph_opt.stats(a).replays == graph_opt.stats(b).replays == 3


def test_a_deep_copy_is_an_independent_graphed_block(T):
    """copy.deepcopy of a graphed block (an EMA twin): its own graphs, its own parameters."""
    import copy

    ref, m = twins(T, warmup_steps=0, dropout=0.0)
    x = T.randn([4, 6, T.hidden], seed=1)
    assert_same_step(T, ref, m, x, seed=0)
    twin = copy.deepcopy(m)
    ref_twin = T.copy_block(ref)
    for step in range(3):
        for a, b in ((ref, m), (ref_twin, twin)):
            T.zero_grads(a), T.zero_grads(b)
            assert_same_step(T, a, b, T.randn([4, 6, T.hidden], seed=10 + step), seed=step)
    assert graph_opt.stats(twin).captures == 1 and graph_opt.stats(twin).replays == 3
    assert graph_opt.stats(m).replays == 4
    assert T.named_params(twin)[0][1] is not T.named_params(m)[0][1]


def test_a_replaced_parameter_is_detected_and_recaptured(T, caplog):
    ref, m = twins(T, warmup_steps=1, dropout=0.0)
    x = T.randn([4, 6, T.hidden], seed=1)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
    caplog.clear()
    new = T.randn(T.shape(T.first_weight(ref)), seed=99)
    T.replace_first_weight(ref, new)
    T.replace_first_weight(m, new)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)  # never a replay that reads the old weight
    s = graph_opt.stats(m)
    assert s.recaptures == 1 and s.captures == 2
    warnings = graph_warnings(caplog)
    assert len(warnings) == 1 and "replaced or added after capture" in warnings[0].getMessage()


# -- 5. randomness ------------------------------------------------------------------------------------
def test_dropout_draws_new_masks_per_replay_and_follows_the_seed(T):
    """New masks at every replay; with the same seed, the same masks as eager."""
    ref, m = twins(T, warmup_steps=1, dropout=0.5)
    x = T.randn([4, 6, T.hidden], seed=3)
    for step in range(4):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
    outs = []
    for _ in range(2):  # no reseeding: the generator moves on between replays
        y = m(T.leaf(x, True))
        T.loss(y).backward()
        outs.append(y)
    assert not T.equal(outs[0], outs[1])
    assert graph_opt.stats(m).replays == 5


def test_a_dropout_rate_set_on_a_submodule_after_capture_is_captured_again(T, caplog):
    """A dropout schedule (`block.drop.p = 0.5` between steps): the graphs baked the rate the forward
    read, so they are captured again, once per change, and every step draws eager's masks."""
    ref, m = twins(T, warmup_steps=1, dropout=0.0)
    x = T.randn([4, 6, T.hidden], seed=3)
    for step, p in enumerate((0.0, 0.0, 0.0, 0.5, 0.5, 0.0)):
        ref.drop.p = m.drop.p = p
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
    s = graph_opt.stats(m)
    assert (s.recaptures, s.replays) == (2, 5), s
    assert any("a dropout's p" in r.getMessage() for r in graph_warnings(caplog))


# -- 6. mixed precision ------------------------------------------------------------------------------
def test_autocast_forward_and_backward_graphed(T, autocast_tolerance):
    """Two micro-batches per autocast region, the optimizer step outside it, as autocast asks. The
    capture happens on the second micro-batch, when autocast's cache already holds low-precision
    copies of the weights: a graph that read those copies would replay stale weights after the step."""
    ref, m = twins(T, warmup_steps=1, dropout=0.0)
    opt_ref, opt = T.sgd(ref, lr=0.5), T.sgd(m, lr=0.5)
    for step in range(3):
        with T.autocast():
            for mb in range(2):
                x = T.randn([4, 6, T.hidden], seed=10 * step + mb)
                y_ref, gx_ref = run_step(T, ref, x, seed=mb)
                y, gx = run_step(T, m, x, seed=mb)
                assert T.max_diff(y, y_ref) <= autocast_tolerance and T.max_diff(gx, gx_ref) <= autocast_tolerance
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert T.max_diff(T.grad(p), T.grad(p_ref)) <= autocast_tolerance, f"step {step}: grad of {name}"
        opt_ref.step(), opt.step()
        opt_ref.clear_grad(), opt.clear_grad()
    s = graph_opt.stats(m)
    assert s.replays == 5 and s.fallbacks == 0


# -- 8. failures -------------------------------------------------------------------------------------
def test_a_failed_capture_runs_eagerly_warns_once_and_recovers(T, caplog):
    ref = T.block(dropout=0.0)
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=1)
    T.fail_when_capturing(m, True)
    x = T.randn([4, 6, T.hidden], seed=5)
    caplog.clear()
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
    s = graph_opt.stats(m)
    assert s.capture_failures == 1 and s.replays == 0 and s.fallbacks == 2
    assert "injected capture failure" in s.disabled_reason
    warnings = graph_warnings(caplog)
    assert len(warnings) == 1 and "capture failed" in warnings[0].getMessage()
    T.fail_when_capturing(m, False)
    graph_opt.clear_graphs(m)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, x, seed=step)
    s = graph_opt.stats(m)
    assert s.captures == 1 and s.replays == 2 and s.disabled_reason is None


# -- lifecycle around the guarantees ------------------------------------------------------------------
def test_no_grad_uses_a_forward_graph_only(T):
    ref, m = twins(T, warmup_steps=1, dropout=0.0)
    for step in range(3):
        x = T.randn([4, 6, T.hidden], seed=step)
        with T.no_grad():
            y, y_ref = m(x), ref(x)
        assert T.equal(y, y_ref) and not T.requires_grad(y)
    s = graph_opt.stats(m)
    assert (s.keys, s.graphs, s.replays, s.backward_replays) == (1, 1, 2, 0)


def test_two_calls_before_their_backwards_replay_and_a_third_runs_eagerly(T, caplog):
    """A second call while the first one's backward is pending replays graphs of its own (a second slot,
    captured then); a third would overwrite activations one of them reads, so it runs eagerly, once said."""
    ref, m = twins(T, warmup_steps=0, dropout=0.0)
    xs = [T.randn([4, 6, T.hidden], seed=i) for i in (1, 2, 3)]
    y1 = m(T.leaf(xs[0], True))
    T.loss(y1).backward()
    del y1
    assert graph_opt.stats(m).graphs == 2  # no second slot until a second call is pending
    T.zero_grads(m)
    caplog.clear()
    ys = [m(T.leaf(x, True)) for x in xs]  # replayed, replayed in slot 1, eager
    for i in (1, 0, 2):  # backwards in another order than the calls
        T.loss(ys[i]).backward()
    for x in xs:
        T.loss(ref(T.leaf(x, True))).backward()
    for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
        assert T.equal(T.grad(p), T.grad(p_ref)), f"grad of {name}"
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"backward_pending": 1} and s.replays == 3 and s.backward_replays == 3
    assert (s.keys, s.graphs, s.captures) == (1, 4, 2)
    warnings = graph_warnings(caplog)
    assert len(warnings) == 1 and "its 2 previous graphed calls" in warnings[0].getMessage()
    del ys
    y4 = m(T.leaf(xs[0], True))  # the pending backwards ran: slot 0 replays again
    assert graph_opt.stats(m).replays == 4
    del y4


def test_keys_beyond_max_graphs_run_eagerly_with_one_warning(T, caplog):
    ref, m = twins(T, warmup_steps=0, dropout=0.0, max_graphs=2)
    caplog.clear()
    for rows in (2, 3, 4, 5, 2, 3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([rows, 6, T.hidden], seed=rows), seed=rows)
    s = graph_opt.stats(m)
    assert (s.keys, s.fallbacks, s.replays) == (2, 2, 4)
    assert s.fallback_reasons == {"max_graphs": 2}
    warnings = graph_warnings(caplog)
    assert len(warnings) == 1 and "max_graphs=2" in warnings[0].getMessage()


def test_dispatch_key_fn_picks_the_graph(T):
    calls = []

    def key(x):
        calls.append(1)
        return "one graph"

    ref, m = twins(T, warmup_steps=0, dropout=0.0, dispatch_key_fn=key)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    assert len(calls) == 3 and graph_opt.stats(m).keys == 1


# -- arguments and the kill switch ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, names", [
    ({"max_graphs": 0}, "max_graphs=0"),
    ({"max_graphs": 2.5}, "max_graphs=2.5"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"warmup_steps": True}, "warmup_steps=True"),
    ({"dispatch_key_fn": "shape"}, "dispatch_key_fn"),
    ({"level": 3}, "level=3"),
    ({"level": True}, "level=True"),
])
def test_bad_arguments_name_the_argument(T, kwargs, names):
    with pytest.raises(graph_opt.GraphOptInputError, match=names.replace(".", r"\.")):
        graph_opt.autocudagraph(T.block(), **kwargs)


def test_bad_targets_and_key_functions_are_clear_errors(T):
    with pytest.raises(graph_opt.GraphOptInputError, match=r"autocudagraph\(target\).*int"):
        graph_opt.autocudagraph(3)
    with pytest.raises(graph_opt.GraphOptInputError, match="pass an instance"):
        graph_opt.autocudagraph(type(T.block()))
    m = graph_opt.autocudagraph(T.block())
    with pytest.raises(graph_opt.GraphOptInputError, match="already graphed"):
        graph_opt.autocudagraph(m)
    bad = graph_opt.autocudagraph(T.block(), dispatch_key_fn=lambda x: [1])
    with pytest.raises(graph_opt.GraphOptInputError, match="dispatch_key_fn.*unhashable list"):
        bad(T.randn([2, 6, T.hidden], seed=0))


def test_graph_opt_disable_makes_it_transparent(T, monkeypatch):
    monkeypatch.setenv("GRAPH_OPT_DISABLE", "1")
    ref, m = twins(T, warmup_steps=0, dropout=0.0)
    assert "forward" not in m.__dict__  # nothing patched
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    s = graph_opt.stats(m)
    assert s.mode.startswith("disabled") and s.captures == s.replays == s.fallbacks == 0


# -- never a silently wrong gradient: autograd beyond loss.backward() -------------------------------------
def test_a_parameter_the_block_reads_without_receiving_it_gets_eager_s_gradient(T, caplog):
    """Another module's parameter, read through an attribute that is not a submodule: its .grad as eager
    gives it (torch hands it to the graphed step as an input; Paddle cannot, and runs the key eagerly)."""
    ref, ref_other = T.reading_block()
    m_plain, other = T.copy_reading(ref)
    m = graph_opt.autocudagraph(m_plain, warmup_steps=0)
    for step in range(3):
        for model, o in ((ref, ref_other), (m, other)):
            T.zero_grads(model), T.zero_grads(o)
            T.loss(model(T.leaf(T.randn([4, T.hidden], seed=step), True))).backward()
        assert T.equal(T.grad(other.weight), T.grad(ref_other.weight)), f"step {step}: the outside parameter's grad"
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert T.equal(T.grad(p), T.grad(p_ref)), f"step {step}: grad of {name}"
    s = graph_opt.stats(m)
    if s.capture_failures:  # Paddle: the graph cannot hand it a gradient; named, and eager answers
        assert "without receiving it" in s.disabled_reason and s.replays == 0
    else:
        assert s.replays == 3 and s.backward_replays == 3


def test_autograd_grad_results_are_the_caller_s_to_keep(T):
    """Two autograd.grad calls on one forward: each result is the caller's (no storage shared with the
    block's buffers, none rewritten by a later backward), and both equal eager's."""
    ref, m = twins(T, warmup_steps=0)
    kept = []
    for step in range(3):
        x = T.randn([4, 6, T.hidden], seed=step)
        xs, xs_ref = T.leaf(x, True), T.leaf(x, True)
        y, y_ref = m(xs), ref(xs_ref)
        try:
            g1 = T.autograd_grad(T.loss(y), [xs], retain_graph=True)[0]
        except Exception as exc:  # Paddle, simulated: paddle.grad cannot run inside paddle.grad
            assert "Paddle's autograd is not reentrant" in str(exc)
            return
        g2 = T.autograd_grad(T.loss(y * 2.0), [xs])[0]
        r1 = T.autograd_grad(T.loss(y_ref), [xs_ref], retain_graph=True)[0]
        r2 = T.autograd_grad(T.loss(y_ref * 2.0), [xs_ref])[0]
        assert T.equal(g1, r1) and T.equal(g2, r2)
        kept.append((g1, r1))
    for g, r in kept:  # later replays rewrote the buffers: the kept results are still eager's
        assert T.equal(g, r)


def test_gradients_handed_to_hooks_are_theirs_to_keep(T):
    """A tensor hook on a non-leaf input, and a module backward hook, keep the gradients they get."""
    ref, m = twins(T, warmup_steps=0)
    kept = {id(ref): [], id(m): []}
    for model in (ref, m):
        if T.module_backward_hook is not None:
            T.module_backward_hook(model, lambda g, model=model: kept[id(model)].append(g))
    tensor_kept = {id(ref): [], id(m): []}
    for step in range(3):
        for model in (ref, m):
            x = T.leaf(T.randn([4, 6, T.hidden], seed=step), True)
            h = x * 1.5  # a non-leaf input: its gradient goes to the hook, then on to x
            T.tensor_hook(h, lambda g, model=model: tensor_kept[id(model)].append(g))
            T.loss(model(h)).backward()
    for a, b in zip(tensor_kept[id(m)], tensor_kept[id(ref)]):
        assert T.equal(a, b), "a tensor hook's gradient changed after a later backward"
    for a, b in zip(kept[id(m)], kept[id(ref)]):
        assert T.equal(a, b), "a module backward hook's gradient changed after a later backward"
    assert len(tensor_kept[id(m)]) == 3 and graph_opt.stats(m).backward_replays == 3


def test_state_the_forward_writes_is_written_once_per_call(T):
    """Batch norm's running statistics (and num_batches_tracked) after steps with a capture among them."""
    ref = T.norm_block()
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=1)
    for step in range(4):
        for model in (ref, m):
            T.loss(model(T.leaf(T.randn([8, T.hidden], seed=step), True))).backward()
        for b, b_ref in zip(T.buffers(m), T.buffers(ref)):
            assert T.equal(b, b_ref), f"step {step}: a buffer the forward writes differs"
    assert graph_opt.stats(m).replays == 3


def test_a_parameter_frozen_or_unfrozen_after_capture_gets_eager_s_gradient(T):
    """Frozen after capture: no gradient, no crash; unfrozen again: eager's gradient (the trainable set is
    part of what the graphs were captured for, so a change recaptures)."""
    ref, m = twins(T, warmup_steps=0)
    for step, trainable in enumerate((True, False, False, True, True)):
        for model in (ref, m):
            T.set_trainable(T.first_weight(model), trainable)
            T.zero_grads(model)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    s = graph_opt.stats(m)
    assert s.recaptures == 2 and s.replays == 5 and s.fallbacks == 0


def test_a_graph_captured_in_training_mode_is_not_replayed_in_eval_mode(T):
    """Dropout on, then model.eval() with grad still enabled: eval's output and gradients."""
    ref, m = twins(T, warmup_steps=0, dropout=0.5)
    for model in (ref, m):
        model.eval()
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    for model in (ref, m):
        model.train()
    for step in range(2):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    assert graph_opt.stats(m).keys == 2  # one per mode


def test_a_graphed_module_survives_pickling(T):
    ref, m = twins(T, warmup_steps=0)
    x = T.randn([4, 6, T.hidden], seed=1)
    assert_same_step(T, ref, m, x, seed=0)
    twin = T.save_load(m)
    assert graph_opt.stats(twin).captures == 0  # graphed again, nothing captured yet
    for step in range(2):
        T.zero_grads(ref), T.zero_grads(twin)
        assert_same_step(T, ref, twin, T.randn([4, 6, T.hidden], seed=10 + step), seed=step)
    assert graph_opt.stats(twin).replays == 2


def _train_step(T, model, x, grad=True):
    xin = T.leaf(x, grad)
    out = model(xin)
    T.loss(out).backward()
    return out, xin


def test_a_submodule_replaced_or_a_parameter_added_after_capture_is_captured_again(T, caplog):
    """A new head (a submodule replaced) and a LoRA-style parameter added mid-training: the graphs read
    the tensors they were captured with, so either change drops them; eager's outputs and gradients."""
    ref, m = twins(T, warmup_steps=0)
    for step in range(5):
        if step == 1:
            for model in (ref, m):
                T.replace_down(model, seed=7)
        if step == 3:
            for model in (ref, m):
                T.add_lora(model, seed=9)
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    s = graph_opt.stats(m)
    assert s.recaptures == 2 and s.replays == 5 and s.fallbacks == 0
    assert any("replaced or added" in r.getMessage() for r in graph_warnings(caplog))


def test_leaves_given_one_gradient_tensor_each_keep_their_own(T):
    """`lin(x) + pos + seg`: autograd gives pos and seg one gradient tensor (the incoming one). Scaling
    each parameter's .grad in place, as gradient clipping does, must scale each once."""
    ref = T.embeddings_block(rows=4)
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=0)
    for step in range(3):
        for model in (ref, m):
            T.zero_grads(model)
            _train_step(T, model, T.randn([4, T.hidden], seed=step))
            T.scale_grads_in_place(model, 0.5)
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert same_grad(T, T.grad(p), T.grad(p_ref)), f"step {step}: grad of {name}"
    assert graph_opt.stats(m).backward_replays == 3


def test_an_output_the_loss_leaves_out_gives_its_parameters_no_gradient(T):
    """A multi-task block whose auxiliary head is in the loss every other step, and which passes its
    input through: on the other steps the head's parameters have no gradient, as in eager (an optimizer
    skips them; a zero gradient would decay and move them)."""
    ref = T.heads_block()
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=0)
    for step in range(4):
        grads = {}
        for model in (ref, m):
            T.zero_grads(model)
            xin = T.leaf(T.randn([4, T.hidden], seed=step), True)
            skip, cls, aux = model(xin)
            loss = T.loss(cls) + T.loss(skip) * 0.5
            if step % 2:
                loss = loss + T.loss(aux)
            loss.backward()
            grads[id(model)] = (skip, T.grad(xin))
        (skip, gx), (skip_ref, gx_ref) = grads[id(m)], grads[id(ref)]
        assert T.equal(skip, skip_ref) and T.equal(gx, gx_ref), f"step {step}: the passed-through input or its grad"
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            got, want = T.grad(p), T.grad(p_ref)
            assert same_grad(T, got, want), f"step {step}: grad of {name}: " + (
                f"{'None' if got is None else 'set'} vs eager's {'None' if want is None else 'set'}"
                if got is None or want is None else f"differs by {T.max_diff(got, want)}")
    s = graph_opt.stats(m)
    assert (s.backward_replays, s.graphs) == (4, 3)  # forward, backward, backward without the head


def test_an_output_the_loss_leaves_out_adds_no_nan_to_the_gradients(T):
    """A block that also returns a logged statistic (the RMS of each scaled input row; zero on a padding
    row, where sqrt's derivative is infinite). Steps whose loss leaves it out get eager's gradients, not
    the NaN of 0 * inf, from a backward graph of their own captured at the first such step, after an
    optimizer step and input copies (a capture through the kept autograd graph checks no versions)."""
    ref = T.monitored_block()
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=0)
    opts = {id(ref): T.sgd(ref), id(m): T.sgd(m)}
    for step, logged in enumerate((False, False, True, False, False)):
        x = T.randn([4, T.hidden], seed=step)
        if not logged:
            x = T.zero_row(x, 2)  # a padding row: its RMS's gradient would be NaN
        grads = {}
        for model in (ref, m):
            T.zero_grads(model)
            xin = T.leaf(x, True)
            y, rms = model(xin)
            loss = T.loss(y) + (T.loss(rms) if logged else 0)
            loss.backward()
            grads[id(model)] = (y, rms, T.grad(xin))
            opts[id(model)].step()
        for got, want in zip(grads[id(m)], grads[id(ref)]):
            assert T.equal(got, want), f"step {step}: differs by {T.max_diff(got, want)}"
        for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
            assert same_grad(T, T.grad(p), T.grad(p_ref)), f"step {step}: grad of {name}"
            assert T.equal(p, p_ref), f"step {step}: {name} after the optimizer step"
    s = graph_opt.stats(m)
    assert (s.replays, s.backward_replays) == (5, 5)
    assert s.graphs == 3  # forward, backward of both outputs, backward of the first alone


def test_a_plain_attribute_set_after_capture_is_captured_again(T, caplog):
    """`block.temperature = 2.0` between steps (a schedule): the graphs baked the value the forward read,
    so they are captured again (one warning, recaptures); setting an equal value changes nothing."""
    ref = T.monitored_block()
    m = graph_opt.autocudagraph(T.copy_block(ref), warmup_steps=0)
    for step, temperature in enumerate((1.0, 1.0, 2.0, 2.0, 0.5, 0.5)):
        for model in (ref, m):
            model.temperature = float(temperature)  # a new float object each time
        x = T.randn([4, T.hidden], seed=step)
        got = []
        for model in (ref, m):
            T.zero_grads(model)
            xin = T.leaf(x, True)
            y, rms = model(xin)
            (T.loss(y) + T.loss(rms)).backward()
            got.append([y, T.grad(xin)] + [T.grad(p) for _, p in T.named_params(model)])
        for a, b in zip(*got):
            assert T.equal(a, b), f"step {step} (temperature {temperature}): differs by {T.max_diff(a, b)}"
    s = graph_opt.stats(m)
    assert (s.recaptures, s.captures, s.replays) == (2, 3, 6), s
    assert any("plain attribute" in r.getMessage() for r in graph_warnings(caplog))


def test_a_graphed_function_trains_the_module_it_calls_on_data_without_grad(T, caplog):
    """`autocudagraph(lambda x: tanh(lin(x)))` on a data batch: the function receives no tensor that
    requires grad, yet lin's parameters get eager's gradients (or, where the graph cannot hand them
    out, the key runs eagerly and says why)."""
    lin, lin_ref = T.linear_pair()
    f = graph_opt.autocudagraph(lambda x: T.tanh(lin(x)), warmup_steps=0)
    for step in range(3):
        for fn, layer in ((lambda x: T.tanh(lin_ref(x)), lin_ref), (f, lin)):
            T.zero_grads(layer)
            _train_step(T, fn, T.randn([4, T.hidden], seed=step), grad=False)
        for (name, p_ref), (_, p) in zip(T.named_params(lin_ref), T.named_params(lin)):
            assert same_grad(T, T.grad(p), T.grad(p_ref)) and T.grad(p) is not None, f"step {step}: grad of {name}"
    s = graph_opt.stats(f)
    if s.capture_failures:  # Paddle: the graph cannot hand them a gradient; named, and eager answers
        assert "without receiving it" in s.disabled_reason
    else:
        assert s.replays == 3 and s.backward_replays == 3


def test_a_key_function_keeps_the_inputs_requires_grad_flags_in_the_key(T):
    """A dispatch_key_fn that ignores the inputs: an input that starts requiring grad after capture
    still gets eager's gradient (a graph computes the gradients it was captured for)."""
    ref, m = twins(T, warmup_steps=0, dispatch_key_fn=lambda *args, **kwargs: "one")
    for step, grad in enumerate((False, True, False, True)):
        x = T.randn([4, 6, T.hidden], seed=step)
        T.zero_grads(ref), T.zero_grads(m)
        (y_ref, x_ref), (y, xin) = _train_step(T, ref, x, grad), _train_step(T, m, x, grad)
        assert T.equal(y, y_ref)
        assert same_grad(T, T.grad(xin), T.grad(x_ref)), f"step {step}: the input's grad"
    assert graph_opt.stats(m).keys == 2


def test_a_change_before_a_new_key_s_capture_drops_the_other_keys_graphs(T):
    """Two shapes captured with a frozen layer; the layer unfrozen; a third shape first, then the two
    again: every call eager's gradients (a capture must not make the others' graphs look current)."""
    ref, m = twins(T, warmup_steps=0)
    for model in (ref, m):
        T.set_trainable(T.first_weight(model), False)
    for step, rows in enumerate((4, 2, 4)):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([rows, 6, T.hidden], seed=step), seed=step)
    for model in (ref, m):
        T.set_trainable(T.first_weight(model), True)
    for step, rows in enumerate((3, 4, 2, 4)):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([rows, 6, T.hidden], seed=10 + step), seed=step)
    assert graph_opt.stats(m).recaptures == 1
