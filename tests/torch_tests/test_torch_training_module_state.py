"""graph_opt.autocudagraph on torch: the module's state besides its parameters and buffers (tensor attributes,
generators, hooks of tensors that get no gradient), and a training block inside a model decorated for
inference or inside torch.compile. With simulated graphs; tests/gpu/test_gpu_training.py runs them on real
graphs (its fixture `device`)."""
import contextlib
import copy
import types

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from training_support import graph_warnings  # noqa: E402

_CI_SECONDS = 4  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)


# -- the module's state besides parameters and buffers ---------------------------------------------------
@pytest.fixture
def device():
    return "cpu"


def _graphs(device):
    return graph_opt.testing.simulate_cuda_graphs() if device == "cpu" else contextlib.nullcontext()


class _ClassWeighted(torch.nn.Module):
    """A loss weighted per class by a tensor attribute (not a buffer) that a schedule sets anew."""

    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.cw = torch.ones(3, device=device)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.lin(x), y, weight=self.cw)


def _steps_equal_eager(ref, m, device, change, weight, steps=5, at=3):
    """Training steps of the eager module and the block, `change` made to both before step `at`: the loss
    and a weight's gradient equal at every step."""
    with _graphs(device):
        for step in range(steps):
            if step == at:
                change(ref)
                change(m)
            x, y = torch.randn(6, 8, device=device), torch.arange(6, device=device) % 3
            got = []
            for model in (ref, m):
                model.zero_grad(set_to_none=True)
                loss = model(x, y)
                loss.backward()
                got.append((loss.detach(), weight(model).grad))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"step {step}"


def test_a_tensor_attribute_set_anew_is_read_as_eager_reads_it(device):
    torch.manual_seed(0)
    ref = _ClassWeighted(device).to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)

    def change(model):
        model.cw = torch.tensor([1.0, 5.0, 0.1], device=device)

    _steps_equal_eager(ref, m, device, change, lambda model: model.lin.weight)
    s = graph_opt.stats(m)
    assert s.recaptures == 1 and s.backward_replays >= 3, s


class _Headed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Identity()

    def forward(self, x):
        return self.head(self.body(x))


def test_a_submodule_added_after_capture_has_its_training_flag_in_the_key(device):
    """A head with dropout put on after capture, then its eval() alone: a graph of its own, no dropout."""
    torch.manual_seed(0)
    ref = _Headed().to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)
    x = torch.randn(4, 8, device=device)
    with _graphs(device):
        for step in range(6):
            if step == 2:
                ref.head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).to(device)
                m.head = copy.deepcopy(ref.head)
            if step == 4:
                ref.head.eval()
                m.head.eval()
            got = []
            for model in (ref, m):
                torch.manual_seed(step)
                out = model(x)
                out.sum().backward()
                got.append(out.detach())
            assert torch.equal(got[0], got[1]), f"step {step}"
    keys = graph_opt.stats(m).keys
    assert keys == 2, keys  # the head in training mode, then in eval mode


class _CountsRows(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.seen = torch.zeros((), device=device)  # a plain attribute, not a buffer

    def forward(self, x):
        self.seen.add_(x.shape[0])
        return self.lin(x) / self.seen.sqrt()


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_a_tensor_attribute_the_forward_updates_in_place_is_updated_once_per_step(device, warmup_steps):
    torch.manual_seed(0)
    ref = _CountsRows(device).to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=warmup_steps)
    with _graphs(device):
        for step in range(4):
            x = torch.randn(6, 8, device=device)
            outs = []
            for model in (ref, m):
                out = model(x)
                out.sum().backward()
                outs.append(out.detach())
            assert torch.equal(outs[0], outs[1]) and torch.equal(ref.seen, m.seen), f"step {step}: {ref.seen} {m.seen}"
    assert graph_opt.stats(m).backward_replays >= 2


class _WeightNormed(torch.nn.Module):
    """Legacy torch.nn.utils.weight_norm: its pre-hook binds `lin.weight` anew at every call."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.utils.weight_norm(torch.nn.Linear(8, 8))
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x)))


class _MakesTableAtFirstCall(torch.nn.Module):
    """A table made at the first call and grown at a longer sequence (a rope cache)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.table = None

    def forward(self, x):
        length = x.shape[1]
        if self.table is None or self.table.shape[0] < length:
            self.table = torch.cos(torch.arange(float(length), device=x.device)[:, None] * torch.ones(8, device=x.device))
        return self.lin(x * self.table[:length])


