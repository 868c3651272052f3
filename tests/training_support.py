"""What the tests of graph_opt.autocudagraph share on both frameworks: eager and graphed twins of a block,
and one training step checked against eager. `T` is a framework's training shim (tests/torch_zoo/training.py,
tests/paddle_zoo/training.py). Imports neither framework.
"""
from __future__ import annotations

import logging

import graph_opt


def graph_warnings(caplog):
    return [r for r in caplog.records if r.name == "graph_opt" and r.levelno >= logging.WARNING]


def twins(T, **kw):
    """(eager block, graphed block) with equal weights."""
    ref = T.block(**kw)
    return ref, graph_opt.autocudagraph(T.copy_block(ref), **_graph_args(kw))


def _graph_args(kw):
    return {k: kw[k] for k in ("warmup_steps", "dispatch_key_fn", "max_graphs") if k in kw}


def run_step(T, model, x, seed, *, extra=None):
    """One forward + backward from a fresh leaf copy of x; returns (output, input grad)."""
    xin = T.leaf(x, True)
    T.seed(seed)
    out = model(xin) if extra is None else model(xin, extra)
    y = out["y"] if isinstance(out, dict) else out
    T.loss(y).backward()
    return y, T.grad(xin)


def same_grad(T, got, want) -> bool:
    """Both None (a frozen parameter), or bitwise equal."""
    return got is None and want is None or got is not None and want is not None and T.equal(got, want)


def assert_same_step(T, ref, m, x, seed, **kw):
    y_ref, gx_ref = run_step(T, ref, x, seed, **kw)
    y, gx = run_step(T, m, x, seed, **kw)
    assert T.equal(y, y_ref), f"outputs differ by {T.max_diff(y, y_ref)}"
    assert T.equal(gx, gx_ref), f"input grads differ by {T.max_diff(gx, gx_ref)}"
    for (name, p_ref), (_, p) in zip(T.named_params(ref), T.named_params(m)):
        got, want = T.grad(p), T.grad(p_ref)
        assert same_grad(T, got, want), \
            f"grad of {name}: {'None' if got is None else 'set'} vs eager's {'None' if want is None else 'set'}" \
            if got is None or want is None else f"grad of {name} differs by {T.max_diff(got, want)}"
