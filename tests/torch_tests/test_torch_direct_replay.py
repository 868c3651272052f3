"""Level >= 1: a replay is the graph's replay() alone (full graph), or the pieces' graphs and the eager
pieces in the captured order (piecewise, pieces.ReplayPlan), where Dynamo's transformed code provably
only gathers the graph's inputs and returns its outputs; otherwise that code still runs."""
import weakref

import pytest
import torch

import graph_opt
from graph_opt.backends.torch.direct_replay import pure_replay_code, replay_stores
from graph_opt.decorator import state_of
from torch_zoo.small import SIZES, HIDDEN, Stack, make_x, mix

# Level 2 here only where Inductor changes what is checked; tests/gpu runs every level (tests/conftest.py)
_INDUCTOR_ON_CPU = {"test_a_pure_forward_replays_without_the_transformed_code"}

TOL = dict(rtol=1e-5, atol=1e-5)

_CI_SECONDS = 6  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)


def _cfg(level, full=True):
    return graph_opt.GraphOptConfig(graph_opt_level=level, full_cuda_graph=full, cudagraph_capture_sizes=SIZES)


def _captured(m):
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
    return state_of(m).runner.strategy


def _eager(m, x):
    with torch.no_grad():
        return type(m).forward(m, x)


@graph_opt.support_graph_optimization
class Counting(torch.nn.Module):
    """Its forward writes an attribute: the transformed code carries that store."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.calls = torch.zeros(())

    def forward(self, x):
        self.calls = self.calls + 1
        return self.proj(x)


@graph_opt.support_graph_optimization
class WithConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.proj(x), "tag"


@pytest.mark.parametrize("level,full", [(1, True), pytest.param(2, True, marks=pytest.mark.inductor), (1, False)])
def test_a_pure_forward_replays_without_the_transformed_code(level, full, monkeypatch):
    """Full: the graph's replay() alone. Piecewise: the pieces' graphs and the splitting ops on the
    arguments they got at capture, without the split module's forward."""
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(level, full))
    replayed = []
    real_replay = graph_opt.testing.HostGraph.replay
    monkeypatch.setattr(graph_opt.testing.HostGraph, "replay", lambda g: (replayed.append(g), real_replay(g)))
    strategy = _captured(m)
    assert strategy.direct_replays == len(SIZES)
    assert strategy.planned_replays == (0 if full else len(SIZES))
    if not full:
        for forward in strategy.forwards:
            monkeypatch.setattr(forward.split.module, "forward", None)  # a replay that called it would fail
    replayed.clear()
    for real in (1, 3, 8):
        x = make_x(real, seed=real)
        with torch.no_grad():
            torch.testing.assert_close(m(x), _eager(m, x), **TOL)
    assert graph_opt.stats(m).replays == 3
    pieces_per_call = 1 if full else 3  # Stack: two layers, each cut at its splitting op `mix`
    assert len(replayed) == 3 * pieces_per_call, "the captured graphs replayed, nothing ran as traced"


@pytest.mark.parametrize("full", [True, False])
def test_a_replaced_parameter_stops_the_replays_until_put_back(full):
    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full))
    strategy = _captured(m)
    x = make_x(3)
    with torch.no_grad():
        m(x)
    torch.nn.Linear(4, 4)  # a registration elsewhere: checked, nothing changed
    with torch.no_grad():
        m(x)
    assert not strategy._tensors.moved and graph_opt.stats(m).replays == 2
    captured = m.head.weight
    m.head.weight = torch.nn.Parameter(torch.randn_like(m.head.weight))
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(m(x), _eager(m, x), **TOL)
    assert graph_opt.stats(m).fallback_reasons == {"replaced": 2}
    m.head.weight = captured
    with torch.no_grad():
        torch.testing.assert_close(m(x), _eager(m, x), **TOL)
    assert graph_opt.stats(m).replays == 3


