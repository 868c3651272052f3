"""Hugging Face models through graph_opt, as a user wraps them: written once, run on CPU with simulated
graphs (tests/models/test_hf_models.py) and on a CUDA device (tests/gpu/test_gpu_hf_models.py).

Each model is built from a small config with random weights (nothing is downloaded) inside a thin user
module; the eager reference is the undecorated wrapper class with the same weights. A test module
takes these tests (sections.shared_tests) and defines the fixture `env`: its device, `env.graphs()`, where captures run, and
`env.tolerance`: 0 where replays are bitwise eager's (CPU), else the largest difference allowed (on a
GPU, replays of Llama, Qwen2 and BERT with SDPA attention differ from eager in the last bits: up to
1.1e-7 in float32 measured on an H200; GPT-2 bitwise).
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import graph_opt  # noqa: E402
from graph_opt.decorator import state_of  # noqa: E402

VOCAB, SEQ, SIZES = 128, 16, [1, 2, 4]


def _configs():
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return {
        "llama": (transformers.LlamaForCausalLM,
                  transformers.LlamaConfig(**small, num_key_value_heads=2, max_position_embeddings=64)),
        "gpt2": (transformers.GPT2LMHeadModel,
                 transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "qwen2": (transformers.Qwen2ForCausalLM,
                  transformers.Qwen2Config(**small, num_key_value_heads=2, max_position_embeddings=64)),
        "bert": (transformers.BertForMaskedLM, transformers.BertConfig(**small, max_position_embeddings=64)),
    }


MODELS = list(_configs())


class Logits(torch.nn.Module):
    """A user's serving wrapper: token ids in, logits out."""

    def __init__(self, name, attention=None):
        super().__init__()
        cls, config = _configs()[name]
        if attention is not None:
            config._attn_implementation = attention
        self.causal = name != "bert"
        self.model = cls(config)

    def forward(self, input_ids):
        if self.causal:
            return self.model(input_ids=input_ids, use_cache=False).logits
        return self.model(input_ids=input_ids).logits


class LogitsOrHidden(Logits):
    """A serving wrapper whose callers sometimes ask for the last hidden state (a debugging call)."""

    def forward(self, input_ids, output_hidden_states=False):
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=output_hidden_states)
        return (out.logits, out.hidden_states[-1]) if output_hidden_states else out.logits


class Loss(torch.nn.Module):
    """A user's training block: token ids and labels in, the model's loss out."""

    def __init__(self, name, attention=None):
        super().__init__()
        cls, config = _configs()[name]
        if name == "bert":
            # Dropout inside SDPA on a GPU drew other masks in a replay than in eager (the loss differed at
            # the first replay, far beyond rounding): not comparable. Hidden dropout stays.
            config.attention_probs_dropout_prob = 0.0
        if attention is not None:
            config._attn_implementation = attention
        self.model = cls(config)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


class LossAndLogits(Loss):
    """A training block that also returns the logits, for metrics: the loss alone is backpropagated."""

    def forward(self, input_ids, labels):
        out = self.model(input_ids=input_ids, labels=labels)
        return out.loss, out.logits


def same(env, a, b, rtol=0.0) -> bool:
    if env.tolerance == 0:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=rtol, atol=env.tolerance)


def tokens(env, n, seed):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed)).to(env.device)


def decorated_twins(env, name, wrapper=None, attention=None, **settings):
    """(the decorated user wrapper, its undecorated twin with the same weights); wrapper: Logits;
    attention: the models' attn_implementation, where not the default."""
    wrapper = wrapper or Logits
    torch.manual_seed(0)
    twin = wrapper(name, attention=attention).eval().to(env.device)
    cls = graph_opt.support_graph_optimization(type(f"Graphed{name}", (wrapper,), {}))
    config = graph_opt.GraphOptConfig(cudagraph_capture_sizes=SIZES, **settings)
    m = cls(name, attention=attention, graph_opt_config=config).eval().to(env.device)
    m.load_state_dict(twin.state_dict())
    return m, twin