@pytest.mark.parametrize("warmup_steps", [0, 1])
@pytest.mark.parametrize("cls", [_WeightNormed, _MakesTableAtFirstCall])
def test_tensor_attributes_the_forward_binds_itself_keep_the_graphs(device, caplog, cls, warmup_steps):
    """Bound by the forward at every call, or once per sequence length: the forward's own, not a
    replacement to capture again for, and the graphs replay eager's values."""
    models = []
    for _ in range(2):  # weight_norm's module cannot be deep-copied
        torch.manual_seed(0)
        models.append(cls().to(device))
    ref, m = models[0], graph_opt.autocudagraph(models[1], warmup_steps=warmup_steps)
    with _graphs(device):
        for step in range(6):
            x = torch.randn(4, 3 if step < 3 else 5, 8, device=device)
            got = []
            for model in (ref, m):
                model.zero_grad(set_to_none=True)
                out = model(x)
                out.square().mean().backward()  # bitwise on a GPU (training.md: a broadcast gradient is not)
                got.append((out.detach(), model.out.weight.grad if cls is _WeightNormed else model.lin.weight.grad))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"step {step}"
    s = graph_opt.stats(m)
    assert s.recaptures == 0 and s.capture_failures == 0 and s.backward_replays >= 2, s
    assert not graph_warnings(caplog)


class _OwnGenerator(torch.nn.Module):
    """Dropout-like masks drawn from a generator of the module's own, or one a helper object holds."""

    def __init__(self, device, nested=False):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        gen = torch.Generator(device=device).manual_seed(7)
        self.sampler = types.SimpleNamespace(gens=[gen]) if nested else gen

    def forward(self, x):
        gen = self.sampler.gens[0] if isinstance(self.sampler, types.SimpleNamespace) else self.sampler
        return self.lin(x * (torch.rand(x.shape, generator=gen, device=x.device) > 0.3))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_a_generator_of_the_module_s_own_draws_as_in_eager(device, warmup_steps, nested):
    """The capture's runs put the module's generator back: the steps draw eager's masks (on a GPU such a
    capture fails, the generator not being the graph's, and the key runs eagerly on eager's stream)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_OwnGenerator(device, nested).to(device))
    ref, m = models[0], graph_opt.autocudagraph(models[1], warmup_steps=warmup_steps)
    with _graphs(device):
        for step in range(4):
            x = torch.randn(6, 8, device=device)
            got = []
            for model in (ref, m):
                model.zero_grad(set_to_none=True)
                out = model(x)
                out.square().mean().backward()
                got.append((out.detach(), model.lin.weight.grad))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"step {step}"


# -- hooks of tensors that get no gradient -----------------------------------------------------------------
class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)
        self.spare = torch.nn.Linear(8, 8)  # never used by the forward

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h), self.b(h)


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("outside", [False, True], ids=["block-only", "also-outside"])
def test_hooks_of_parameters_that_get_no_gradient_run_as_in_eager(device, level, outside):
    """A loss that leaves head b out, and a parameter the forward never uses: eager runs neither their
    tensor hooks nor their post-accumulate-grad hooks. Where b's weight also gets a gradient outside the
    block, eager runs its hooks once, on that gradient."""
    torch.manual_seed(0)
    ref = _TwoHeads().to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1, level=level)
    seen = {id(ref): [], id(m): []}
    for model in (ref, m):
        log = seen[id(model)]
        for name in ("a", "b", "spare"):
            p = getattr(model, name).weight
            p.register_hook(lambda g, name=name, log=log: log.append((name, "grad", None if g is None else g.clone())))
            p.register_post_accumulate_grad_hook(lambda p, name=name, log=log: log.append((name, "post", p.grad.clone())))
    with _graphs(device):
        for step in range(4):
            x = torch.randn(4, 8, device=device)
            for model in (ref, m):
                model.zero_grad(set_to_none=True)
                a, _ = model(x)
                loss = a.square().mean()
                if outside:
                    loss = loss + model.b.weight.square().sum()
                loss.backward()
            # the order across parameters is autograd's own (the graphed block's node is another node)
            got, want = (sorted(seen[id(model)], key=lambda e: e[:2]) for model in (m, ref))
            assert [e[:2] for e in got] == [e[:2] for e in want], f"step {step}: {got} vs eager's {want}"
            assert all(torch.equal(g[2], w[2]) for g, w in zip(got, want)), f"step {step}"
            seen[id(m)].clear(), seen[id(ref)].clear()
            assert m.b.weight.grad is None if not outside else torch.equal(m.b.weight.grad, ref.b.weight.grad)
            assert m.spare.weight.grad is None
    s = graph_opt.stats(m)
    assert s.backward_replays >= 2 and s.fallbacks == 0, s


class _Conditioned(torch.nn.Module):
    """Head b reads a conditioning input made outside the block: the loss that leaves b out reaches
    neither b nor what made the input."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x, c):
        return self.a(x), self.b(x * c)


