"""A host (CPU) tensor argument of a model on the device: a real graph bakes in what it reads of one (a
0-dim scale torch passes to its kernels, pack_padded_sequence's lengths). One classification
(graph_opt/watch/arguments.py) decides for inference and training alike: inference at level 0 replays such
an argument only with its captured value; a training block keys its graphs by the value.

On CPU every tensor is on the host and the stand-in bakes nothing, so testing.as_host_tensor() marks
the tensors the stand-in treats as host memory: these tests show the classification and its keys;
tests/gpu/test_gpu_host_arguments.py shows on real graphs that no baked value is replayed."""
import importlib.util

import pytest

import graph_opt
from graph_opt.watch import arguments
from graph_opt.testing import as_host_tensor, simulate_cuda_graphs

FRAMEWORKS = [f for f in ("torch", "paddle") if importlib.util.find_spec(f) is not None]
if not FRAMEWORKS:
    pytest.skip("needs torch or paddle", allow_module_level=True)


class _Framework:
    """What these tests need of a framework; the subclasses name its calls."""

    def scaled_block(self, seed=0):
        nn, tanh = self.nn, self.tanh

        class Scaled(nn.Module if self.name == "torch" else nn.Layer):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x, scale):
                return tanh(self.lin(x)) * scale

        self.seed(seed)
        return Scaled()

    def grads(self, model):
        return [p.grad.clone() for p in model.parameters()]

    def backward(self, y):
        y.sum().backward()


class TorchFW(_Framework):
    name = "torch"

    def __init__(self):
        import torch
        self.torch, self.nn, self.tanh, self.seed = torch, torch.nn, torch.tanh, torch.manual_seed
        torch._dynamo.reset()

    def tensor(self, value):
        return self.torch.tensor(value)

    def randn(self, *shape, seed=0, grad=False):
        g = self.torch.Generator().manual_seed(seed)
        return self.torch.randn(*shape, generator=g).requires_grad_(grad)

    def zero_grad(self, model):
        for p in model.parameters():
            p.grad = None

    def equal(self, a, b):
        return self.torch.equal(a, b)

    def no_grad(self):
        return self.torch.no_grad()


class PaddleFW(_Framework):
    name = "paddle"

    def __init__(self):
        import paddle
        self.paddle, self.nn, self.tanh, self.seed = paddle, paddle.nn, paddle.tanh, paddle.seed
        paddle.set_device("cpu")

    def tensor(self, value):
        return self.paddle.to_tensor(value)

    def randn(self, *shape, seed=0, grad=False):
        import numpy as np
        t = self.paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))
        t.stop_gradient = not grad
        return t

    def zero_grad(self, model):
        for p in model.parameters():
            p.clear_gradient(set_to_zero=False)

    def equal(self, a, b):
        return bool(self.paddle.equal_all(a, b))

    def no_grad(self):
        return self.paddle.no_grad()


@pytest.fixture
def fw(request):
    """In place of tests/conftest.py's zoo, this module's own framework calls; parametrized as there."""
    return TorchFW() if request.param == "torch" else PaddleFW()


def _twins(fw):
    """A block for autocudagraph and its undecorated twin with the same weights (the eager reference)."""
    return fw.scaled_block(seed=0), fw.scaled_block(seed=0)


def test_the_classifier_names_host_tensors_and_keys_them_by_their_bytes(fw):
    with simulate_cuda_graphs():
        adapter = graph_opt.backends.load(fw.name).ADAPTER
        x, s = fw.randn(2, 8), as_host_tensor(fw.tensor(2.0))
        assert arguments.host_positions(adapter, [x, s]) == (1,)
        nan = [as_host_tensor(fw.tensor(float("nan"))) for _ in range(2)]
        assert arguments.tensors_by_value(adapter, nan, (0, 1))[0] == arguments.tensors_by_value(adapter, nan, (1,))[0]
        zeros = [fw.tensor(0.0), fw.tensor(-0.0)]  # equal as numbers, not as what a kernel reads
        assert arguments.tensors_by_value(adapter, zeros, (0,)) != arguments.tensors_by_value(adapter, zeros, (1,))
        big = as_host_tensor(fw.randn(arguments.HOST_KEY_ELEMENTS + 1))
        found = arguments.tensors_by_value(adapter, [x, big], (1,))
        assert isinstance(found, arguments.TooLarge) and (found.index, found.elements) == (1, 4097)