MODES = [
    pytest.param(dict(graph_opt_level=0, full_cuda_graph=True), id="level0-full"),
    pytest.param(dict(graph_opt_level=0, full_cuda_graph=False), id="level0-piecewise"),
    pytest.param(dict(graph_opt_level=1, full_cuda_graph=True), id="level1-full"),
    pytest.param(dict(graph_opt_level=1, full_cuda_graph=False), id="level1-piecewise"),
    pytest.param(dict(graph_opt_level=2, full_cuda_graph=True), id="level2-full", marks=pytest.mark.inductor),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("settings", MODES)
def test_inference_replays_equal_eager(env, name, settings):
    """Every captured size replays; a call of a captured size equals eager bitwise (levels 0 and 1),
    a padded call's real rows equal eager on the padded batch bitwise and eager on the real rows within
    1e-5; no translation happens after capture."""
    m, twin = decorated_twins(env, name, **settings)
    with env.graphs():
        report = graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False)
    assert report.failed is None, report.failed
    if settings["graph_opt_level"] >= 1 and settings["full_cuda_graph"]:
        # transformers' forwards store constants into its output collector after the graph: the replay
        # makes those stores itself and is the graph's replay() alone (direct_replay.constant_stores)
        assert state_of(m).runner.strategy.direct_replays == len(SIZES)
    translated = graph_opt.stats(m).translations
    exact = settings["graph_opt_level"] < 2
    if env.tolerance:  # what bitwise means on this device (see the module's docstring)
        exact = exact and name == "gpt2"
    with torch.no_grad():
        for n in (4, 3, 2, 1):
            x = tokens(env, n, 10 + n)
            out = m(x)
            padded = torch.cat([x, torch.zeros(4 - n if n == 3 else 0, SEQ, dtype=x.dtype, device=x.device)])
            on_padded = twin(padded)[:n]
            close = torch.allclose(out, on_padded, rtol=0, atol=1e-5)
            assert (torch.equal(out, on_padded) if exact else close), f"{n} rows against eager on the padded batch"
            assert torch.allclose(out, twin(x), rtol=0, atol=1e-5), f"{n} rows against eager on the real rows"
    s = graph_opt.stats(m)
    assert s.replays == 4 and s.fallbacks == 0, s.fallback_reasons
    assert s.translations == translated, "a call after capture translated again"


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_inference_with_eager_attention_replays_at_level_1(env, name, full):
    """attn_implementation="eager": transformers' mask code makes a device tensor from a Python number
    (`torch.tensor(0.0, device=...)`), which a capture of the eager forward (level 0) refuses on a device.
    Level 1 makes it once when it traces (backends/torch/host_constants.py): every size captures, and the
    replays equal the eager twin (bitwise at a captured size where env.tolerance is 0)."""
    m, twin = decorated_twins(env, name, attention="eager", graph_opt_level=1, full_cuda_graph=full)
    with env.graphs():
        report = graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False)
    assert report.failed is None, report.failed
    with torch.no_grad():
        for n in (4, 2, 3):
            x = tokens(env, n, 40 + n)
            out, want = m(x), twin(x)
            assert same(env, out, want) if n != 3 else torch.allclose(out, want, rtol=0, atol=1e-5), f"{n} rows"
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallbacks == 0, s.fallback_reasons


def _sgd_steps(env, ref, m, steps, check):
    """SGD steps of the eager twin and the graphed block on the same tokens and seeds; check(step,
    losses) after each. A (loss, logits) output backpropagates the loss alone."""
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
    for step in range(steps):
        x = tokens(env, 2, step)
        losses = []
        for model, o in zip((ref, m), opts):
            o.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            loss = model(x, x)
            if isinstance(loss, tuple):
                loss, logits = loss
                assert logits.requires_grad
            loss.backward()
            o.step()
            losses.append(loss.detach())
        check(step, losses)


def _as_eager(env, ref, m):
    """check(step, losses) of _sgd_steps: the loss and every parameter equal the eager twin's."""
    def check(step, losses):
        assert same(env, losses[0], losses[1], rtol=1e-5), f"step {step}: loss"
        for (pname, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert same(env, p, p_ref, rtol=1e-5), f"step {step}: {pname}"
    return check


@pytest.mark.parametrize("name,wrapper", [("bert", Loss), ("gpt2", Loss), ("llama", Loss), ("gpt2", LossAndLogits)])
def test_training_steps_with_autocudagraph_equal_eager(env, name, wrapper, steps=3):
    """Dropout on (BERT's and GPT-2's 0.1), SGD steps: loss and parameters eager's with the same seeds
    (bitwise, or within env.tolerance where attention kernels differ). With the logits returned beside
    the loss and left out of it, the backward replays a graph of the loss alone."""
    torch.manual_seed(0)
    ref = wrapper(name).train().to(env.device)
    with env.graphs():
        m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)
        _sgd_steps(env, ref, m, steps, _as_eager(env, ref, m))
    s = graph_opt.stats(m)
    assert s.captures == 1 and s.replays == steps - 1 and s.fallbacks == 0, s
    assert s.graphs == 2 + (wrapper is LossAndLogits), s  # and a backward of the loss alone


