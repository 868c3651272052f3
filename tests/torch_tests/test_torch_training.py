"""graph_opt.autocudagraph, torch's own cases, with simulated graphs (the specification both frameworks meet
is tests/both/test_training_spec.py; tests/gpu/test_gpu_training.py runs some of these on real graphs):
autograd beyond loss.backward(), layouts, hooks, what the forward writes, dataclass and model outputs.
"""
import copy
import dataclasses
import enum

import numpy
import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from replay_support import advance_in_place, in_place_counter  # noqa: E402
from torch_zoo.training import Block, TorchShim  # noqa: E402
from training_support import assert_same_step, graph_warnings, twins  # noqa: E402

_CI_SECONDS = 6  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 here in tests/torch_tests/test_torch_training_levels.py; tests/gpu runs every level (tests/conftest.py)
_INDUCTOR_ON_CPU = set()


@pytest.fixture
def T():
    with graph_opt.testing.simulate_cuda_graphs():
        yield TorchShim()


@pytest.fixture
def autocast_tolerance():
    return 0.0  # simulated replays run the same bf16 kernels as eager


# -- torch's own cases -----------------------------------------------------------------------------
def test_swapping_a_parameters_data_is_detected(T, caplog):
    ref, m = twins(T, warmup_steps=0)
    x = T.randn([4, 6, T.hidden], seed=1)
    assert_same_step(T, ref, m, x, seed=0)
    new = T.randn(list(ref.down.weight.shape), seed=5)
    with torch.no_grad():
        ref.down.weight.data = new.clone()
        m.down.weight.data = new.clone()  # same Parameter object, new storage
    T.zero_grads(ref), T.zero_grads(m)
    assert_same_step(T, ref, m, x, seed=1)
    assert graph_opt.stats(m).recaptures == 1


def test_autocast_cache_is_off_while_capturing():
    """The weight cast cached by an eager call in the same autocast region must not be baked in."""
    with graph_opt.testing.simulate_cuda_graphs(), torch.autocast("cpu", dtype=torch.bfloat16):
        m = graph_opt.autocudagraph(Block(16), warmup_steps=1)
        seen = []
        real = torch.is_autocast_cache_enabled

        def spy(x):
            seen.append((graph_opt.is_capturing(), real()))
            return x

        m.norm.register_forward_hook(lambda mod, i, o: spy(o))
        x = torch.randn(2, 16, requires_grad=True)
        for _ in range(3):
            m(x).float().sum().backward()
    assert (True, False) in seen and (False, True) in seen


def test_a_second_backward_with_retain_graph_replays_again(T):
    ref, m = twins(T, warmup_steps=0)
    x = T.randn([4, 6, T.hidden], seed=2)
    y = m(T.leaf(x, True))
    y_ref = ref(T.leaf(x, True))
    for _ in range(2):
        T.loss(y).backward(retain_graph=True)
        T.loss(y_ref).backward(retain_graph=True)
    for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
        assert T.equal(p.grad, p_ref.grad), name
    assert graph_opt.stats(m).backward_replays == 2


def test_without_cuda_or_simulation_it_runs_eagerly_with_one_warning(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA graphs")
    m = graph_opt.autocudagraph(Block(16), warmup_steps=0)
    caplog.clear()
    for _ in range(3):
        m(torch.randn(2, 16, requires_grad=True)).sum().backward()
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"no_graphs": 3} and s.captures == 0
    assert len(graph_warnings(caplog)) == 1


def test_second_order_gradients_are_refused_clearly(T):
    _, m = twins(T, warmup_steps=0)
    y = m(T.leaf(T.randn([4, 6, T.hidden], seed=1), True))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (g,) = torch.autograd.grad(T.loss(y), [m.up.weight], create_graph=True)
        g.sum().backward()


# -- autograd beyond loss.backward(), torch's own ---------------------------------------------------
def _params_equal(ref, m):
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
        assert (p.grad is None) == (p_ref.grad is None) and (p.grad is None or torch.equal(p.grad, p_ref.grad)), name


