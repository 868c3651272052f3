"""What a graph makes of each tensor argument, for every path that replays one (inference and training,
every level): device memory it reads where the copy put it, or host memory whose value the capture
bakes in (a 0-dim CPU tensor torch reads as a kernel argument; pack_padded_sequence's CPU lengths,
read on the host to size the kernels). One classification, so that no path checks less than another:
inference at level 0 replays a host argument only with the value it had at capture; a training block
keys its graphs by such values (tensors_by_value). Levels >= 1 of inference keep host ops out of
their graphs (fx_split.py), and those ops read the arguments as they are."""
from __future__ import annotations

import inspect
import re
from typing import List, Sequence, Tuple

from ..pytree import TENSOR, leaf_paths
from ..recorders.host_graphs import HOST_MARK, simulation_enabled

# A host tensor argument of at most this many elements is a key by its value (a scale, a temperature,
# a batch's lengths); a larger one, whose value a graph cannot be keyed by, runs its calls eagerly.
HOST_KEY_ELEMENTS = 4096


def host_positions(adapter, leaves: Sequence) -> Tuple[int, ...]:
    """The leaves on the host while graphs run on a device. The host stand-in has no device and re-runs
    Python at a replay, so nothing is baked there: only tensors marked with testing.as_host_tensor()
    count, so that the CPU suite exercises what a real graph would bake."""
    if simulation_enabled():  # read once: a training block asks at every call
        return tuple(i for i, t in enumerate(leaves) if getattr(t, HOST_MARK, False))
    on_host = adapter.on_host
    return tuple(i for i, t in enumerate(leaves) if on_host(t))


class TooLarge:
    """A host argument too large to be a key: position `index`, `elements` elements."""

    __slots__ = ("index", "elements")

    def __init__(self, index: int, elements: int):
        self.index, self.elements = index, elements


def tensors_by_value(adapter, leaves: Sequence, positions: Tuple[int, ...]):
    """The part of a call's key that its host arguments make: their values, as bytes (a NaN equal to
    itself, -0.0 not equal to 0.0, as a kernel sees them), or TooLarge for the first that is."""
    key = []
    for i in positions:
        t = leaves[i]
        n = adapter.numel(t)
        if n > HOST_KEY_ELEMENTS:
            return TooLarge(i, n)
        key.append(adapter.host_bytes(t))
    return tuple(key)


def argument_names(spec, fn=None) -> List[str]:
    """A readable name per tensor leaf of a spec of (args, kwargs): the argument it belongs to, and where
    in it for a container (`argument 'opts'['table']`); a positional one by its parameter's name in
    `fn`'s signature where it has one."""
    params = _positional_parameters(fn) if fn is not None else ()
    names = []
    for path, leaf in leaf_paths(spec, root=""):
        if leaf is TENSOR:
            top, key, rest = re.match(r"\[([01])\]\[([^\]]+)\](.*)", path).groups()
            if top == "0":
                head = f"argument {params[int(key)]!r}" if int(key) < len(params) else f"positional argument {key}"
            else:
                head = f"argument {key}"
            names.append(head + rest)
    return names


def _positional_parameters(fn) -> List[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin, a callable without a signature
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def too_large_message(name: str, spec, big: TooLarge, fn=None) -> str:
    which = argument_names(spec, fn)[big.index]
    return (f"{name}: {which} is a host (CPU) tensor of {big.elements} elements; a CUDA graph bakes in what it "
            f"reads of host memory, and a key by value takes at most {HOST_KEY_ELEMENTS} elements, so calls "
            "with it run eagerly. Move it to the device, or pass a smaller one")


def entry_host_values(adapter, leaves: Sequence, static: Sequence, split_reads=frozenset()):
    """Inference at level 0: the host arguments of a captured size (`leaves`, the call's) and the bytes
    of the buffers the capture read (`static`), which a replay must find again, as a training key does
    (-0.0 is not 0.0 to a kernel). One with a batch dimension too (pack_padded_sequence's lengths): the
    capture read its padded rows on the host, so only a call of the padded size with those values may
    replay. Not those given to a splitting op (`split_reads`, their addresses): it runs at every replay
    and reads them as they are (attention's sequence lengths); one the pieces read too is not seen."""
    return [(i, adapter.host_bytes(static[i])) for i in host_positions(adapter, leaves)
            if adapter.data_ptr(static[i]) not in split_reads]