def test_traced_training_of_bert_with_eager_attention(env, steps=4):
    """BERT with attn_implementation="eager": its mask code makes a device tensor from a Python number
    (`torch.tensor(0.0, device=...)`), which a capture of the eager forward refuses on a device. Traced
    (autocudagraph level 1, and level 2 where env.levels has it) it is graphed; loss and parameters
    after SGD steps are eager's: at level 1 within env.tolerance, hidden dropout on; at level 2 within
    Inductor's rounding (1e-4 relative, 1e-6 absolute), dropout off (Inductor draws its own masks)."""
    for level in env.levels:
        torch._dynamo.reset()
        torch.manual_seed(0)
        ref = Loss("bert", attention="eager").train().to(env.device)
        if level == 2:
            for mod in ref.modules():
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.0
        block = copy.deepcopy(ref)

        def check(step, losses, level=level):
            for (pname, p_ref), (_, p) in [(("loss", losses[0]), ("loss", losses[1]))] + \
                    list(zip(ref.named_parameters(), m.named_parameters())):
                ok = same(env, p, p_ref, rtol=1e-5) if level == 1 else torch.allclose(p, p_ref, rtol=1e-4, atol=1e-6)
                assert ok, f"level {level} step {step}: {pname} differs by {(p - p_ref).abs().max().item()}"

        with env.graphs():
            m = graph_opt.autocudagraph(block, level=level)
            _sgd_steps(env, ref, m, steps, check)
        s = graph_opt.stats(m)
        assert s.captures == 1 and s.replays == steps - 2 and s.fallbacks == 0, s


def test_a_model_s_loss_and_logits_are_traced_together_at_level_1(env, steps=4):
    """`labels=` makes a model return (loss, logits), both carrying gradients: the loss is computed from
    the logits, so level 1 traces the key (a traced backward's zeros for the logits add to gradients
    computed anyway); loss and parameters after SGD steps are eager's (dropout on)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = LossAndLogits("gpt2").train().to(env.device)
    with env.graphs():
        m = graph_opt.autocudagraph(copy.deepcopy(ref), level=1)
        _sgd_steps(env, ref, m, steps, _as_eager(env, ref, m))
    s = graph_opt.stats(m)
    assert s.key_levels == {1: 1} and s.replays == steps - 2 and s.fallbacks == 0, s


class WholeOutput(Loss):
    """A hand-written loop's block that returns the model's whole output: a causal LM in train mode returns
    its DynamicCache too, unless called with use_cache=False."""

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels)


def test_a_causal_lm_returning_its_cache_says_use_cache_false(env, caplog):
    """The cache object holds this step's tensors and cannot be rebuilt from a replay's: the capture is
    refused, one warning names use_cache=False, and the steps are eager's."""
    torch.manual_seed(0)
    ref = WholeOutput("llama").train().to(env.device)
    block = copy.deepcopy(ref)
    caplog.set_level("WARNING", logger="graph_opt")

    def check(step, losses):
        assert same(env, losses[0], losses[1], rtol=1e-5), f"step {step}: loss"

    with env.graphs():
        m = graph_opt.autocudagraph(block)
        opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
        for step in range(3):
            x = tokens(env, 2, step)
            losses = []
            for model, o in zip((ref, m), opts):
                o.zero_grad(set_to_none=True)
                torch.manual_seed(100 + step)
                loss = model(x, x).loss
                loss.backward()
                o.step()
                losses.append(loss.detach())
            check(step, losses)
    said = [r.getMessage() for r in caplog.records if r.name == "graph_opt"]
    assert len(said) == 1 and "DynamicCache" in said[0] and "use_cache=False" in said[0], said
    assert graph_opt.stats(m).captures == 0