def test_calls_under_inference_mode_then_no_grad_both_answer_eagers(T):
    """Static buffers made under inference_mode are ordinary tensors: a later no_grad call copies into them."""
    ref, m = twins(T, warmup_steps=0)
    x = T.randn([4, 6, T.hidden], seed=3)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            assert torch.equal(m(x.clone()), ref(x.clone())), mode.__name__
    assert graph_opt.stats(m).fallbacks == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_graphed_block_inside_checkpoint_gives_eagers_gradients(T, reentrant):
    """torch.utils.checkpoint keeps the activations itself (non-reentrant: saved-tensor hooks; reentrant:
    a no-grad forward, recomputed in backward): such calls run eagerly, and the gradients are eager's."""
    from torch.utils.checkpoint import checkpoint

    ref, m = twins(T, warmup_steps=0)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        x = T.randn([4, 6, T.hidden], seed=step)
        xs, xs_ref = T.leaf(x, True), T.leaf(x, True)
        T.loss(checkpoint(m, xs, use_reentrant=reentrant)).backward()
        T.loss(checkpoint(ref, xs_ref, use_reentrant=reentrant)).backward()
        assert torch.equal(xs.grad, xs_ref.grad)
        _params_equal(ref, m)
    T.zero_grads(ref), T.zero_grads(m)  # and outside checkpoint, graphs as usual
    assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=9), seed=0)
    assert graph_opt.stats(m).replays >= 1


def test_a_lazy_module_is_graphed_once_its_parameters_exist(T):
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.LazyLinear(T.hidden), torch.nn.Tanh(), torch.nn.Linear(T.hidden, 4))

    ref, m = make(), graph_opt.autocudagraph(make(), warmup_steps=0)
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        x = T.randn([4, 8], seed=step)
        torch.manual_seed(step)  # the lazy parameters are drawn at the first call
        y = m(T.leaf(x, True))
        torch.manual_seed(step)
        y_ref = ref(T.leaf(x, True))
        assert torch.equal(y, y_ref)
        T.loss(y).backward(), T.loss(y_ref).backward()
        _params_equal(ref, m)
    s = graph_opt.stats(m)
    assert s.fallback_reasons == {"lazy_parameters": 1} and s.replays == 2


def test_a_backward_through_an_earlier_retained_output_is_eagers(T):
    """backward(retain_graph=True), a new forward, then a backward through the first output: the second
    forward must not overwrite what the first output's backward reads."""
    ref, m = twins(T, warmup_steps=0)
    xa, xb = T.randn([4, 6, T.hidden], seed=1), T.randn([4, 6, T.hidden], seed=2)
    outs = {}
    for model in (ref, m):
        ya = model(T.leaf(xa, True))
        T.loss(ya).backward(retain_graph=True)
        yb = model(T.leaf(xb, True))
        T.loss(ya * 3.0).backward()
        T.loss(yb).backward()
        outs[id(model)] = (ya, yb)
    for a, b in zip(outs[id(m)], outs[id(ref)]):
        assert torch.equal(a, b)
    _params_equal(ref, m)


class _Convs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_channels_last_inputs_keep_their_layout_and_eager_s_gradients(T):
    """A convolution block fed channels_last tensors: outputs in eager's layout, gradients bitwise (the
    kernels pick their algorithm by layout); a contiguous call gets a graph of its own."""
    import copy

    torch.manual_seed(0)
    ref = _Convs().to(T.device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=0)
    for step, layout in enumerate((torch.channels_last,) * 3 + (torch.contiguous_format,)):
        outs = []
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            x = T.randn([2, 8, 6, 6], seed=step).to(memory_format=layout).requires_grad_(True)
            y = model(x)
            T.loss(y).backward()
            outs.append((y, x.grad))
        (y_ref, gx_ref), (y, gx) = outs
        assert y.stride() == y_ref.stride() and torch.equal(y, y_ref), f"step {step}: output"
        assert torch.equal(gx, gx_ref), f"step {step}: input grad"
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            # On a device the README's stated exception: cuDNN reduces a channels_last bias gradient in
            # another order inside the graph (1.9e-9 seen); within 8 float32 epsilons of the largest element
            bound = 0.0 if T.device == "cpu" else 8 * torch.finfo(torch.float32).eps * p_ref.grad.abs().max().item()
            assert T.max_diff(p.grad, p_ref.grad) <= bound, f"step {step}: grad of {name}"
    s = graph_opt.stats(m)
    assert s.keys == 2 and s.replays == 4


def test_a_parameter_s_tensor_hook_runs_once_per_backward(T):
    """`p.register_hook(lambda g: g * 2)`: the hook sees the gradient once, as in eager (the block's
    own autograd.grad runs with it off; capture does not bake it in)."""
    ref, m = twins(T, warmup_steps=0)
    calls = {id(ref): 0, id(m): 0}

    def hook(model):
        def double(g):
            calls[id(model)] += 1
            return g * 2
        return double

    for model in (ref, m):
        model.up.weight.register_hook(hook(model))
    for step in range(3):
        T.zero_grads(ref), T.zero_grads(m)
        assert_same_step(T, ref, m, T.randn([4, 6, T.hidden], seed=step), seed=step)
    assert calls[id(m)] == calls[id(ref)] == 3