class _Embeds(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.emb = torch.nn.Embedding(10, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids):
        return self.head(self.emb(ids))


@pytest.mark.parametrize("full", [True, False])
def test_a_parameter_replaced_by_one_of_another_shape_runs_without_graphs_and_the_warning_names_it(
        full, graph_opt_warnings):
    """An embedding grown after capture (what resize_token_embeddings does): the calls equal eager, and
    the warning names the parameter as the forward reads it, with what to do to keep the new shape."""
    torch.manual_seed(0)
    m = graph_opt.support_graph_optimization(type("Graphed", (_Embeds,), {}))(graph_opt_config=_cfg(1, full))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: torch.randint(0, 10, (n, 3)), progress=False)
    m.emb.weight = torch.nn.Parameter(torch.randn(12, HIDDEN))
    for n in (4, 3):
        x = torch.randint(0, 12, (n, 3))
        with torch.no_grad():
            assert torch.equal(m(x), _eager(m, x)), n
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallbacks == 2, s.fallback_reasons
    said = " ".join(graph_opt_warnings())
    assert "emb.weight was replaced by a tensor of shape [12, " in said and "capture_model() again" in said, said


class _ReadsLayouts(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(HIDDEN))
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x):
        return (x * self.w + self.scale.shape[0]).to(self.scale.dtype)  # only the buffer's shape and dtype


@pytest.mark.parametrize("full", [True, False], ids=["full", "piecewise"])
@pytest.mark.parametrize("new", ["shape", "dtype"])
def test_a_buffer_read_only_for_its_layout_and_replaced_by_another_layout_is_never_replayed_stale(full, new):
    """The graph holds the buffer's size as a constant and never reads the buffer: its replacement reaches
    no graph input. A replaced tensor of another shape or dtype stops the replays (until captured again)."""
    torch.manual_seed(0)
    twin = _ReadsLayouts()
    m = graph_opt.support_graph_optimization(type("Graphed", (_ReadsLayouts,), {}))(graph_opt_config=_cfg(1, full))
    m.load_state_dict(twin.state_dict())
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
        captured = m.scale
        for model in (m, twin):
            model.scale = torch.ones(5) if new == "shape" else torch.ones(2, dtype=torch.float64)
        for real in (4, 3):
            x = make_x(real, seed=real)
            with torch.no_grad():
                out, want = m(x), twin(x)
            assert out.dtype == want.dtype and torch.equal(out, want), real
        assert graph_opt.stats(m).replays == 0
        m.scale, twin.scale = captured, torch.ones(2)  # the captured buffer back: the replays resume
        with torch.no_grad():
            assert torch.equal(m(make_x(4)), twin(make_x(4)))
    assert graph_opt.stats(m).replays == 1, graph_opt.stats(m).fallback_reasons


def test_a_forward_with_a_side_effect_keeps_running_its_transformed_code():
    torch.manual_seed(0)
    m = Counting(graph_opt_config=_cfg(1))
    strategy = _captured(m)
    assert strategy.direct_replays == 0
    before = float(m.calls)
    with torch.no_grad():
        m(make_x(3))
        m(make_x(5))
    assert float(m.calls) == before + 2  # the store ran at each replay
    assert graph_opt.stats(m).replays == 2


def test_a_non_tensor_output_keeps_the_transformed_code():
    m = WithConstant(graph_opt_config=_cfg(1))
    assert _captured(m).direct_replays == 0
    with torch.no_grad():
        out, tag = m(make_x(3))
    assert tag == "tag"


def test_pure_replay_code_refuses_stores_and_foreign_calls():
    def stores(self, x):
        self.y = x
        return x

    def calls(x):
        print(x)
        return x

    def gathers(self, x):
        return self._modules["a"]._parameters["w"], x

    assert not pure_replay_code(stores.__code__)
    assert not pure_replay_code(calls.__code__)
    assert pure_replay_code(gathers.__code__)


@pytest.mark.parametrize("full", [True, False])
def test_level_1_sizes_write_their_outputs_into_the_largest_sizes_storage(full):
    """graph_opt.replay.output_sharing at level >= 1: the last piece's capture of a smaller size copies the
    forward's outputs into the rows of the largest size's (owned) outputs. Size 1 is traced apart by
    Dynamo (it specialises sizes 0 and 1), so it keeps its own."""
    from graph_opt.replay.output_sharing import shares_storage

    torch.manual_seed(0)
    m = Stack(graph_opt_config=_cfg(1, full=full))
    _captured(m)
    runner = state_of(m).runner
    entries = next(iter(runner.signatures.values())).entries
    for size in (2, 4):
        assert shares_storage(runner.adapter, entries[size].captured.outputs, entries[8].captured.outputs)
    assert not shares_storage(runner.adapter, entries[1].captured.outputs, entries[8].captured.outputs)
    for real in (3, 8, 2, 1, 5):
        x = make_x(real, seed=real)
        with torch.no_grad():
            torch.testing.assert_close(m(x), _eager(m, x), **TOL)
    assert graph_opt.stats(m).replays == 5