@pytest.mark.parametrize("level", [0, 1])
def test_a_call_asking_for_hidden_states_leaves_the_other_calls_replaying(env, level):
    """transformers installs its output-capturing hooks at the first call that asks for hidden states,
    here one that runs without graphs (a value capture_model did not capture). The hooks do nothing
    unless a call asks: the graphs keep replaying, and every call equals eager."""
    m, twin = decorated_twins(env, "llama", LogitsOrHidden, graph_opt_level=level)
    with env.graphs():
        assert graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False).failed is None
    with torch.no_grad():
        for step in range(3):
            x = tokens(env, 4, step)
            assert same(env, m(x), twin(x)), f"step {step}"
            logits, hidden = m(x, output_hidden_states=True)
            want_logits, want_hidden = twin(x, output_hidden_states=True)
            assert same(env, logits, want_logits) and same(env, hidden, want_hidden), f"step {step}, hidden states"
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallback_reasons == {"new_signature": 3}, s.fallback_reasons


# -- the model's transformers config changed after capture, at level 1 (Dynamo's guards see it) ---------
def _captured_level_1(env, name):
    m, twin = decorated_twins(env, name, graph_opt_level=1, full_cuda_graph=True)
    with env.graphs():
        assert graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False).failed is None
    return m, twin


def _calls_equal(env, m, twin, what):
    """Calls of 4 and 3 rows against the twin on the rows the call ran: a replay of 3 rows runs them padded
    with rows of token 0 (the pad value) to 4, which eager on 3 rows alone may round otherwise."""
    with torch.no_grad():
        for n in (4, 3):
            x = tokens(env, n, 20 + n)
            replays = graph_opt.stats(m).replays
            out = m(x)
            if graph_opt.stats(m).replays > replays:
                x = torch.cat([x, x.new_zeros(SIZES[-1] - n, SEQ)])
            assert same(env, out, twin(x)[:n]), f"{what}, {n} rows"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_config_attribute_changed_after_capture_runs_without_graphs_until_restored(env, name, graph_opt_warnings):
    """_attn_implementation switched to eager attention on both twins: every call equals the twin's,
    without graphs and with one warning that names the attribute; set back, the graphs replay again."""
    m, twin = _captured_level_1(env, name)
    _calls_equal(env, m, twin, "as captured")
    replays = graph_opt.stats(m).replays
    for model in (m, twin):
        model.model.config._attn_implementation = "eager"
    _calls_equal(env, m, twin, "eager attention")
    s = graph_opt.stats(m)
    assert s.replays == replays and s.fallback_reasons == {"guard": 2}, s.fallback_reasons
    assert any("_attn_implementation" in w and "config" in w for w in graph_opt_warnings()), graph_opt_warnings()
    for model in (m, twin):
        model.model.config._attn_implementation = "sdpa"
    _calls_equal(env, m, twin, "sdpa again")
    assert graph_opt.stats(m).replays == replays + 2


def test_a_config_change_kept_by_capturing_again_replays_with_it(env):
    """clear_graphs() and capture_model() after a change of an attribute the forward reads trace the
    forward anew (a capture reusing the first trace would bake two layers): the new graphs replay."""
    m, twin = _captured_level_1(env, "llama")
    for model in (m, twin):
        model.model.config.num_hidden_layers = 1  # Llama runs layers[:num_hidden_layers]
    graph_opt.clear_graphs(m)
    translations = graph_opt.stats(m).translations
    with env.graphs():
        assert graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False).failed is None
    assert graph_opt.stats(m).translations > translations, "the capture reused the first trace"
    replays = graph_opt.stats(m).replays
    _calls_equal(env, m, twin, "recaptured with one layer")
    assert graph_opt.stats(m).replays == replays + 2, graph_opt.stats(m).fallback_reasons


