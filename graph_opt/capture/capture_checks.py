"""After each size is captured: its replay of the smallest call it serves, against eager on those rows.

A captured size p answers every call of q..p rows (q: one more than the next smaller captured size),
by running the forward on p rows and cutting the outputs. That equals eager on q rows only where the
forward is row-independent and does not branch on the batch size. So right after capturing p, the
capturer runs the plain forward on q rows of the capture inputs, replays p for the same q rows as a call
would (copied in, padding rows holding the pad values, cut), and compares. Where they differ (a batch
statistic, attention across the batch, `if x.shape[0] > 4`), calls of a size that is not captured run
without graphs from then on, with one warning naming the output: never a replay that differs from eager.
Where the model's state (its buffers and the tensors its modules hold: held_state.py) and the marked
arguments fit in STATE_BYTES, the two runs start from one copy of them, and what they leave there is compared as well (a step counter is no difference; a count of
rows that padding rows would add to is).

The same eager run gives the output layout its second batch size (output_layout: which dimension of
each output is the batch), and says which arguments and model buffers the plain forward writes in
place (compared with what the captured path writes: Paddle's SOT drops such writes).

These runs are warmups with the capture inputs: they have the forward's side effects (a KV-cache
write), and the eager one runs inside the capture phase, on the branch the graph records. A forward that raises in them is not
a capture failure: the check is skipped and logged, and only calls of a captured size replay until
another size teaches the layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ..replay import output_layout, static_inputs
from .writes import buffer_snapshot, buffers_changed, changed, snapshot, written
from ..replay.captured_size import _MISMATCH, _MOVED
from ..errors import CaptureError
from ..replay.host_outputs import HostRingFull
from ..pytree import TENSOR, flatten, leaf_paths, unflatten

logger = logging.getLogger("graph_opt")

_ULPS = 8  # real rows may differ by this many units in the last place of the largest value: other kernels
_FUSED = 10  # level 2's fused kernels round otherwise again


def smallest_call(capturer, padded: int) -> int:
    """The fewest rows a call replaying `padded` has: one more than the next smaller captured size."""
    return max((s for s in capturer.table.sizes if s < padded), default=0) + 1


def expect(capturer, sig, static: List, leaves: List, padded: int, warm=None):
    """Inside the capture phase, before the capture (on the branch the graph records): the plain
    forward on the smallest call's rows of the capture inputs, cloned; None where there is nothing to
    compare. Also teaches the output layout its two sizes: `padded` from `warm`, the warmup's outputs
    (or an eager run where the strategy's warmup returns none)."""
    adapter = capturer.adapter
    rows = smallest_call(capturer, padded)
    try:
        if not sig.layout.known:
            at_padded = warm if warm is not None else _run(capturer, sig, static)
            sig.observe(output_layout.observe(adapter, at_padded, padded))
        if rows >= padded:  # only calls of exactly `padded` rows replay it
            if not sig.layout.known:
                _observe_other_size(capturer, sig, static, padded)
            return None
        small = _probe_rows(adapter, leaves, sig.dims, rows)
        static_inputs.copy_in(capturer.adapter, sig, static, small, padded)
        own = [t if d is None else adapter.narrow(t, d, rows) for t, d in zip(static, sig.dims)]
        values = capturer.model_state.held_state()
        expected = _clone(adapter, _run(capturer, sig, own))
        if values.advanced():  # a Python value this run set otherwise than the padded runs: validate compares
            capturer.python_stores_seen = True
        values.rebound()  # tensors it bound for its own rows (a mask cached per shape) are the check's, not a call's
    except Exception as exc:  # the forward cannot run these rows: nothing checks the padded calls
        if rows >= padded:  # the layout's probe at another size only: learn it from the next size instead
            logger.info("%s: the forward could not run the capture inputs at another size (%s: %s); only calls of "
                        "a captured size replay until another size is captured", capturer.name, type(exc).__name__, exc)
            return None
        return Unchecked(f"the plain forward could not run a call of {rows} rows of the capture inputs "
                         f"({type(exc).__name__}: {exc})")
    sig.observe(output_layout.observe(adapter, expected, rows))
    return expected


@dataclass(frozen=True)
class Unchecked:
    """expect's answer where the padded calls could not be checked: validate blocks them."""

    why: str


def validate(capturer, sig, entry, leaves: List, expected) -> None:
    """After the capture phase: the replay of `entry` for the smallest call it serves, compared with
    `expected` (see expect). Blocks calls of sizes that are not captured where they differ, or where
    the check itself fails: a padded call nothing checked must not replay."""
    if isinstance(expected, Unchecked):
        _block(capturer, sig, f"padded calls of size {entry.padded_size} could not be checked: {expected.why}")
        return
    if expected is None or not sig.layout.known or sig.layout.exact_only:
        return
    branches = capturer.strategy.value_branches
    if branches:
        why = (f"the forward reads a tensor's value on the host ({', '.join(branches)}: an `if` or `while` on a "
               "tensor, `.item()`, `bool(t)`), so its Python depends on the values, and a padded call would decide "
               "it over the padding rows too (`if x.min() > 0` sees the pad value). Capture every batch size the "
               "model is called with, or keep the branch out of forward")
        if why not in sig.layout.blocked:  # once per signature, not per size
            _block(capturer, sig, why)
        return
    try:
        _validate(capturer, sig, entry, leaves, expected)
    except Exception as exc:
        _block(capturer, sig, f"the check of padded calls for size {entry.padded_size} failed: {type(exc).__name__}: "
                            f"{exc} (a bug of graph_opt's: please report it)")


def _block(capturer, sig, why: str) -> None:
    """Padded calls of this signature run without graphs from now on: one warning, and a capture note."""
    sig.block(why)
    logger.warning("%s: %s; calls of a size that is not captured run without graphs", capturer.name, why)
    capturer.capture_notes.append(why)


def _validate(capturer, sig, entry, leaves: List, expected) -> None:
    adapter = capturer.adapter
    padded = entry.padded_size
    rows = smallest_call(capturer, padded)
    small = _probe_rows(adapter, leaves, sig.dims, rows)
    if _rows_alike(adapter, sig, small):
        _block(capturer, sig, f"padded calls of size {padded} could not be checked: every row of the capture inputs "
                            "holds the pad value (all-zero token ids, say), so a forward that mixes rows would look "
                            "row-independent. Give make_inputs rows that differ (random ids in range)")
        return
    state = _state(capturer, sig, leaves)
    try:
        got = _check_replay(adapter, entry, small, rows)  # as a call of `rows` rows: copied in, padded, replayed, cut
    except HostRingFull:  # the caller holds every slot unread: its next call would say the same
        raise
    except Exception as exc:  # the calls will meet it too (GraphRunner._replay_failed); padded ones need not
        why = f"the replay of size {padded} for a call of {rows} rows raised {type(exc).__name__}: {exc}"
        sig.block(why)
        logger.warning("%s: %s; calls of a size that is not captured run without graphs", capturer.name, why)
        return
    if got is None:
        return
    with adapter.no_grad():  # an output may be a view of a parameter, made under no_grad by the replay
        differing = _differing(adapter, got, expected, capturer.config.graph_opt_level)
    if state or state is not None and capturer.python_stores_seen:
        # The runs may advance state the forward writes (a step counter, a cache, a Python value such as
        # `self.rows = x.shape[0]`), or write it at one size and not the other: compared again from one
        # copy of it, what they leave there included. (Whether the first eager run wrote it is not known:
        # a write through Paddle's set_value moves no counter.)
        fair = _from_one_state(capturer, sig, entry, small, rows, state, later=leaves)
        if fair is not None:
            differing, read_later = fair
            if read_later and not differing:
                _padded_calls_differ(
                    capturer, sig, f"a replay of size {padded} for a call of {rows} rows: its padding rows write "
                                 f"{', '.join(read_later)} where a later call reads or writes (a state per row, "
                                 "`h[:n] = ...`, or a count per token id that padding rows would advance)",
                    "Give the padding rows a slot or id that no call reads (pad_values), or capture every batch "
                    "size the model is called with")
                return
            differing = differing + read_later
    if differing:
        wrong = _captured_path_differs(capturer, sig, entry) if capturer.strategy.traits.verify_path else []
        training = _in_training(capturer)
        if wrong:
            why = (f"a replay of size {padded} gave other values than the plain forward on the same {padded} rows "
                   f"in {', '.join(wrong)}: " + (training + ". Call model.eval() before capture_model()" if training else "the captured path computes otherwise "
                   f"({capturer.strategy.traits.verify_path}), so the model runs its plain forward. Use graph_opt_level=0 for it"))
            capturer.capture_failed(CaptureError(why), padded)
            return
        _padded_calls_differ(
            capturer, sig, f"a replay of size {padded} for a call of {rows} rows gave other values than eager in "
                         f"{', '.join(differing)} (" + (training or "the forward reads other rows or branches on the "
                         f"batch size{_PADDING_STATE if any(d.startswith(_STATE_NAMES) for d in differing) else ''}") + ")",
            "Call model.eval() before capture_model()" if training else "Keep the forward row-independent (no batch "
            "statistics, no attention across the batch, no branch on the batch size), or capture every batch size it is called with")


def _in_training(capturer) -> str:
    """The likely cause where the model's dropout or batch norm is in training mode, else ''."""
    model = getattr(capturer.model_state, "model", None)
    found = capturer.adapter.training_modules(model) if model is not None else []
    return f"{', '.join(found)} in training mode, whose outputs change between runs or with the batch" if found else ""


def _padded_calls_differ(capturer, sig, why: str, remedy: str) -> None:
    """Padded calls of this signature run without graphs from now on: one warning with the remedy, and a
    capture note."""
    sig.block(why)
    message = f"{why}: calls of a size that is not captured run without graphs. {remedy}"
    logger.warning("%s: %s", capturer.name, message)
    capturer.capture_notes.append(message)


def _captured_path_differs(capturer, sig, entry) -> List[str]:
    """Where padded calls differ from eager: is it the batch (row dependence), or the captured path itself?
    The replay of a call of exactly the padded size, on the static buffers as they are, against the plain
    forward on copies of them, each from the same state: what differs (none where only the batch is to
    blame)."""
    adapter = capturer.adapter
    padded = entry.padded_size
    static = [t if d is None else adapter.narrow(t, d, padded) for t, d in zip(entry.inputs, sig.dims)]
    state = _state(capturer, sig, static)
    if state is None:  # too large to copy aside: the padded check's verdict stands
        return []
    found = _from_one_state(capturer, sig, entry, static, padded, state)
    return [] if found is None else found[0]


STATE_BYTES = 64 << 20  # what a check (or a capture at a call) copies aside to start from one state, at most
_STATE_NAMES = ("buffer ", "attribute ", "argument ")
_PADDING_STATE = (", or its padding rows change state the real rows do not, such as a count of the rows "
                  "seen: padded calls would change it otherwise than eager")


def _held_arguments(sig) -> set:
    """Arguments whose own memory ends up holding what the forward writes: those read in place
    (mark_static_address), and those without a batch dimension it writes, whose static copy a replay
    writes back whole, padding rows' writes included."""
    return sig.in_place | {i for i in sig.mutated if sig.dims[i] is None}


def _state(capturer, sig, leaves) -> Optional[List[Tuple[str, Any]]]:
    """(name, tensor) of what a run of the forward may advance: the model's buffers, the tensors its
    modules hold in other attributes, and the arguments that hold its writes (_held_arguments). None
    where they hold more than STATE_BYTES."""
    adapter = capturer.adapter
    names = capturer.signatures.leaf_names(sig.spec)
    found, seen = [], set()
    for name, t in capturer.model_state.held_state().tensors + [(f"argument {names[i]}", leaves[i])
                                                              for i in sorted(_held_arguments(sig))]:
        if id(t) not in seen:
            seen.add(id(t))
            found.append((name, t))
    if sum(adapter.nbytes(t) for _, t in found) > STATE_BYTES:
        return None
    return found


def _from_one_state(capturer, sig, entry, inputs, rows: int, state, later=None) -> Optional[Tuple[List[str], List[str]]]:
    """The plain forward on `inputs` (copies of those not read in place) and the replay of `entry` for a
    call of `rows` rows of them, each started from `state` (_state: the model's state, the arguments
    read in place) as it is now, put back after: the output paths and the state that end otherwise, and
    (with `later`, the inputs of a call of the padded size) the state that only the replay's padding rows
    wrote where that later call reads it (_read_later). None where the runs cannot take these inputs."""
    adapter = capturer.adapter
    saved = [adapter.clone(t) for _, t in state]
    values = capturer.model_state.held_state()  # the Python values, put back as the tensors are

    def put_back():
        for (_, t), s in zip(state, saved):
            adapter.copy_(t, s)
        values.put_back_values()
        values.rebound()

    copies = _own_copies(adapter, _held_arguments(sig), inputs)
    try:
        with adapter.no_grad():
            want = _clone(adapter, _run(capturer, sig, copies))
            after = [adapter.clone(t) for _, t in state]
            eager_values = capturer.model_state.held_state()
            put_back()
            got = _check_replay(adapter, entry, inputs, rows)
            if got is None:
                return None
            level = capturer.config.graph_opt_level
            differing = _differing(adapter, got, want, level)
            # a Python value the replay leaves otherwise than eager (the padded size's `x.shape[0]`)
            differing += eager_values.advanced()
            # Where this run changed the state, the replay must leave what eager does; elsewhere only its
            # padding rows wrote (a KV-cache slot reserved for padding), which calls allow.
            differing += [name for (name, t), b, a in zip(state, saved, after)
                          if adapter.max_abs_diff(adapter.keep_changes(b, a, t), a) > _tolerance(adapter, a, level)]
            # Where only the replay wrote (its padding rows), calls allow it only if no later call reads it:
            # a KV-cache slot reserved for padding is never read; a per-row state's rows past the call's own are.
            read_later = [] if later is None else _read_later(capturer, sig, entry, inputs, rows, state, saved, later,
                                                              put_back)
    except Exception:  # the first check's verdict stands
        return None
    finally:
        with adapter.no_grad():
            put_back()
    return differing, read_later


def _read_later(capturer, sig, entry, inputs, rows: int, state, saved, later, put_back) -> List[str]:
    """Names of the state tensors where the replay of a call of `rows` rows of `inputs` wrote elements that
    eager on those rows leaves as they were (its padding rows wrote them), and later calls, started from
    what eager left, compute otherwise with those writes in it. Done from the state as it is (`saved`) and
    from it shifted by a ramp (adapter.shifted): a write of the value an element already held (a state of
    zeros, written zero by padding rows of zeros) shows there. The later calls are chained calls of the
    padded size: the capture inputs (`later`), a call whose rows hold the pad values (but those given with
    pad_values: reserved values no call holds), and `later` again: state read only at the padding
    rows' own ids (the count of token id 0), or only calls later, shows too. What they compare: their outputs,
    and the state they leave (an element they update from its old value, an EMA, shows). A later call
    that raises with those writes counts as computing otherwise; so does one that writes an element the
    padding rows wrote: it holds a call's data, which the caller may read before then."""
    adapter = capturer.adapter
    padding = sig.padding
    padded = entry.padded_size
    pad_of = [padding.values[i] if padding else 0 for i in range(len(later))]
    # At the padded size, every row a real one: a size captured at a call checks on that call's rows, fewer
    # than it holds, and its later calls repeat them (a padding row there would read what padding wrote)
    held = _held_arguments(sig)
    later = [t if d is None or i in held else _with_rows(adapter, t, d, padded)
             for i, (t, d) in enumerate(zip(later, sig.dims))]
    # A call whose rows hold the pad values where those are what a real row may hold (0: token id 0, slot
    # 0). Values set with pad_values are the user's reserved ones (vLLM's slot -1, a trash slot): no call
    # holds them, so those arguments keep real rows there (and with every one reserved, no such call).
    reserved = capturer.signatures.reserved_pad_leaves(sig.spec)
    batch = [i for i, d in enumerate(sig.dims) if d is not None and i not in held]
    if all(i in reserved for i in batch):
        laters = (later, later)
    else:
        pads = [t if d is None or i in held or i in reserved else _filled(adapter, t, pad_of[i])
                for i, (t, d) in enumerate(zip(later, sig.dims))]
        laters = (later, pads, later)

    def set_state(values):
        put_back()  # the Python values as they were; the tensors are set next
        for (_, t), v in zip(state, values):
            adapter.copy_(t, v)

    def run(leaves):
        return _run(capturer, sig, _own_copies(adapter, held, leaves))

    def later_calls(values):
        set_state(values)
        outs = [_clone(adapter, run(leaves)) for leaves in laters]
        return outs, [adapter.clone(t) for _, t in state]

    found: List[str] = []
    for start in (saved, [adapter.shifted(t) for t in saved]):
        set_state(start)
        run(inputs)
        after = [adapter.clone(t) for _, t in state]
        set_state(start)
        if _check_replay(adapter, entry, inputs, rows) is None:
            return found
        replayed = [adapter.other_writes(b, a, t) for (_, t), b, a in zip(state, start, after)]
        written = [i for i, (a, r) in enumerate(zip(after, replayed))
                   if state[i][0] not in found and not adapter.same_values(a, r)]
        if not written:
            continue
        base_outs, base_state = later_calls(after)
        for i in written:
            # An element that only padding rows wrote and a later call writes holds a call's data (a
            # row of a state the caller reads, `state[:n] = x`): eager leaves it as it was until then
            if not adapter.same_values(adapter.keep_changes(after[i], replayed[i], base_state[i]), after[i]):
                found.append(state[i][0])
                continue
            values = list(after)
            values[i] = replayed[i]
            try:
                outs, left = later_calls(values)
            except Exception:
                found.append(state[i][0])
                continue
            # The state the later calls leave: where they changed an element (from what eager left), the
            # same value as without the padding rows' writes; where they did not, the value it started
            # with (a slot the padding rows wrote and nothing reads keeps their write).
            if any(_differing(adapter, o, b, 0, exact=True) for o, b in zip(outs, base_outs)) or any(
                    not adapter.same_values(x, adapter.other_writes(a, y, v))
                    for a, v, x, y in zip(after, values, left, base_state)):
                found.append(state[i][0])
    return found


def _own_copies(adapter, held, leaves) -> list:
    """The inputs of a check's run: a copy of each, but the arguments that hold the forward's writes
    (_held_arguments), whose own memory is the state compared."""
    return [t if i in held else adapter.clone(t) for i, t in enumerate(leaves)]


def _with_rows(adapter, t, dim: int, rows: int):
    """t with `rows` rows on `dim`: its first ones, or its rows repeated until there are that many."""
    have = adapter.shape(t)[dim]
    if have >= rows:
        return adapter.narrow(t, dim, rows)
    made = adapter.zeros_like(t, dim, rows)
    start = 0
    while start < rows:
        n = min(have, rows - start)
        adapter.copy_(adapter.rows(made, dim, start, start + n), adapter.narrow(t, dim, n))
        start += n
    return made


def _filled(adapter, t, value):
    """A tensor of t's shape and dtype holding `value` everywhere: the inputs of a call of padding rows."""
    made = adapter.clone(t)
    adapter.fill_(made, value)
    return made


def _check_replay(adapter, entry, leaves, rows: int):
    """A replay of `entry` as a call of `rows` rows would make, for a check: its outputs, or None where
    the graph cannot take these inputs. Not counted as a call."""
    ring = entry.copies.owner if entry.copies is not None else None
    if ring is not None:
        slot, holders = ring.slot, ring.holders[ring.slot]
    with adapter.no_grad():  # as replays run
        got = entry.run(adapter, leaves, rows)
    if got is _MISMATCH or got is _MOVED:
        return None
    if ring is not None:
        # Not a call: host_copies_in_graph counts calls, and the ring slot it wrote is the next call's, as
        # before, so a caller one step behind (depth 2, one future unread) never finds its slot taken.
        ring.replays -= 1
        _read_futures(got)
        ring.slot, ring.holders[slot] = slot, holders
        adapter.set_slot(ring.counter, slot)
    return got


def _probe_rows(adapter, leaves, dims, rows: int) -> List:
    """The first `rows` rows of the capture inputs, for the check. A floating input whose elements are
    all equal (zeros: a dummy input) is replaced by one whose rows differ: padding rows hold the pad
    value, and a forward that mixes rows gives the same real rows with them as without only if real
    and padding rows are alike. (Both runs of the check see the same replacement.) Integer inputs are
    not varied: another value may be out of range (an embedding's) or say where the forward writes."""
    return [t if d is None else adapter.varied(adapter.narrow(t, d, rows)) for t, d in zip(leaves, dims)]


def _rows_alike(adapter, sig, probe) -> bool:
    """Whether every batch input of the probe holds its pad value everywhere (dummy token ids of zeros,
    padded with zeros): real and padding rows are then alike, and the check cannot see rows mixed."""
    padding = sig.padding
    if padding is None:
        return False
    dynamic = [(t, v) for t, d, v in zip(probe, sig.dims, padding.values) if d is not None]
    return bool(dynamic) and all(adapter.all_equal_to(t, v) for t, v in dynamic)


def _read_futures(tree) -> None:
    from ..replay.host_outputs import HostFuture

    for _, leaf in leaf_paths(flatten(tree, lambda x: False)[1]):
        value = getattr(leaf, "value", getattr(leaf, "obj", None))
        if isinstance(value, HostFuture):
            value.result()


def _observe_other_size(capturer, sig, static, padded: int) -> None:
    """The outputs at one more size than `padded`, for the layout only (no replay compares there)."""
    adapter = capturer.adapter
    if padded >= 2:
        other, source = padded - 1, static
    elif capturer.config.cudagraph_copy_inputs and capturer.runner.max_size >= 2:
        other, source = 2, sig.buffers  # the max-size buffers: rows past the first hold the pad values
    else:
        return
    rows = [t if d is None else adapter.narrow(t, d, other) for t, d in zip(source, sig.dims)]
    sig.observe(output_layout.observe(adapter, _run(capturer, sig, rows), other))


def _run(capturer, sig, tensors):
    """The plain forward on these tensors; the leaves and model buffers it writes in place go to
    sig.eager_writes and sig.eager_buffer_writes."""
    adapter = capturer.adapter
    before = [adapter.version(t) for t in tensors]
    values = snapshot(adapter, tensors, sig.in_place)
    buffers = capturer.model_state.buffer_versions()
    buffer_values = buffer_snapshot(capturer)
    args, kwargs = unflatten(sig.spec, tensors, template=sig.template)
    out = capturer.eager(*args, **kwargs)
    sig.eager_writes.update(i for i, (t, v) in enumerate(zip(tensors, before)) if adapter.version(t) != v)
    sig.eager_writes.update(changed(adapter, tensors, values))
    sig.eager_buffer_writes.update(written(buffers, capturer.model_state.buffer_versions()))
    sig.eager_buffer_writes.update(buffers_changed(capturer, buffer_values))
    return out


def _clone(adapter, outputs):
    leaves, spec = flatten(outputs, adapter.is_tensor)
    return unflatten(spec, [adapter.clone(t) for t in leaves], template=outputs)


def _differing(adapter, got, expected, level: int, exact: bool = False) -> List[str]:
    """Paths of tensor outputs where the replay's real rows and eager's differ by more than rounding
    (host_outputs leaves, futures in `got`, are not compared), or at all where `exact`."""
    mine = dict(p for p in zip(_paths(adapter, got), flatten(got, adapter.is_tensor)[0]))
    found = []
    for path, want in zip(_paths(adapter, expected), flatten(expected, adapter.is_tensor)[0]):
        have = mine.get(path)
        if have is None:
            continue
        if adapter.max_abs_diff(have, want) > (0.0 if exact else _tolerance(adapter, want, level)):
            found.append(path)
    return found


def _tolerance(adapter, want, level: int) -> float:
    scale = max(1.0, adapter.max_abs(want))
    return _ULPS * adapter.eps(want) * scale * (_FUSED if level >= 2 else 1)


def _paths(adapter, tree) -> List[str]:
    return [p for p, kind in leaf_paths(flatten(tree, adapter.is_tensor)[1]) if kind is TENSOR]
