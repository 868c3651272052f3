"""Inference replays never silently wrong on torch in how a call passes its arguments: one that cannot be
copied in, code and callable objects as arguments, keyword-only and positional-only parameters, defaults
a wrapper fills, calls from two threads with hooks. Simulated graphs on CPU; tests/gpu runs them on a
device."""
import functools
import operator
import threading

import pytest
import torch

import graph_opt
from replay_support import HIDDEN, capture, eager_padded, pair, same, warned
from torch_zoo.replay import Scaled

_CI_SECONDS = 1  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)
# Level 2 on torch is left to tests/gpu here: Inductor changes nothing these cases check (tests/conftest.py)
_INDUCTOR_ON_CPU = set()


class _SlotWrites(torch.nn.Module):
    """Writes each row into a cache at its slot; a padding row's slot (-1) writes the scratch row 64,
    which no real slot uses (so no index is written twice by one call)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cache", torch.zeros(65, HIDDEN))

    def forward(self, slots, x):
        h = self.lin(x)
        self.cache.index_copy_(0, torch.where(slots >= 0, slots, 64), h)
        return h


def test_an_argument_that_cannot_be_copied_in_is_answered_eagerly(F, logs):
    """A copy into the static buffers that raises (a sparse tensor) is a failed replay: eager answers
    and the graphs are dropped, with one warning. An argument on another device (a meta tensor) is refused
    before anything is copied (GraphOptInputError naming it): the graphs stay, and the padding rows still
    hold the pad value, so a later padded call never writes the refused call's slots."""
    m, twin = pair(F, _SlotWrites, 0, sizes=[2, 4, 8], pad_values={"slots": -1})
    capture(F, m, lambda n: (F.arange(n, start=50), F.randn(n, HIDDEN, seed=n)))
    twin.cache.copy_(m.cache)
    with torch.no_grad():
        for n in (4, 3, 2):  # the shortcut's plans for 4, 3 and 2 rows
            slots, x = F.arange(n), F.randn(n, HIDDEN, seed=n)
            assert F.close(m(slots, x), eager_padded(F, twin, slots, x, batch=(0, 1), pads={0: -1}))
        with pytest.raises(graph_opt.GraphOptInputError, match="argument 'x' is on device meta"):
            m(F.arange(4, start=20), torch.empty(4, HIDDEN, device="meta"))
        slots, x = F.arange(3, start=30), F.randn(3, HIDDEN, seed=3)  # padded to 4: row 3's slot must be -1
        assert F.close(m(slots, x), eager_padded(F, twin, slots, x, batch=(0, 1), pads={0: -1}))
        assert torch.equal(m.cache[:64], twin.cache[:64]), "a padded call wrote a slot eager never writes"
        assert graph_opt.stats(m).disabled_reason is None
        x = F.randn(4, HIDDEN, seed=4)
        assert F.close(m(F.arange(4, start=40), x.to_sparse()), twin(F.arange(4, start=40), x))
    s = graph_opt.stats(m)
    assert "replay of size 4 failed" in s.disabled_reason and s.replay_failures == 1
    assert len(warned(logs, "replay of size 4 failed")) == 1


class _Applies(Scaled):
    def forward(self, x, act):
        return act(self.lin(x))


class _Processor:
    def __init__(self):
        self.scale = 0.5

    def __call__(self, t):
        return t * self.scale


def _plain_callables():
    return {"function": torch.nn.functional.gelu, "builtin": torch.tanh, "lambda": lambda t: t * 2,
            "partial": functools.partial(torch.softmax, dim=-1), "operator": torch.ops.aten.relu.default,
            "packet": torch.ops.aten.relu, "methodcaller": operator.methodcaller("relu"),
            "unbound": torch.Tensor.relu}


def _object_callables():
    proc = _Processor()
    return {"object": proc, "module": torch.nn.Tanh(), "bound method": proc.__call__,
            "partial of it": functools.partial(proc), "partial binding it": functools.partial(_Processor.__call__, proc)}


@pytest.mark.parametrize("kind", sorted(_plain_callables()))
def test_code_passed_as_an_argument_is_a_value_at_level_0(F, kind):
    act = _plain_callables()[kind]
    m, twin = pair(F, _Applies, 0)
    capture(F, m, lambda n: (F.randn(n, HIDDEN, seed=n), act))
    with torch.no_grad():
        x = F.randn(3, HIDDEN, seed=1)
        assert torch.equal(m(x, act), eager_padded(F, twin, x, act))
    assert graph_opt.stats(m).replays == 1


@pytest.mark.parametrize("kind", sorted(_object_callables()))
def test_a_callable_object_passed_as_an_argument_is_refused_at_level_0(F, kind):
    """Its attributes (a processor's scale) would be baked into the graph; a mutated one looks the same."""
    act = _object_callables()[kind]
    m, twin = pair(F, _Applies, 0)
    with F.graphs(), pytest.raises(graph_opt.GraphOptInputError, match=r"forward argument act \(a "):
        graph_opt.capture_model(m, lambda n: (F.randn(n, HIDDEN, seed=n), act), progress=False)