@pytest.mark.parametrize("change", ["replaced", "class attribute", "an attribute the forward does not read"])
def test_a_config_replaced_or_changed_through_its_class_is_seen_and_an_unread_change_keeps_replaying(env, change,
                                                                                                  monkeypatch):
    """The config object replaced by a copy with eager attention; the config's class given
    `is_causal = False` (GPT-2 asks hasattr for it: the attention then runs non-causal). Each call
    equals the twin's, without graphs, and replays resume once undone. A value in a config dict the
    forward never reads (id2label) changes nothing: the graphs keep replaying."""
    m, twin = _captured_level_1(env, "gpt2")
    replays = graph_opt.stats(m).replays
    if change == "replaced":
        originals = [model.model.config for model in (m, twin)]
        for model in (m, twin):
            model.model.config = copy.deepcopy(model.model.config)
            model.model.config._attn_implementation = "eager"
    elif change == "class attribute":
        monkeypatch.setattr(type(m.model.config), "is_causal", False, raising=False)
    else:
        for model in (m, twin):
            model.model.config.id2label[0] = "changed"
    _calls_equal(env, m, twin, change)
    s = graph_opt.stats(m)
    if change.startswith("an attribute"):
        assert s.replays == replays + 2 and not s.fallback_reasons, s.fallback_reasons
        return
    assert s.replays == replays and s.fallback_reasons == {"guard": 2}, s.fallback_reasons
    if change == "replaced":
        for model, original in zip((m, twin), originals):
            model.model.config = original
    else:
        monkeypatch.undo()
        for model in (m, twin):  # transformers' call wrapper put the class's value back on the instance
            vars(model.model.config).pop("is_causal", None)
    _calls_equal(env, m, twin, "undone")
    assert graph_opt.stats(m).replays == replays + 2


class _LowRank(torch.nn.Module):
    """A LoRA-style adapter around a projection, as adapter libraries inject one."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_an_adapter_injected_into_a_projection_runs_without_graphs_and_replays_resume_once_removed(env):
    """A low-rank adapter wrapped around layer 0's q_proj of both twins: the calls equal the twin's,
    without graphs; the adapter removed (the captured projection put back), the graphs replay again."""
    m, twin = _captured_level_1(env, "llama")
    replays = graph_opt.stats(m).replays
    projections = [model.model.model.layers[0].self_attn for model in (m, twin)]
    originals = [attn.q_proj for attn in projections]
    torch.manual_seed(3)
    adapter = _LowRank(originals[0]).to(env.device)
    twin_adapter = _LowRank(originals[1]).to(env.device)
    twin_adapter.load_state_dict(adapter.state_dict())
    projections[0].q_proj, projections[1].q_proj = adapter, twin_adapter
    _calls_equal(env, m, twin, "with the adapter")
    assert graph_opt.stats(m).replays == replays and graph_opt.stats(m).fallbacks >= 2, graph_opt.stats(m)
    for attn, original in zip(projections, originals):
        attn.q_proj = original
    _calls_equal(env, m, twin, "adapter removed")
    assert graph_opt.stats(m).replays == replays + 2, graph_opt.stats(m).fallback_reasons


def test_resize_token_embeddings_after_capture_runs_without_graphs_until_captured_again(env, graph_opt_warnings):
    """transformers' resize_token_embeddings keeps the embedding's Parameter object and swaps its data
    (and the tied head's): the graphs read the old memory. Its `.data` assigned counts as a conversion:
    the calls run without graphs, equal to the twin's, with a warning naming the weight; capturing again
    replays the grown model."""
    m, twin = _captured_level_1(env, "gpt2")
    for model in (m, twin):
        torch.manual_seed(1)
        model.model.resize_token_embeddings(VOCAB + 32)
    _calls_equal(env, m, twin, "grown")
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"converted": 2}, s.fallback_reasons
    assert any("wte.weight" in w and "capture_model() again" in w for w in graph_opt_warnings()), graph_opt_warnings()
    graph_opt.clear_graphs(m)
    with env.graphs():
        assert graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False).failed is None
    replays = graph_opt.stats(m).replays
    _calls_equal(env, m, twin, "captured again")
    assert graph_opt.stats(m).replays == replays + 2, graph_opt.stats(m).fallback_reasons


class _WritesItsConfig(Logits):
    def forward(self, input_ids):
        self.model.config.last_rows = input_ids.shape[0]  # a forward that writes its config at every call
        return super().forward(input_ids)


def test_a_forward_that_writes_its_config_replays_right(env):
    """Calls equal the twin's, the config holds the twin's value after each (a replay makes the
    forward's store itself, or the call runs without graphs), and the captured sizes replay."""
    m, twin = decorated_twins(env, "llama", _WritesItsConfig, graph_opt_level=1)
    with env.graphs():
        assert graph_opt.capture_model(m, lambda n: tokens(env, n, n), progress=False).failed is None
    with torch.no_grad():
        for n in (4, 2, 4, 1):
            x = tokens(env, n, 30 + n)
            assert same(env, m(x), twin(x)), f"{n} rows"
            assert m.model.config.last_rows == twin.model.config.last_rows == n
    assert graph_opt.stats(m).replays == 4, graph_opt.stats(m).fallback_reasons