@graph_opt.splitting_op(name="test_join")
def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 0.5 + b


@graph_opt.support_graph_optimization
class Chained(torch.nn.Module):
    """The second splitting op reads the first one's result directly, across a captured piece."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = mix(self.proj(x))
        g = self.out(x)
        return self.head(join(h, g))


def test_an_eager_piece_reading_another_eager_pieces_result_keeps_the_split_module():
    """A replay plan would hand the second op the first op's result from capture; the split module
    passes this replay's."""
    torch.manual_seed(0)
    m = Chained(graph_opt_config=_cfg(1, full=False))
    strategy = _captured(m)
    assert strategy.direct_replays == len(SIZES) and strategy.planned_replays == 0
    assert max(graph_opt.stats(m).graphs.values()) == 3
    for real in (1, 3, 8):
        x = make_x(real, seed=real)
        with torch.no_grad():
            torch.testing.assert_close(m(x), _eager(m, x), **TOL)


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.inductor)])
def test_the_demo_decoder_replays_its_plan_right_at_every_size_in_any_order(level):
    """Four layers whose residual crosses each splitting op: a graph's input is an earlier graph's
    output, never an eager result, even when its id is one a dead eager result had (it was, here,
    before landing was decided by identity: the plan then skipped the copy the split module made)."""
    from graph_opt.benchmarks import torch_demo

    cfg = graph_opt.GraphOptConfig(graph_opt_level=level, full_cuda_graph=False, cudagraph_capture_sizes=[1, 2, 4, 8])
    with graph_opt.testing.simulate_cuda_graphs():
        model, reference = torch_demo.build(cfg)
        graph_opt.capture_model(model, lambda n: torch_demo.make_inputs(n), progress=False)
        assert state_of(model).runner.strategy.planned_replays == 4
        with torch.no_grad():
            for n in (8, 3, 4, 2, 1, 7, 2, 8, 1, 5):
                x = torch_demo.make_inputs(n, seed=n)["x"]
                torch.testing.assert_close(model(x), reference(x), **TOL)


def test_an_eager_result_is_known_by_identity_not_by_a_reused_id():
    from graph_opt.backends.torch.pieces import GraphState

    state = GraphState()
    dead = torch.zeros(2)
    state.made[id(dead)] = (weakref.ref(dead), "call", 0)
    assert state.made_by_eager(dead) == ("call", 0)
    alive = torch.zeros(2)
    state.made[id(alive)] = state.made.pop(id(dead))  # as if alive had the id of a dead result
    del dead
    assert state.made_by_eager(alive) is None


@torch.library.custom_op("graph_opt_test::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, 2.0, out=out)


@graph_opt.support_graph_optimization
class WritesIntoBuffer(torch.nn.Module):
    """The splitting op writes into a buffer the model allocated in the piece before (vLLM's attention
    with an output argument)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.proj(x)
        buf = torch.empty_like(h)
        scale_into(h, buf)
        return self.out(buf)


def test_a_splitting_op_writing_into_the_models_buffer_lands_nothing():
    """The buffer is a graph's output at a fixed address: no landing buffer, no copy, values right."""
    torch.manual_seed(0)
    cfg = graph_opt.GraphOptConfig(graph_opt_level=1, full_cuda_graph=False, cudagraph_capture_sizes=SIZES,
                                   cudagraph_splitting_ops=["graph_opt_test::scale_into"])
    m = WritesIntoBuffer(graph_opt_config=cfg)
    strategy = _captured(m)
    assert strategy.planned_replays == len(SIZES)
    assert max(graph_opt.stats(m).graphs.values()) == 2
    assert all(not piece.landing for forward in strategy.forwards for piece in forward.pieces)
    with graph_opt.testing.simulate_cuda_graphs():
        for real in (1, 3, 8):
            x = make_x(real, seed=real)
            with torch.no_grad():
                torch.testing.assert_close(m(x), _eager(m, x), **TOL)


class _Pair(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(HIDDEN))
        self.b = torch.nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        return x * self.a + self.b


@pytest.mark.parametrize("change", ["swapped", "tied"])
def test_a_replaced_parameter_whose_captured_tensor_the_model_still_holds_is_not_copied_into(change):
    """Two parameters swapped, or one replaced while the other is the captured tensor (a tied weight):
    copying the new values where the graph reads would change the other too. The calls run without
    graphs and equal eager; the captured tensors keep their values."""
    torch.manual_seed(0)
    m = graph_opt.support_graph_optimization(type("Graphed", (_Pair,), {}))(graph_opt_config=_cfg(1))
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, make_x, progress=False)
        a, b = m.a, m.b
        values = (a.detach().clone(), b.detach().clone())
        if change == "swapped":
            m.a, m.b = b, a
        else:
            m.b = a
            m.a = torch.nn.Parameter(torch.randn(HIDDEN))
        for real in (4, 3):
            x = make_x(real, seed=real)
            with torch.no_grad():
                assert torch.equal(m(x), _eager(m, x)), real
    assert torch.equal(a, values[0]) and torch.equal(b, values[1])
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"replaced": 2}, s.fallback_reasons