@pytest.fixture(params=[(f, level) for f in FRAMEWORKS for level in (0, 1) if (f, level) != ("paddle", 1)],
                ids=lambda p: f"{p[0]}-level{p[1]}")
def fw_level(request):  # Paddle's training graphs capture level 0 only
    name, level = request.param
    return (TorchFW() if name == "torch" else PaddleFW()), level


def test_training_keys_a_host_scalar_argument_by_its_value(fw_level):
    """block(x, scale) with a CPU 0-dim scale: a graph per value, never the captured value for another.
    Without the classification this is one key, and on a device every replay multiplies by 2.0."""
    fw, level = fw_level
    ref, m = _twins(fw)
    m = graph_opt.autocudagraph(m, warmup_steps=1, level=level)
    scales = [2.0, 2.0, 3.0, 2.0, 3.0, 3.0, 2.0, 0.5, 0.5, 0.5]
    with simulate_cuda_graphs():
        for step, value in enumerate(scales):
            got = []
            for model in (ref, m):
                fw.zero_grad(model)
                x = fw.randn(4, 8, seed=step, grad=True)
                y = model(x, as_host_tensor(fw.tensor(value)))
                fw.backward(y)
                got.append((y, x.grad, fw.grads(model)))
            (y_ref, gx_ref, gp_ref), (y, gx, gp) = got
            assert fw.equal(y, y_ref) and fw.equal(gx, gx_ref), f"step {step} (scale {value})"
            assert all(fw.equal(a, b) for a, b in zip(gp, gp_ref)), f"step {step}: parameter gradients"
    s = graph_opt.stats(m)
    assert s.keys == 3, s  # 2.0, 3.0 and 0.5: each its own graphs
    assert s.replays >= 4 and s.fallbacks == 0, s


def test_training_runs_a_host_argument_too_large_to_key_eagerly_and_says_which(fw, graph_opt_warnings):
    ref, m = _twins(fw)
    m = graph_opt.autocudagraph(m, warmup_steps=0)
    n = arguments.HOST_KEY_ELEMENTS + 1
    with simulate_cuda_graphs():
        x = fw.randn(n, 8, seed=4)
        scale = fw.randn(n, 1, seed=3)
        for _ in range(2):
            assert fw.equal(m(x, as_host_tensor(scale.clone())), ref(x, scale))
        # a small one still keys, and replays
        for _ in range(3):
            assert fw.equal(m(x[:4], as_host_tensor(scale[:4].clone())), ref(x[:4], scale[:4]))
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"host_argument": 2} and s.captures == 1 and s.replays == 3, s
    said = [w for w in graph_opt_warnings() if "host (CPU) tensor" in w]
    assert len(said) == 1 and "argument 'scale'" in said[0] and f"{n} elements" in said[0], said


def _graphed_twin(fw, config):
    """A decorated subclass of the scaled block with the twin's weights, in eval mode, and the twin."""
    twin = fw.scaled_block(seed=0)
    base = type(twin)
    cls = graph_opt.support_graph_optimization(type("Graphed", (base,), {
        "__init__": lambda self, graph_opt_config=None: base.__init__(self)}))
    m = cls(graph_opt_config=config)
    m.set_state_dict(twin.state_dict()) if fw.name == "paddle" else m.load_state_dict(twin.state_dict())
    m.eval()
    twin.eval()
    return m, twin


