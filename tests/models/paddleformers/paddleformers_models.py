"""PaddleFormers models through graph_opt on Paddle CPU, with simulated graphs, as a user wraps them.

Run by tests/models/test_paddleformers.py in a process of its own, with PaddleFormers' dependencies on
its path (PaddleFormers pins an older transformers than the Hugging Face torch tests use). Models are
built from small configs with random weights (`fuse_rms_norm=False`: the fused kernel is GPU-only);
the eager reference is the undecorated wrapper class with the same weights.
"""
import dataclasses
import importlib.util
import sys
import types

import pytest

paddle = pytest.importorskip("paddle")
paddleformers = pytest.importorskip("paddleformers")


def _without_paddlefleet():
    """PaddleFormers 1.2.0's qwen2 module imports its PaddleFleet model provider at load, and PaddleFleet is
    on no package index. Only Qwen2ForCausalLM is built through it: Qwen2Model and the Qwen2ForXxx heads
    are plain Paddle layers. Where PaddleFleet is missing, the provider module is a stand-in whose base
    class no model here reaches."""
    name = "paddleformers.transformers.gpt_provider"
    if importlib.util.find_spec("paddlefleet") is None and name not in sys.modules:
        module = types.ModuleType(name)
        module.GPTModelProvider = dataclasses.dataclass(type("GPTModelProvider", (), {}))
        sys.modules[name] = module


_without_paddlefleet()

import graph_opt  # noqa: E402
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config  # noqa: E402
from paddleformers.transformers.cache_utils import DynamicCache  # noqa: E402
from paddleformers.transformers.configuration_utils import PretrainedConfig  # noqa: E402
from paddleformers.transformers.qwen2.modeling import Qwen2ForTokenClassification  # noqa: E402

VOCAB, SEQ, SIZES = 128, 8, [1, 2, 4]

# The documented workaround for SOT at level 1 (docs/paddle.md): dy2static recurses in the config's get()
paddle.jit.not_to_static(PretrainedConfig.get)


def _model(name):
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, fuse_rms_norm=False)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**small))
    if name == "qwen2":  # Qwen2's decoder with a token head over the vocabulary: logits or the loss first
        return Qwen2ForTokenClassification(Qwen2Config(**small, num_labels=VOCAB, classifier_dropout=0.0))
    raise ValueError(name)


MODELS = ["llama", "qwen2"]


class Logits(paddle.nn.Layer):
    """A user's serving wrapper: token ids in, logits out."""

    def __init__(self, name, graph_opt_config=None):
        super().__init__()
        self.model = _model(name)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False)[0]


def tokens(n, seed):
    paddle.seed(seed)
    return paddle.randint(0, VOCAB, [n, SEQ])


def decorated_twins(name, **settings):
    paddle.seed(0)
    twin = Logits(name)
    twin.eval()
    cls = graph_opt.support_graph_optimization(type(f"Graphed{name}", (Logits,), {}))
    m = cls(name, graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=SIZES, **settings))
    m.set_state_dict(twin.state_dict())
    m.eval()
    return m, twin


MODES = [
    pytest.param(dict(graph_opt_level=0, full_cuda_graph=True), id="level0-full"),
    pytest.param(dict(graph_opt_level=0, full_cuda_graph=False), id="level0-piecewise"),
    pytest.param(dict(graph_opt_level=1, full_cuda_graph=True), id="level1-full"),
    pytest.param(dict(graph_opt_level=1, full_cuda_graph=False), id="level1-piecewise"),
]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("settings", MODES)
def test_inference_replays_equal_eager(name, settings):
    """Every captured size replays; a padded call's real rows equal eager on the padded batch bitwise
    and eager on the real rows within 1e-5; no SOT translation after capture."""
    m, twin = decorated_twins(name, **settings)
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda n: tokens(n, n), progress=False)
        assert report.failed is None, report.failed
        translated = graph_opt.stats(m).translations
        with paddle.no_grad():
            for n in (4, 3, 2, 1):
                x = tokens(n, 10 + n)
                out = m(x)
                padded = paddle.concat([x, paddle.zeros([1, SEQ], dtype=x.dtype)]) if n == 3 else x
                on_padded = twin(padded)[:n]
                assert bool((out == on_padded).all()), f"{n} rows against eager on the padded batch"
                assert float((out - twin(x)).abs().max()) <= 1e-5, f"{n} rows against eager on the real rows"
    s = graph_opt.stats(m)
    assert s.replays == 4 and s.fallbacks == 0, s.fallback_reasons
    assert s.translations == translated, "a call after capture translated again"
    assert (translated > 0) == (settings["graph_opt_level"] == 1)  # level 1 ran through SOT


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
def test_calls_with_autograd_on_at_level_1_have_eager_gradients(name, graphs):
    """Such calls run without graphs, answered by the plain forward: through SOT's program (bare
    paddle.jit.to_static too, Paddle 3.3.1) most of this model's parameters got no gradient."""
    m, twin = decorated_twins(name, graph_opt_level=1, full_cuda_graph=True, use_cudagraph=graphs)
    with graph_opt.testing.simulate_cuda_graphs():
        if graphs:
            graph_opt.capture_model(m, lambda n: tokens(n, n), progress=False)
        x = tokens(3, 5)
        out, ref = m(x), twin(x)
        assert bool((out == ref).all())
        out.sum().backward()
        ref.sum().backward()
    for (pname, p_ref), (_, p) in zip(twin.named_parameters(), m.named_parameters()):
        assert p.grad is not None and bool((p.grad == p_ref.grad).all()), f"gradient of {pname}"
    assert graph_opt.stats(m).fallback_reasons == ({"grad": 1} if graphs else {})