class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, q, k, v):
        return self.mha(q, k, v, need_weights=False)[0]


def test_one_tensor_passed_as_several_arguments_stays_one_tensor(T):
    """`attn(x, x, x)`: MultiheadAttention takes its self-attention path when query is key is value;
    the graph must see one tensor too (and x's gradient is the sum over its three uses, once)."""
    import copy

    torch.manual_seed(0)
    ref = _SelfAttention().to(T.device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=0)
    for step in range(3):
        outs = []
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            x = T.randn([2, 5, 16], seed=step).requires_grad_(True)
            y = model(x, x, x)
            T.loss(y).backward()
            outs.append((y, x.grad))
        (y_ref, gx_ref), (y, gx) = outs
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref), f"step {step}"
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert torch.equal(p.grad, p_ref.grad), f"step {step}: grad of {name}"
    x = T.randn([2, 5, 16], seed=9)
    y = m(x, x.clone(), x.clone())  # three tensors: a graph of its own
    assert torch.equal(y, ref(x, x.clone(), x.clone()))
    assert graph_opt.stats(m).keys == 2


def test_sparse_gradients_run_eagerly_and_say_so(T):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    m = graph_opt.autocudagraph(emb, warmup_steps=0)
    ids = torch.tensor([[1, 2], [3, 1]])
    m(ids).sum().backward()
    assert emb.weight.grad.is_sparse
    assert "sparse gradient" in graph_opt.stats(m).disabled_reason


class _Bookkeeping(torch.nn.Module):
    temperature = 1.0  # a class default, set on the instance later

    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.tanh(self.lin(x)) / self.temperature


def _assert_same_lin_step(T, ref, m, x, step):
    """One training step of each: the output and its `lin` weight's gradient, bitwise eager's."""
    got = []
    for model in (ref, m):
        model.zero_grad(set_to_none=True)
        y = model(x)
        T.loss(y).backward()
        got.append((y, model.lin.weight.grad))
    assert T.equal(got[0][0], got[1][0]) and T.equal(got[0][1], got[1][1]), f"step {step}"


def test_a_class_default_shadowed_after_capture_is_captured_again(T):
    """Two shapes alternating: captured once per shape, never again. Then `block.temperature = 2.0`
    over the class default: captured again, eager's values."""
    torch.manual_seed(0)
    ref = _Bookkeeping(T.hidden)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)
    for step in range(10):
        if step == 6:
            ref.temperature = m.temperature = 2.0
        _assert_same_lin_step(T, ref, m, T.randn([2 + step % 2, T.hidden], seed=step), step)
    s = graph_opt.stats(m)
    assert (s.captures, s.recaptures) == (4, 1), s


class _Counts(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a schedule the math reads: a replay would neither count nor read the new count
        return self.lin(x) * min(1.0, self.calls / 4)


@pytest.mark.parametrize("level", [0, 1, pytest.param(2, marks=pytest.mark.inductor)])
def test_a_python_value_the_forward_sets_at_every_call_fails_the_capture_and_counts_as_eager(T, level, caplog):
    torch.manual_seed(0)
    ref = _Counts(T.hidden)
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=1, level=level)
    for step in range(6):
        x = T.randn([3, T.hidden], seed=step)
        _assert_same_lin_step(T, ref, m, x, step)
        assert block.calls == ref.calls, f"step {step}: the count"
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.capture_failures == 1, s
    assert any("sets Python state as it runs" in r.getMessage() and "'calls': " in r.getMessage()
               for r in caplog.records)


class _CountsInPlace(torch.nn.Module):
    kind = "set"

    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.seen = in_place_counter(self.kind)

    def forward(self, x):
        return self.lin(x) * min(1.0, advance_in_place(self.seen) / 4)


@pytest.mark.parametrize("kind", ["set", "numpy", "bytearray", "array"])
def test_a_count_kept_in_a_set_or_array_the_forward_changes_in_place_fails_the_capture(T, kind, caplog):
    """No binding changes, only the value inside the object: the capture sees it and puts it back."""
    torch.manual_seed(0)
    ref = type(f"Counts_{kind}", (_CountsInPlace,), {"kind": kind})(T.hidden)
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    for step in range(5):
        x = T.randn([3, T.hidden], seed=step)
        _assert_same_lin_step(T, ref, m, x, step)
        assert advance_in_place(copy.copy(block.seen)) == advance_in_place(copy.copy(ref.seen)), f"step {step}"
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.capture_failures == 1, s
    assert any("sets Python state as it runs" in r.getMessage() and "'seen'" in r.getMessage() for r in caplog.records)