class _HelperWithDefault(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        return x * self.w * self.helper()

    def helper(self, k=0.5):
        return k


@pytest.mark.xfail(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12),
                   reason="torch 2.11's guards do not check a method's __defaults__: the default baked at capture "
                          "replays, with its dict-tag skipping on or off (docs/replay-assumptions.md)",
                   strict=True)
def test_a_methods_default_rebound_after_capture_is_seen(graph_opt_warnings):
    """Dynamo guards a function's __defaults__; graph_opt keeps the guard (torch's dict-tag skipping
    does not assume function dunders constant): the calls run without graphs and equal eager."""
    torch.manual_seed(0)
    cls = graph_opt.support_graph_optimization(type("Graphed", (_HelperWithDefault,), {}))
    m = cls(graph_opt_config=_cfg(1))
    strategy = _captured(m)
    assert strategy.direct_replays == len(SIZES)
    x = make_x(4)
    try:
        _HelperWithDefault.helper.__defaults__ = (6.0,)
        with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(x), _eager(m, x))
    finally:
        _HelperWithDefault.helper.__defaults__ = (0.5,)
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"guard": 2}, s.fallback_reasons
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        assert torch.equal(m(x), _eager(m, x))
    assert graph_opt.stats(m).replays == 1


class _Collector:
    """A module-level object a forward sets and resets, as transformers' output collector does."""

    def __init__(self):
        self.active = False
        self.rows = None


COLLECTOR = _Collector()


@graph_opt.support_graph_optimization
class Collecting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        COLLECTOR.active = True
        y = self.proj(x)
        COLLECTOR.active = False  # what is left after the call: Dynamo stores it after the graph
        COLLECTOR.rows = None
        return y


def test_constants_stored_into_a_global_object_are_stored_by_every_direct_replay():
    """The transformed code's only side effect is storing constants into attributes of an object that
    existed before the call: the replay is still the graph's replay(), followed by those stores."""
    torch.manual_seed(0)
    m = Collecting(graph_opt_config=_cfg(1))
    strategy = _captured(m)
    assert strategy.direct_replays == len(SIZES)
    for real in (1, 3, 8):
        COLLECTOR.active, COLLECTOR.rows = "stale", 5
        x = make_x(real, seed=real)
        with torch.no_grad():
            torch.testing.assert_close(m(x), _eager(m, x), **TOL)
        assert COLLECTOR.active is False and COLLECTOR.rows is None
    assert graph_opt.stats(m).replays == 3


@graph_opt.support_graph_optimization
class Appending(torch.nn.Module):
    """Its forward mutates a list it does not own: not a constant store."""

    def __init__(self, seen):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.seen = seen

    def forward(self, x):
        self.seen.append(1)
        return self.proj(x)


def test_a_list_mutated_by_the_forward_keeps_the_transformed_code():
    seen = []
    m = Appending(seen, graph_opt_config=_cfg(1))
    assert _captured(m).direct_replays == 0
    before = len(seen)
    with torch.no_grad():
        m(make_x(3))
        m(make_x(5))
    assert len(seen) == before + 2  # each call appended, as eager does
    s = graph_opt.stats(m)
    assert s.replays + s.fallbacks == 2  # Dynamo guards the list's length: these calls run without graphs


