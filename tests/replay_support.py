"""What the inference replay-safety tests share on both frameworks (tests/both/test_replay_*.py, the torch
and Paddle ones, tests/gpu): a decorated model and its undecorated twin, what a replay equals bitwise, and
model parts the zoos build on. `F` is a framework's replay shim (tests/torch_zoo/replay_ops.py,
tests/paddle_zoo/replay_ops.py). Imports neither framework.
"""
from __future__ import annotations

import logging

import graph_opt
from graph_opt.decorator import state_of


SIZES = [2, 4, 8]


HIDDEN = 8


def pair(F, cls, level=0, full=True, sizes=SIZES, dims=None, config=None, **options):
    """(decorated model, undecorated twin with the same weights)."""
    F.seed(0)
    decorated = graph_opt.support_graph_optimization(type(cls.__name__, (cls,), {}), dynamic_arg_dims=dims, **options)
    settings = dict(graph_opt_level=level, cudagraph_capture_sizes=sizes, full_cuda_graph=full)
    settings.update(config or {})
    model = F.place(decorated(graph_opt_config=graph_opt.GraphOptConfig(**settings)))
    twin = F.place(cls())
    F.copy_weights(twin, model)
    return model, twin


def same(F, level, a, b):
    """A replay's output against eager's: bitwise at levels 0 and 1 (the same kernels on the same
    padded rows, real rows cut), within 1e-5 at level 2 (Inductor fuses kernels)."""
    return F.equal(a, b) if level < 2 else F.close(a, b)


def eager_padded(F, model, *args, sizes=SIZES, batch=(0,), pads=None, **kwargs):
    """What a replay of this call equals bitwise: `model` on the batch arguments (`batch`: positions or
    keyword names) padded with rows of their pad value (`pads`: position or name -> value, else 0) up to
    the captured size the call replays, its tensor outputs cut to the real rows. Eager on the real rows
    alone may round otherwise (BLAS blocks a product of 3 rows otherwise than one of 4)."""
    pads = pads or {}
    first = batch[0]
    real = F.shape(args[first] if isinstance(first, int) else kwargs[first])[0]
    padded = min(s for s in sizes if s >= real)

    def pad(key, a):
        return F.pad_rows(a, padded, pads.get(key, 0)) if key in batch and a is not None else a

    out = model(*[pad(i, a) for i, a in enumerate(args)], **{k: pad(k, a) for k, a in kwargs.items()})

    def cut(out):
        if isinstance(out, dict):
            return type(out)((k, cut(v)) for k, v in out.items())
        if isinstance(out, (tuple, list)):
            return type(out)(cut(v) for v in out)
        shape = F.shape(out) if hasattr(out, "shape") else []
        return F.rows(out, 0, real) if shape and shape[0] == padded else out

    return cut(out)


def capture(F, model, make_inputs, **kw):
    with F.graphs():
        report = graph_opt.capture_model(model, make_inputs, progress=False, **kw)
    assert report.failed is None, report.failed
    return report


def warned(caplog, *fragments):
    msgs = [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]
    return [m for m in msgs if all(f in m for f in fragments)]


def shortcut_taken(m, monkeypatch):
    """From here on a call that is not answered by the shortcut fails the test."""
    def full_path(*a, **k):
        raise AssertionError("the call took the full dispatch")
    monkeypatch.setattr(state_of(m).runner, "_dispatch", full_path)


def in_place_counter(kind):
    """A new count of `kind` a forward advances in place: a set, a numpy array, a bytearray, an array.array."""
    import array

    import numpy
    return {"set": set, "numpy": lambda: numpy.zeros(1), "bytearray": bytearray, "array": lambda: array.array("d")}[kind]()


def advance_in_place(counter) -> float:
    """Advance the count in place (no new binding) and return it."""
    if isinstance(counter, set):
        counter.add(len(counter))
        return float(len(counter))
    if hasattr(counter, "dtype"):  # numpy
        counter += 1
        return float(counter[0])
    counter.append(1)
    return float(len(counter))


class CountsInPlaceMixin:
    """A count kept in an object the forward changes in place (a set, a numpy array ...: `kind`). Mixed
    into each framework's Scaled (self.lin)."""

    kind = "set"

    def __init__(self):
        super().__init__()
        self.seen = in_place_counter(self.kind)

    def forward(self, x):
        return self.lin(x) * advance_in_place(self.seen)


class KeepsRowsMixin:
    """Records the rows of its last call in a Python value (not read by the math)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def forward(self, x):
        self.rows = x.shape[0]
        return self.lin(x)


def captured_pair(F, cls, level=1):
    """(decorated model captured at SIZES, its undecorated twin): a model of HIDDEN features."""
    m, twin = pair(F, cls, level)
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    return m, twin


def replays_as_eager(F, m, twin, seed=1):
    """A call of 3 rows: bitwise what the twin computes on them padded to the captured size."""
    x = F.randn(3, HIDDEN, seed=seed)
    with F.no_grad():
        assert F.equal(m(x), eager_padded(F, twin, x))