def test_inference_at_level_0_replays_a_host_argument_only_with_its_captured_value(fw):
    """The other path of the same classification: a size captured with scale 2.0 replays calls that
    pass 2.0 and runs the others without graphs, saying why."""
    config = graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=[4])
    m, twin = _graphed_twin(fw, config)
    with simulate_cuda_graphs(), fw.no_grad():
        assert graph_opt.capture_model(m, lambda n: (fw.randn(n, 8), as_host_tensor(fw.tensor(2.0))),
                                       progress=False).failed is None
        for step, value in enumerate([2.0, 3.0, 2.0, -0.0]):
            x = fw.randn(4, 8, seed=step)
            assert fw.equal(m(x, as_host_tensor(fw.tensor(value))), twin(x, fw.tensor(value))), step
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"host_argument": 2}, s


def _writes(fw, how):
    """state.mul_(0.5) as the forward's write of its argument: in place (its version counter moves), or
    through .data (torch) / set_value (Paddle), which no version counter shows."""
    def write(state):
        if how == "in_place":
            state.scale_(0.5) if fw.name == "paddle" else state.mul_(0.5)
        elif fw.name == "torch":
            state.data.mul_(0.5)
        else:
            state.set_value(state * 0.5)
    return write


@pytest.mark.parametrize("how", ["in_place", "unversioned"])
def test_training_refuses_a_forward_that_writes_its_argument(fw, how, graph_opt_warnings):
    """A replay writes the graph's copy of an argument, never the caller's tensor: a forward that writes
    one runs eagerly, writing the caller's tensor as eager does (the key's capture fails with one warning
    naming it), like inference, which copies it back."""
    base, write = type(fw.scaled_block()), _writes(fw, how)

    class WritesState(base):
        def forward(self, x, state):
            write(state)
            return self.lin(x) + state

    m, ref = WritesState(), WritesState()
    m.set_state_dict(ref.state_dict()) if fw.name == "paddle" else m.load_state_dict(ref.state_dict())
    m = graph_opt.autocudagraph(m, warmup_steps=1)
    mine, theirs = fw.randn(4, 8, seed=1), fw.randn(4, 8, seed=1)
    with simulate_cuda_graphs():
        for step in range(4):
            x = fw.randn(4, 8, seed=step)
            assert fw.equal(m(x, mine), ref(x, theirs)), step
            assert fw.equal(mine, theirs), f"step {step}: the caller's state"
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.capture_failures == 1, s
    said = [w for w in graph_opt_warnings() if "in place" in w]
    assert len(said) == 1 and "argument 'state'" in said[0], said


def test_inference_compares_host_values_as_a_kernel_reads_them_and_names_the_argument(fw, graph_opt_warnings):
    """Captured with scale 0.0, a call with -0.0 does not replay (1 / (x * scale) is -inf, not inf); the
    warning names the argument."""
    config = graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=[4])
    m, twin = _graphed_twin(fw, config)
    with simulate_cuda_graphs(), fw.no_grad():
        graph_opt.capture_model(m, lambda n: (fw.randn(n, 8), as_host_tensor(fw.tensor(0.0))), progress=False)
        for value in (0.0, -0.0, 0.0):
            x = fw.randn(4, 8)
            assert fw.equal(m(x, scale=as_host_tensor(fw.tensor(value))), twin(x, fw.tensor(value)))
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"host_argument": 1}, s
    said = [w for w in graph_opt_warnings() if "host (CPU) tensor" in w]
    assert len(said) == 1 and said[0].startswith("Graphed: argument 'scale' is a host"), said