def test_pure_replay_code_accepts_only_the_constant_stores_it_is_told_of():
    """Dynamo writes such a store as STORE_ATTR (torch 2.11) or through its helper (2.13): both pass."""
    def resets(self, x):
        COLLECTOR.active = False
        return x

    path = frozenset({("COLLECTOR",)})
    assert not pure_replay_code(resets.__code__)
    assert pure_replay_code(resets.__code__, path, frozenset({"active"}))
    assert not pure_replay_code(resets.__code__, path, frozenset({"rows"}))
    (setter, root, attrs, name, value), = replay_stores(resets.__code__, ((("COLLECTOR",), "active", False),))
    assert setter is setattr and root == "COLLECTOR" and attrs == () and name == "active" and value is False


def test_an_attribute_named_like_a_store_path_is_refused_off_that_path():
    """`CTX.cache.dirty = False` allows reading `CTX.cache`, not `self.cache` (a tensor the graph reads)."""
    def gathers(self, x):
        CTX.cache.dirty = False
        return self.cache + x

    def walks(self, x):
        CTX.cache.dirty = False
        return x

    path, stored = frozenset({("CTX", "cache")}), frozenset({"dirty"})
    assert not pure_replay_code(gathers.__code__, path, stored)
    assert pure_replay_code(walks.__code__, path, stored)


class _Request:
    def __init__(self):
        self.ran = False
        self.phase = "queued"
        self.payload = torch.zeros(1024)


REQUEST = _Request()
CTX = None  # named in the tests above


@graph_opt.support_graph_optimization
class Serving(torch.nn.Module):
    """Marks the request being served, a module-level object the server replaces per request."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        REQUEST.ran = True
        REQUEST.phase = "decoded"
        return self.proj(x)


@pytest.mark.parametrize("guarded", [True, False])
def test_stores_reach_the_object_a_rebound_global_names_now(guarded):
    global REQUEST
    torch.manual_seed(0)
    m = Serving(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=SIZES,
                                                          guarded_replays=guarded))
    assert _captured(m).direct_replays == len(SIZES)
    first = weakref.ref(REQUEST)
    for real in (1, 3):
        REQUEST = _Request()  # the next request
        with torch.no_grad():
            torch.testing.assert_close(m(make_x(real, seed=real)), _eager(m, make_x(real, seed=real)), **TOL)
        assert (REQUEST.ran, REQUEST.phase) == (True, "decoded")
    assert graph_opt.stats(m).replays == 2
    import gc

    gc.collect()
    assert first() is None, "the replay keeps the capture's object alive"


@graph_opt.support_graph_optimization
class ReadsItsCache(torch.nn.Module):
    """Reads a plain tensor attribute named like an attribute on a store's path."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.cache = torch.ones(HIDDEN)

    def forward(self, x):
        REQUEST.phase = "decoded"
        return self.proj(x) + self.cache


def test_a_plain_tensor_attribute_changed_after_capture_reaches_the_replay():
    torch.manual_seed(0)
    m = ReadsItsCache(graph_opt_config=_cfg(1))
    _captured(m)
    m.cache = torch.full((HIDDEN,), 10.0)
    x = make_x(3)
    with torch.no_grad():
        torch.testing.assert_close(m(x), _eager(m, x), **TOL)
    m.cache.fill_(3.0)
    with torch.no_grad():
        torch.testing.assert_close(m(x), _eager(m, x), **TOL)


class _Scale:
    def __init__(self):
        self.scale = 1


@graph_opt.support_graph_optimization
class _ScaledByState(torch.nn.Module):
    def __init__(self, graph_opt_config=None):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, st):
        return self.lin(x) * st.scale


def test_a_number_the_graph_takes_from_an_objects_attribute_is_never_replayed_directly():
    """The attribute changed while the sizes were captured: Dynamo made it a dynamic int, an input of
    the graph with no value guard. The graph's replay() alone would keep the capture's value; the
    pieces compare it at each replay instead."""
    torch.manual_seed(0)
    m = _ScaledByState(graph_opt_config=_cfg(1)).eval()
    st = _Scale()

    def make(n):
        st.scale += 1
        return make_x(n), st

    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        graph_opt.capture_model(m, make, progress=False)
        strategy = state_of(m).runner.strategy
        assert any(f.numbers_from_state for f in strategy.forwards)  # the recompiled graph takes st.scale
        assert strategy.direct_replays < len(SIZES)
        for scale in (7, 9):
            st.scale = scale
            for n in SIZES:
                x = make_x(n)
                assert torch.allclose(m(x, st), type(m).forward(m, x, st), **TOL), f"scale {scale}, {n} rows"