def test_hooks_stay_as_in_eager_upstream_after_a_raising_backward_and_for_multi_grad_hooks(device):
    torch.manual_seed(0)
    ref = _Conditioned().to(device)
    cond_ref = torch.nn.Linear(8, 8).to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=1)
    cond_m = copy.deepcopy(cond_ref)
    seen = {id(ref): [], id(m): []}
    fail = {"at": None}
    for model, cond in ((ref, cond_ref), (m, cond_m)):
        log = seen[id(model)]
        cond.weight.register_hook(lambda g, log=log: log.append(("cond", g is None)) or g * 2)
        model.b.weight.register_post_accumulate_grad_hook(lambda p, log=log: log.append(("b post", p.grad is None)))
        torch.autograd.graph.register_multi_grad_hook(
            [model.a.weight, model.b.weight], lambda gs, log=log: log.append(("multi", tuple(g is None for g in gs))))

        def check(g, log=log):
            if fail["at"] == "now":
                raise FloatingPointError("a non-finite gradient")
        model.a.weight.register_hook(check)
    with _graphs(device):
        for step in range(5):
            x = torch.randn(4, 8, device=device)
            fail["at"] = "now" if step == 2 else None
            for model, cond in ((ref, cond_ref), (m, cond_m)):
                model.zero_grad(set_to_none=True), cond.zero_grad(set_to_none=True)
                a, b = model(x, cond(x))
                loss = a.square().mean() + (b.square().mean() if step == 4 else 0)
                try:
                    loss.backward()
                except FloatingPointError:
                    seen[id(model)].append(("raised", True))
            got, want = (sorted(seen[id(model)]) for model in (m, ref))
            if step == 2:  # the multi-grad hook fires or not by where the raise cut the backward short
                got, want = ([e for e in log if e[0] != "multi"] for log in (got, want))
            assert got == want, f"step {step}: {got} vs eager's {want}"
            seen[id(m)].clear(), seen[id(ref)].clear()
    # hooks are the user's own again; one registered after the raising step is held too
    assert all(type(h).__module__ != _HOLDER_MODULE for h in m.b.weight._backward_hooks.values())
    assert graph_opt.stats(m).backward_replays >= 3


_HOLDER_MODULE = "graph_opt.backends.torch.grad_hooks"


# -- a training block inside a model decorated for inference, or inside torch.compile ---------------------
class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.inner, self.head = torch.nn.Linear(4, 8), _Inner(), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.inner(self.emb(x)))


def _train_both(m, ref, device, steps=4):
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (m, ref)]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(4, 4, generator=g).to(device), torch.randn(4, 2, generator=g).to(device)
        for model, opt in zip((m, ref), opts):
            opt.zero_grad()
            ((model(x) - t) ** 2).mean().backward()
            opt.step()
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max().item()}"


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("wrap_first", [True, False])
def test_a_submodule_trains_with_graphs_while_its_decorated_model_serves_with_graphs(device, level, wrap_first):
    # The decorated model's capture records the submodule's eager forward (a graph cannot capture another);
    # its training calls (no graphs: autograd on) reach the block, which captures and replays its own.
    with _graphs(device):
        torch.manual_seed(0)
        m = graph_opt.support_graph_optimization(type("Served", (_Outer,), {}))(
            graph_opt_config={"graph_opt_level": level, "cudagraph_capture_sizes": [1, 2, 4, 8]}).to(device)
        ref = _Outer().to(device)
        ref.load_state_dict(m.state_dict())

        def capture():
            report = graph_opt.capture_model(m.eval(), lambda bs: torch.randn(bs, 4, device=device), progress=False)
            assert report.failed is None, report.failed

        if wrap_first:
            graph_opt.autocudagraph(m.inner)
            capture()
        else:
            capture()
            graph_opt.autocudagraph(m.inner)
            if level:  # Dynamo's guards see the forward the block installed: capture again to serve with it
                graph_opt.clear_graphs(m)
                capture()
        m.train(), ref.train()
        _train_both(m, ref, device)
        block = graph_opt.stats(m.inner)
        assert block.captures == 1 and block.replays >= 2 and block.fallbacks == 0, block
        m.eval(), ref.eval()
        before = graph_opt.stats(m).replays
        with torch.no_grad():
            for bs in range(1, 9):
                x = torch.randn(bs, 4, device=device)
                assert torch.allclose(m(x), ref(x), rtol=1e-5, atol=1e-5)
        assert graph_opt.stats(m).replays == before + 8, graph_opt.stats(m)


def test_torch_compile_around_a_block_breaks_its_graph_there_and_the_block_replays(device):
    with _graphs(device):
        torch.manual_seed(0)
        m, ref = _Outer().to(device), _Outer().to(device)
        ref.load_state_dict(m.state_dict())
        graph_opt.autocudagraph(m.inner)
        compiled = torch.compile(m, backend="eager")
        _train_both(compiled, ref, device)
        block = graph_opt.stats(m.inner)
        assert block.captures == 1 and block.replays >= 2 and block.fallbacks == 0, block