class Decode(paddle.nn.Layer):
    """A user's decode step with a KV cache: a token per row and the cache tensors in (the cache objects are
    not tensors), PaddleFormers' DynamicCache built from them in forward, as one passes a cache to the model."""

    def __init__(self, name, graph_opt_config=None):
        super().__init__()
        self.model = _model(name)

    def forward(self, input_ids, keys, values):
        cache = DynamicCache(list(zip(keys, values)))
        return self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)[0]


def decode_inputs(n, seed, cached=5):
    paddle.seed(seed)
    kv = [[paddle.randn([n, 2, cached, 8]) for _ in range(2)] for _ in ("keys", "values")]  # 2 layers, 2 kv heads
    return dict(input_ids=paddle.randint(0, VOCAB, [n, 1]), keys=kv[0], values=kv[1])


@pytest.mark.parametrize("level", [0, 1])
def test_a_cache_object_built_in_forward_from_the_cache_tensors_replays(level):
    """The DynamicCache is a new object at every call: compared by its content, not its identity, every
    call replays (at level 1 SOT's guards compare it by identity: it used to run without graphs each call,
    translated anew), bitwise equal to eager on the padded batch, with no translation after capture."""
    paddle.seed(0)
    twin = Decode("llama")
    twin.eval()
    cls = graph_opt.support_graph_optimization(type("GraphedDecode", (Decode,), {}))
    m = cls("llama", graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=[2, 4], graph_opt_level=level))
    m.set_state_dict(twin.state_dict())
    m.eval()
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda n: decode_inputs(n, n), progress=False)
        assert report.failed is None, report.failed
        translated = graph_opt.stats(m).translations
        with paddle.no_grad():
            for n in (4, 3, 2, 4):
                call = decode_inputs(n, 10 + n)
                out = m(**call)
                padded = call
                if n == 3:  # the same rows, and a row of the pad value (0) after them
                    padded = {k: [paddle.concat([t, paddle.zeros([1] + t.shape[1:], t.dtype)]) for t in v]
                              if isinstance(v, list) else paddle.concat([v, paddle.zeros([1, 1], v.dtype)])
                              for k, v in call.items()}
                assert bool((out == twin(**padded)[:n]).all()), n
    s = graph_opt.stats(m)
    assert (s.replays, s.fallbacks) == (4, 0), s.fallback_reasons
    assert s.translations == translated


class Loss(paddle.nn.Layer):
    """A user's training block: token ids and labels in, the model's loss out."""

    def __init__(self, name):
        super().__init__()
        self.model = _model(name)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels)[0]


@pytest.mark.parametrize("name", MODELS)
def test_training_steps_with_autocudagraph_equal_eager(name, steps=3):
    """SGD steps through training graphs: the loss and every parameter bitwise eager's."""
    paddle.seed(0)
    ref = Loss(name)
    block = Loss(name)
    block.set_state_dict(ref.state_dict())
    with graph_opt.testing.simulate_cuda_graphs():
        m = graph_opt.autocudagraph(block, warmup_steps=1)
        opt_ref = paddle.optimizer.SGD(learning_rate=0.1, parameters=ref.parameters())
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=m.parameters())
        for step in range(steps):
            ids = tokens(4, 20 + step)
            losses = []
            for model, o in ((ref, opt_ref), (m, opt)):
                loss = model(ids, ids)
                loss.backward()
                o.step()
                o.clear_grad()
                losses.append(loss)
            assert bool((losses[0] == losses[1]).all()), f"step {step}: loss"
            for (pname, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
                assert bool((p == p_ref).all()), f"step {step}: parameter {pname}"
    s = graph_opt.stats(m)
    assert s.replays == steps - 1 and s.backward_replays == steps - 1, s