class _Mode(enum.Enum):
    A = 1
    B = 2


class _ScaledByClassDefault(torch.nn.Module):
    scale = 1.0

    def forward(self, x):
        return x * self.scale


class _Scheduled(torch.nn.Module):
    """Attributes a schedule may set between steps, each read by the forward."""

    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.sc = _ScaledByClassDefault()
        self.mode = _Mode.A
        self.temp = numpy.float32(1.0)
        self.gains = [1.0]
        self.count = 1
        self.shift = 0.0

    def forward(self, x):
        y = self.sc(self.lin(x)) / float(self.temp) * self.gains[0] * (1.0 if self.mode is _Mode.A else 3.0)
        return y * torch.tensor(self.count).to(y.dtype) + torch.full_like(y, self.shift).reciprocal().clamp(-2, 2)


_SCHEDULES = {
    "an enum member": lambda m: setattr(m, "mode", _Mode.B),
    "a numpy scalar": lambda m: setattr(m, "temp", numpy.float32(4.0)),
    "a new list": lambda m: setattr(m, "gains", [5.0]),
    "a submodule's attribute over its class default": lambda m: setattr(m.sc, "scale", 7.0),
    "1 to 1.0": lambda m: setattr(m, "count", 1.0),
    "0.0 to -0.0": lambda m: setattr(m, "shift", -0.0),
}


# At level 1 Dynamo's own float guards take -0.0 for 0.0, as under torch.compile (docs/training.md)
@pytest.mark.parametrize("change, level", [(c, lv) for c in _SCHEDULES for lv in (0, 1) if lv == 0 or c != "0.0 to -0.0"])
def test_an_attribute_a_schedule_sets_to_another_value_is_captured_again(T, change, level):
    """Each is another value to the forward, though Python's == may call it equal (1 == 1.0, 0.0 == -0.0)."""
    torch.manual_seed(0)
    ref = _Scheduled(T.hidden)
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=1, level=level)
    for step in range(6):
        if step == 3:
            _SCHEDULES[change](ref)
            _SCHEDULES[change](block)
        x = T.randn([3, T.hidden], seed=step)
        _assert_same_lin_step(T, ref, m, x, step)
    s = graph_opt.stats(m)
    assert s.recaptures == 1 and s.replays == (5 if level == 0 else 3), s  # level 1: a first call per trace


class _Rows(torch.nn.Module):
    def forward(self, x):
        self._rows = x.shape[0]  # private, on a submodule
        return x


class _KeepsRows(torch.nn.Module):
    def __init__(self, hidden, on_submodule=False):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.rows = 0
        self.sub = _Rows() if on_submodule else None

    def forward(self, x):
        if self.sub is not None:
            return self.lin(self.sub(x))
        self.rows = x.shape[0]  # the same at every run of one key, another at the other key
        return self.lin(x)


@pytest.mark.parametrize("warmup_steps", [0, 1])
@pytest.mark.parametrize("on_submodule", [False, True], ids=["module", "private_of_submodule"])
def test_a_value_the_forward_sets_per_key_is_never_left_stale_by_a_replay(T, caplog, warmup_steps, on_submodule):
    """Each key's capture sees its runs leave `rows` as they found it; a replay after a call of the other
    key would leave it stale (it runs no Python), so such calls run eagerly, with one warning."""
    torch.manual_seed(0)
    ref = _KeepsRows(T.hidden, on_submodule)
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=warmup_steps)
    rows = (lambda model: model.sub._rows) if on_submodule else (lambda model: model.rows)
    for step, n in enumerate((2, 2, 2, 4, 4, 4, 2, 4, 2, 4)):
        x = T.randn([n, T.hidden], seed=step)
        _assert_same_lin_step(T, ref, m, x, step)
        assert rows(block) == rows(ref), f"step {step}"
    s = graph_opt.stats(m)
    assert s.captures == 2 and s.capture_failures == 0 and s.fallback_reasons == {"forward_state": 4}, s
    assert len([r for r in graph_warnings(caplog) if "writes itself" in r.getMessage() and "rows'" in r.getMessage()]) == 1