def test_inference_replays_a_batched_host_argument_only_with_the_captured_rows(fw):
    """A host argument with a batch dimension (pack_padded_sequence's lengths): the capture read its
    padded rows on the host, so only a call of the captured size with the same values replays."""
    config = graph_opt.GraphOptConfig(graph_opt_level=0, cudagraph_capture_sizes=[2, 4])
    m, twin = _graphed_twin(fw, config)
    lengths = [[6.0, 5.0, 3.0, 1.0], [6.0, 5.0, 3.0, 1.0], [6.0, 6.0, 6.0, 6.0], [6.0, 5.0, 3.0]]
    with simulate_cuda_graphs(), fw.no_grad():
        graph_opt.capture_model(
            m, lambda n: (fw.randn(n, 8), as_host_tensor(fw.tensor(lengths[0][:n]).reshape([n, 1]))), progress=False)
        for step, rows in enumerate(lengths):
            x = fw.randn(len(rows), 8, seed=step)
            scale = fw.tensor(rows).reshape([len(rows), 1])
            assert fw.equal(m(x, as_host_tensor(scale.clone())), twin(x, scale)), step
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"host_argument": 2}, s


def test_training_names_a_host_argument_inside_a_container_and_its_keys_in_the_max_graphs_warning(
        fw, graph_opt_warnings):
    base = type(fw.scaled_block())

    class TakesOptions(base):
        def forward(self, x, opts):
            return base.forward(self, x, opts["scale"])

    m = graph_opt.autocudagraph(TakesOptions(), warmup_steps=1, max_graphs=2)
    n = arguments.HOST_KEY_ELEMENTS + 1
    with simulate_cuda_graphs():
        m(fw.randn(n, 8), {"scale": as_host_tensor(fw.randn(n, 1))})
        for step in range(4):  # an annealed temperature: a key per value
            m(fw.randn(4, 8), {"scale": as_host_tensor(fw.tensor(1.0 - 0.1 * step))})
    said = [w for w in graph_opt_warnings()]
    assert any(f"argument 'opts'['scale'] is a host (CPU) tensor of {n} elements" in w for w in said), said
    assert any("max_graphs=2" in w and "differ by the value of argument 'opts'['scale']" in w for w in said), said


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
def test_a_host_argument_a_splitting_op_reads_replays_at_every_size(fw, full):
    """Attention's CPU sequence lengths, read by a splitting op: it runs eagerly at every replay, so the
    lengths are read as they are and every size replays (piecewise). Captured inside a full graph, the
    same read is baked, and only the captured values replay."""
    def scale_rows(x, lens):  # reads the lengths on the host
        return x * fw.tensor([float(v) for v in lens.tolist()]).reshape([-1, 1])

    split = graph_opt.splitting_op(name=f"host_rows_{fw.name}_{full}")(scale_rows)
    base = type(fw.scaled_block())

    class Lengths(base):
        def __init__(self, graph_opt_config=None):
            base.__init__(self)

        def forward(self, x, lens):
            return self.lin(split(self.lin(x), lens))

    twin = Lengths()
    cls = graph_opt.support_graph_optimization(type("Graphed", (Lengths,), {}), dynamic_arg_dims={"x": 0, "lens": 0})
    m = cls(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=0, full_cuda_graph=full,
                                                     cudagraph_capture_sizes=[2, 4]))
    m.set_state_dict(twin.state_dict()) if fw.name == "paddle" else m.load_state_dict(twin.state_dict())
    m.eval(), twin.eval()
    lens = lambda n, seed: as_host_tensor(fw.tensor([float(seed + i) for i in range(n)]))  # noqa: E731
    with simulate_cuda_graphs(), fw.no_grad():
        assert graph_opt.capture_model(m, lambda n: (fw.randn(n, 8), lens(n, 1)), progress=False).failed is None
        for step, n in enumerate([4, 2, 4, 2]):
            x, ls = fw.randn(n, 8, seed=step), lens(n, 5 + step)
            assert fw.equal(m(x, ls), twin(x, ls)), step
    s = graph_opt.stats(m)
    if full:
        assert s.replays == 0 and s.fallback_reasons == {"host_argument": 4}, s
    else:
        assert s.replays == 4 and not s.fallback_reasons, s