def test_calls_with_hooks_overlapping_from_two_threads_leave_no_forward_attribute_behind(F):
    """The decorated call installs the plugin as the instance's `forward` while the framework runs the
    hooks around it. Thread A enters, B enters, A leaves, B leaves: B must not put back A's
    temporary attribute (afterwards `m.forward(x)` would have replayed a graph, not run forward)."""
    m, twin = pair(F, Scaled, 0)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def hook(module, args):
        if threading.current_thread().name == "A":
            a_in.set()
            b_in.wait(5)
        elif threading.current_thread().name == "B":
            b_in.set()
            a_done.wait(5)

    m.register_forward_pre_hook(hook)
    outs = {}

    def call(name, rows):
        if name == "B":
            a_in.wait(5)
        try:
            with torch.no_grad():
                outs[name] = m(F.randn(rows, HIDDEN, seed=rows))
        except graph_opt.GraphOptError as exc:  # the runner admits one thread at a time
            outs[name] = exc
        if name == "A":
            a_done.set()

    with F.graphs():
        threads = [threading.Thread(target=call, args=(name, rows), name=name) for name, rows in (("A", 3), ("B", 5))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert sorted(outs) == ["A", "B"]
    assert "forward" not in m.__dict__
    replays = graph_opt.stats(m).replays
    with torch.no_grad():
        x = F.randn(4, HIDDEN, seed=1)
        assert torch.equal(m.forward(x), twin(x))
    assert graph_opt.stats(m).replays == replays  # the plain forward ran


class _KeywordOnly(Scaled):
    def forward(self, x, scale=1.0, *, flag=False):
        y = self.lin(x) * scale
        return -y if flag else y


@pytest.mark.parametrize("level", [0, 1])
def test_a_keyword_only_argument_given_its_default_replays_as_the_call_without_it(F, level):
    m, twin = pair(F, _KeywordOnly, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.graphs(), torch.no_grad():
        for kwargs in ({}, {"flag": False}, {"scale": 1.0, "flag": False}):
            assert torch.equal(m(x, **kwargs), eager_padded(F, twin, x, **kwargs)), kwargs
        assert torch.equal(m(x, flag=True), twin(x, flag=True))  # another value: its own signature, not captured
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallback_reasons == {"new_signature": 1}, s


class _TupleDefaults(Scaled):
    def forward(self, x, *, eps=(0.0,), n=(1,)):
        y = self.lin(x)
        return y + (1.0 / torch.tensor(eps[0])).clamp(-5, 5) + float(torch.tensor(n[0]).is_floating_point())


@pytest.mark.parametrize("level", [0, 1])
def test_a_keyword_only_tuple_equal_to_its_default_only_by_value_is_its_own_signature(F, level):
    """(-0.0,) == (0.0,) and (1.0,) == (1,) in Python; to the forward they are other values."""
    m, twin = pair(F, _TupleDefaults, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    x = F.randn(3, HIDDEN, seed=1)
    with F.graphs(), torch.no_grad():
        for kwargs in ({}, {"eps": (0.0,)}, {"n": (1,)}):  # the captured call: replayed
            assert torch.equal(m(x, **kwargs), eager_padded(F, twin, x, **kwargs)), kwargs
        for kwargs in ({"eps": (-0.0,)}, {"n": (1.0,)}, {"n": (True,)}):  # signatures of their own: eager
            assert torch.equal(m(x, **kwargs), twin(x, **kwargs)), kwargs
    s = graph_opt.stats(m)
    assert s.replays == 3 and s.fallback_reasons == {"new_signature": 3}, s


def _fills_from_config(fn):
    """As transformers' merge_with_config_defaults: a parameter the call does not give by name comes from
    the model's config."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if "scale" not in kwargs:
            kwargs["scale"] = self.default_scale
        return fn(self, *args, **kwargs)
    return wrapper


class _ConfigDefaults(Scaled):
    default_scale = 2.0

    @_fills_from_config
    def forward(self, x, mask=None, scale=None):
        y = self.lin(x) * scale
        return y if mask is None else y * mask


@pytest.mark.parametrize("level", [0, 1])
def test_a_forward_whose_wrapper_fills_parameters_the_call_leaves_out_gets_the_call_as_made(F, level, logs):
    """m(x) reaches the forward as m(x), not with every default filled in by position (which such a
    wrapper takes for given, and then gives `scale` twice)."""
    m, twin = pair(F, _ConfigDefaults, level)
    x = F.randn(3, HIDDEN, seed=1)
    with F.graphs(), torch.no_grad():
        for kwargs in ({}, {}, {"scale": 3.0}, {"mask": F.randn(3, HIDDEN, seed=2)}):
            assert torch.equal(m(x, **kwargs), eager_padded(F, twin, x, batch=(0, "mask"), **kwargs)), kwargs
    s = graph_opt.stats(m)
    assert s.disabled_reason is None and s.replays >= 1, s


class _PositionalOnly(Scaled):
    def forward(self, x, mask=None, bias=None, /, scale=1.0):
        y = self.lin(x) * scale
        y = y if mask is None else y * mask
        return y if bias is None else y + bias


@pytest.mark.parametrize("level", [0, 1])
def test_a_forward_with_positional_only_parameters_gets_them_by_position(F, level):
    """m(x, None, bias): the default-holding mask is passed as given, since bias cannot go by name."""
    m, twin = pair(F, _PositionalOnly, level)
    x, bias = F.randn(3, HIDDEN, seed=1), F.randn(3, HIDDEN, seed=2)
    with F.graphs(), torch.no_grad():
        for args, kwargs in (((), {}), ((None, bias), {}), ((None, bias), {}), ((), {"scale": 3.0})):
            assert torch.equal(m(x, *args, **kwargs), eager_padded(F, twin, x, *args, batch=(0, 1, 2), **kwargs)), \
                (args, kwargs)
    assert graph_opt.stats(m).disabled_reason is None