class _EvalBookkeeping(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.last_eval_rows = 0

    def forward(self, x):
        if not self.training:
            self.last_eval_rows = x.shape[0]  # the training forward neither writes nor reads it
        return self.lin(x)


def test_a_value_only_another_key_writes_costs_one_eager_call_and_a_capture(T):
    torch.manual_seed(0)
    ref = _EvalBookkeeping(T.hidden)
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    for step in range(8):
        if step == 3:  # an evaluation pass between training steps
            for model in (ref, m):
                model.eval()
                with torch.no_grad():
                    model(T.randn([5, T.hidden], seed=99))
                model.train()
        assert_same_step(T, ref, m, T.randn([3, T.hidden], seed=step), step)
        assert block.last_eval_rows == ref.last_eval_rows
    s = graph_opt.stats(m)
    # the training key: warm-up, capture, replays; after the evaluation one eager call, a capture, replays
    assert s.fallback_reasons.get("forward_state") == 1 and s.replays >= 6, s


class _ReadyOnce(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.ready = False

    def forward(self, x):
        if not self.ready:
            self.ready = True
        return self.lin(x)


def test_a_flag_set_at_the_first_call_replays_with_no_warm_up_steps(T, caplog):
    """warmup_steps=0: the first call is the capture's run, which sets the flag; that call runs eagerly
    and the next captures."""
    ref = _ReadyOnce(T.hidden)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=0)
    for step in range(4):
        assert_same_step(T, ref, m, T.randn([3, T.hidden], seed=step), step)
    s = graph_opt.stats(m)
    assert (s.captures, s.capture_failures, s.replays) == (1, 0, 3), s
    assert not graph_warnings(caplog)


class _BufferAtFirstCall(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        if not hasattr(self, "pos"):
            self.register_buffer("pos", torch.arange(float(x.shape[-1])))
        return self.lin(x) + self.pos


def test_a_buffer_the_forward_registers_at_its_first_call_is_no_recapture(T, caplog):
    ref = _BufferAtFirstCall(T.hidden)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)
    for step in range(4):
        assert_same_step(T, ref, m, T.randn([3, T.hidden], seed=step), step)
    s = graph_opt.stats(m)
    assert (s.captures, s.recaptures, s.replays) == (1, 0, 3), s
    assert not graph_warnings(caplog)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor


class _DataclassModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, batch):
        logits = self.lin(batch.x)
        return _Out(torch.nn.functional.cross_entropy(logits, batch.y), logits)


@pytest.mark.parametrize("level", [0, 1])
def test_dataclass_inputs_and_outputs_replay_as_eager(level):
    """A batch object in and a ModelOutput-like object out, as Hugging Face models take and return."""
    torch.manual_seed(0)
    ref = _DataclassModel()
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level)
    with graph_opt.testing.simulate_cuda_graphs():
        for step in range(4):
            batch = _Batch(torch.randn(2, 4), torch.tensor([0, 2]))
            got, want = m(batch), ref(batch)
            assert isinstance(got, _Out) and torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
            got.loss.backward()
            want.loss.backward()
            assert torch.equal(m.lin.weight.grad, ref.lin.weight.grad), f"step {step}"
    s = graph_opt.stats(m)
    assert s.replays >= 2 and not s.fallback_reasons


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, obs):
        return torch.distributions.Categorical(logits=self.lin(obs))


def test_an_output_object_holding_tensors_runs_eagerly_with_one_warning(caplog):
    """A replay could only hand back the capture's object, with the capture's probabilities."""
    torch.manual_seed(0)
    ref = _Policy()
    m = graph_opt.autocudagraph(copy.deepcopy(ref))
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        for step in range(4):
            obs = torch.full((1, 4), float(step))
            assert torch.equal(m(obs).probs, ref(obs).probs), f"step {step}"
    assert [r for r in graph_warnings(caplog) if "Categorical object" in r.getMessage()]
    assert graph_opt.stats(m).replays == 0


