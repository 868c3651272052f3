"""Checks made once per call structure, at its first capture, by running the plain forward a few times.

- Which dimension of each output is the batch (output_layout): the forward runs on the capture inputs
  cut to another number of rows, and its outputs are compared with those at the padded size.
- Which arguments the plain forward writes in place (their version counters): a static path that
  does not write them back (Paddle's SOT: "not support input out tensor") cannot replay such a forward.
- Whether real rows depend on the padding rows: the forward runs twice at the padded size with the
  last row as padding, once holding the pad values and once a copy of row 0 (valid data, so index
  arguments stay in range). A row-independent forward gives the same real rows both times; one with
  a batch statistic or attention across the batch does not, and a replay at that size would then
  answer a smaller call with other values than eager: one warning names the output.

These runs are eager warmups with the capture inputs: like every warmup they have the forward's side
effects (a KV-cache write), and they run inside the capture phase (no_grad, is_capturing() true). A
forward that raises in them is not a capture failure: the check is skipped and logged, and the output
layout is learned from the next captured size instead.
"""
from __future__ import annotations

import logging
from typing import List

from . import output_layout
from .pytree import TENSOR, flatten, leaf_paths, unflatten

logger = logging.getLogger("graph_opt")

_RELATIVE_TOLERANCE = 1e-5  # real rows that differ by more, relative to the output's magnitude, depend on padding


def probe(runner, sig, padded: int, static: List, leaves: List) -> None:
    """Learn sig's output layout and check row independence (see the module doc). Leaves the static
    buffers changed: the caller copies the capture inputs in again."""
    adapter = runner.adapter
    copied = runner.config.cudagraph_copy_inputs  # without copies the buffers are the caller's: not written
    try:
        if padded >= 2 and copied:
            first, second = _padding_runs(runner, sig, padded, static, leaves)
            sig.observe(output_layout.observe(adapter, first, padded))
        other = padded - 1 if padded >= 2 else (2 if copied and runner.max_size >= 2 else None)
        if other is not None:
            source = static if other < padded else sig.buffers
            rows = [t if d is None else adapter.narrow(t, d, other) for t, d in zip(source, sig.dims)]
            sig.observe(output_layout.observe(adapter, _run(runner, sig, rows), other))
    except Exception as exc:  # the forward cannot run these inputs: learn from the next size instead
        logger.info("%s: the forward could not run the capture inputs with another number of rows (%s: %s); "
                    "the outputs' batch dimensions are learned from the next captured size", runner.name,
                    type(exc).__name__, exc)
        return
    if padded >= 2 and copied and sig.layout.known:
        dependent = _row_dependent(adapter, sig.layout, first, second, padded - 1)
        if dependent:
            message = (f"the real rows of {', '.join(dependent)} depend on the padding rows (the same inputs with other "
                       f"values in the padding rows gave other real rows at size {padded}): a call of fewer rows than "
                       "a captured size gets other values than eager. Keep the forward row-independent (no batch "
                       "statistics, no attention across the batch) or capture every batch size it is called with")
            logger.warning("%s: %s", runner.name, message)
            runner.capture_notes.append(message)


def _run(runner, sig, tensors):
    """The plain forward on these tensors; the leaves and model buffers it writes in place go to
    sig.eager_writes and sig.eager_buffer_writes."""
    adapter = runner.adapter
    before = [adapter.version(t) for t in tensors]
    buffers = runner.model_state.buffer_versions()
    args, kwargs = unflatten(sig.spec, tensors, template=sig.template)
    out = runner.eager(*args, **kwargs)
    sig.eager_writes.update(i for i, (t, v) in enumerate(zip(tensors, before)) if adapter.version(t) != v)
    sig.eager_buffer_writes.update(written(buffers, runner.model_state.buffer_versions()))
    return out


def written(before, after) -> set:
    """Names whose version counter moved between two buffer_versions() lists."""
    return {name for (name, v0), (_, v1) in zip(before, after) if v0 != v1}


def _padding_runs(runner, sig, padded: int, static: List, leaves: List):
    """Outputs (cloned) of the forward with the last row as padding: holding the pad values, then row 0.
    Each run starts from the capture inputs (a forward may write its inputs)."""
    adapter = runner.adapter
    real = padded - 1
    padding = sig.padding
    runner._copy_in(sig, static, leaves, padded)
    padding.touched(padded)
    padding.wrote(real)  # the last row holds the pad values
    first = _clone(adapter, _run(runner, sig, static))
    runner._copy_in(sig, static, leaves, padded)
    for t, d in zip(static, sig.dims):
        if d is not None:
            adapter.copy_(adapter.rows(t, d, real, padded), adapter.rows(t, d, 0, 1))
    padding.touched(padded)
    second = _clone(adapter, _run(runner, sig, static))
    runner._copy_in(sig, static, leaves, padded)
    return first, second


def _clone(adapter, outputs):
    leaves, spec = flatten(outputs, adapter.is_tensor)
    return unflatten(spec, [adapter.clone(t) for t in leaves], template=outputs)


def _row_dependent(adapter, layout, first, second, real: int) -> List[str]:
    """Paths of outputs whose real rows differ between the two runs."""
    a, spec = flatten(first, adapter.is_tensor)
    b, _ = flatten(second, adapter.is_tensor)
    paths = [p for p, kind in leaf_paths(spec) if kind is TENSOR]
    uncut = set(layout.uncuttable)
    found = []
    for path, x, y, dim in zip(paths, a, b, layout.dims):
        if any(u.startswith(path + " ") for u in uncut):
            continue
        if dim is not None:
            x, y = adapter.narrow(x, dim, real), adapter.narrow(y, dim, real)
        if adapter.max_abs_diff(x, y) > _RELATIVE_TOLERANCE * max(1.0, adapter.max_abs(x)):
            found.append(path)
    return found