def test_a_math_mode_change_between_steps_gets_a_graph_of_its_own(device):
    # TF32 on or off picks other kernels: a graph captured in one mode never replays in the other.
    with _graphs(device):
        torch.manual_seed(0)
        ref = _Inner().to(device)
        m = graph_opt.autocudagraph(copy.deepcopy(ref))
        cuda = torch.backends.cuda.matmul
        was = cuda.allow_tf32
        try:
            for step in range(6):
                cuda.allow_tf32 = step >= 3
                x = torch.randn(4, 8, device=device)
                for model in (m, ref):
                    model.zero_grad()
                    model(x).square().mean().backward()
                for p, q in zip(m.parameters(), ref.parameters()):
                    assert torch.equal(p.grad, q.grad)
        finally:
            cuda.allow_tf32 = was
        s = graph_opt.stats(m)
        assert s.keys == 2 and s.captures == 2 and s.fallbacks == 0, s


class _Breaks(_Inner):
    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # the frame after it is compiled under this forward's own code object
        return self.b(h)


@pytest.mark.parametrize("breaks", [False, True], ids=["one-graph", "graph-break"])
@pytest.mark.parametrize("level", [0, 1])
def test_a_hook_on_a_submodule_registered_or_removed_after_capture_is_captured_again(device, level, breaks):
    # Hooks of submodules run inside the forward: a graph replays those there were at its capture.
    with _graphs(device):
        torch.manual_seed(0)
        ref = (_Breaks if breaks else _Inner)().to(device)
        m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level)
        handles = []

        def hook_both(register):
            handles.append([register(model) for model in (ref, m)])

        for step in range(12):
            if step == 4:
                hook_both(lambda model: model.a.register_forward_hook(lambda mod, inp, out: out * 2))
            if step == 7:
                hook_both(lambda model: model.b.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,)))
            if step == 10:
                for handle in handles.pop(0):
                    handle.remove()
            x = torch.randn(4, 8, device=device, requires_grad=True)
            got = []
            for model in (ref, m):
                model.zero_grad()
                xin = x.detach().clone().requires_grad_(True)
                y = model(xin)
                y.square().mean().backward()
                got.append((y, xin.grad, model.a.weight.grad))
            for a, b in zip(*got):
                assert torch.equal(a, b), f"step {step}: differs by {(a - b).abs().max().item()}"
        assert graph_opt.stats(m).recaptures == 3, graph_opt.stats(m)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x)


class _ScaledTwice(_Scaled):
    def forward(self, x):
        return self.lin(x) * 2


class _WithHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = _Scaled()

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.parametrize("level", [0, 1])
def test_a_submodule_given_another_class_after_capture_is_captured_again(device, level):
    """`layer.__class__ = Other` (how quantization and adapter libraries swap a layer) writes no dict and
    registers nothing: the block compares the classes at every call."""
    torch.manual_seed(0)
    ref = _WithHead().to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=1)
    _steps_equal_eager(ref, m, device, lambda model: setattr(model.head, "__class__", _ScaledTwice),
                       lambda model: model.head.lin.weight)
    s = graph_opt.stats(m)
    assert s.recaptures == 1 and s.backward_replays >= (3 if level == 0 else 2), s  # level 1 traces anew first


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("at", [1, 3])
def test_a_parameter_unfrozen_between_a_warmup_and_the_capture_gets_its_gradient(device, level, at):
    """Frozen (requires_grad_(False)) for one step, then trained again, before the capture (at 1: the warm-up
    traced it frozen) and after it (at 3). Dynamo's tensor guards read requires_grad; torch 2.11 skips them
    where the parameters' dict kept its tag, and handed the capture the frozen trace (no gradient, silently)."""
    torch.manual_seed(0)
    ref = _Frozen().to(device)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), level=level, warmup_steps=1)

    with _graphs(device):
        for step in range(6):
            frozen = step == at
            x, y = torch.randn(6, 8, device=device), torch.arange(6, device=device) % 3
            got = []
            for model in (ref, m):
                model.a.weight.requires_grad_(not frozen)
                model.zero_grad(set_to_none=True)
                loss = model(x, y)
                loss.backward()
                got.append((loss.detach(), model.a.weight.grad, model.b.weight.grad))
            (l0, a0, b0), (l1, a1, b1) = got
            assert torch.equal(l0, l1) and torch.equal(b0, b1), f"step {step}"
            assert (a0 is None) == (a1 is None) == frozen and (frozen or torch.equal(a0, a1)), f"step {step}"