class _EmaCodebook(torch.nn.Module):
    """Updates a frozen Parameter in place from the batch (a VQ codebook's moving average): in place,
    through .data (no version counter moves), or a trainable weight under no_grad."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.proj = torch.nn.Linear(4, 4)
        self.codebook = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)

    def forward(self, x):
        z = self.proj(x)
        idx = torch.cdist(z, self.codebook).argmin(-1)
        with torch.no_grad():
            onehot = torch.nn.functional.one_hot(idx, 8).to(z.dtype)
            update = 0.1 * (onehot.t() @ z) / onehot.sum(0).clamp(min=1)[:, None]
            if self.how == "trainable":
                self.proj.weight.mul_(0.95)
            else:
                (self.codebook.data if self.how == "data" else self.codebook).mul_(0.9).add_(update)
        q = self.codebook[idx]
        return (z - q).pow(2).mean() + (z + (q - z).detach()).pow(2).mean()


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("warmup_steps", [0, 1])
@pytest.mark.parametrize("how", ["in_place", "data", "trainable"])
def test_a_parameter_the_forward_updates_is_updated_once_per_step(level, warmup_steps, how):
    torch.manual_seed(0)
    ref = _EmaCodebook(how)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=warmup_steps)
    with graph_opt.testing.simulate_cuda_graphs():
        for step in range(5):
            x = torch.randn(16, 4)
            ref(x).backward()
            m(x).backward()
            assert torch.equal(m.codebook, ref.codebook) and torch.equal(m.proj.weight, ref.proj.weight), f"step {step}"
            assert torch.equal(m.proj.weight.grad, ref.proj.weight.grad), f"step {step}"
    assert graph_opt.stats(m).replays >= 3


@pytest.mark.parametrize("level", [0, 1])
def test_a_backward_after_the_parameters_changed_in_place_raises_as_eager(level):
    """An optimizer step between a forward and a second backward through it: eager autograd refuses;
    the captured backward would read the stepped parameters against the old activations."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(3, 4)
    with graph_opt.testing.simulate_cuda_graphs():
        for step in range(4):
            out = m(x)
            out.sum().backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out[:, 1].sum().backward()
            opt.zero_grad()
    s = graph_opt.stats(m)
    assert s.backward_replays >= 1
    # a backward that raised is not waited for: every later forward replayed
    assert "backward_pending" not in s.fallback_reasons and s.replays >= 2, s


def test_a_tower_with_a_frozen_weight_applied_twice_per_step_gives_eager_s_gradients():
    """The first call of a step runs eagerly and saves the frozen weight for its backward; the second
    captures. The capture must not move that weight's version counter (it puts back only what it changed)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    ref[2].requires_grad_(False)
    m = graph_opt.autocudagraph(copy.deepcopy(ref))
    with graph_opt.testing.simulate_cuda_graphs():
        for step in range(3):
            for model in (ref, m):
                torch.manual_seed(step)
                x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
                (model(x1) - model(x2)).square().sum().backward()
            assert torch.equal(m[0].weight.grad, ref[0].weight.grad), f"step {step}"
    assert graph_opt.stats(m).replays >= 3


def test_a_model_output_keeps_its_keys_in_order_on_replay():
    """outputs[0] is the loss, as Hugging Face training loops read it."""
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return outputs.CausalLMOutputWithPast(loss=h.square().mean(), logits=h, hidden_states=(x, h))

    torch.manual_seed(0)
    ref = Model()
    m = graph_opt.autocudagraph(copy.deepcopy(ref))
    with graph_opt.testing.simulate_cuda_graphs():
        for step in range(3):
            x = torch.randn(2, 4)
            got, want = m(x), ref(x)
            assert list(got.keys()) == list(want.keys()) == ["loss", "logits", "hidden_states"], f"step {step}"
            assert torch.equal(got[0], want[0]) and torch.equal(got.hidden_states[1], want.hidden_states[1])
            got.loss.backward()
            want.loss.backward()
    assert graph_opt.stats(m).replays >= 2


class _DefaultDtype(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.full((x.shape[0], 8), 0.1, device=x.device)  # follows the default dtype


def test_the_default_dtype_is_in_the_key(T):
    """torch.set_default_dtype between steps: the float32 graphs are not replayed for a float64 step."""
    torch.manual_seed(0)
    ref = _DefaultDtype()
    block = copy.deepcopy(ref)
    m = graph_opt.autocudagraph(block, warmup_steps=1)
    try:
        for step in range(6):
            if step == 3:
                torch.set_default_dtype(torch.float64)
            x = T.randn([4, 8], seed=step).float()
            outs = []
            for model in (ref, m):
                model.zero_grad(set_to_none=True)
                y = model(x)
                y.sum().backward()
                outs.append((y, model.lin.weight.grad))
            assert outs[0][0].dtype == outs[1][0].dtype, f"step {step}"
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), f"step {step}"
    finally:
        torch.set_default_dtype(torch.float32)
    s = graph_opt.stats(m)
    assert s.captures == 2 and s.fallbacks == 0, s
