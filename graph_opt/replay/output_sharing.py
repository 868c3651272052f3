"""The outputs of every captured size, in the storage of the largest size's outputs.

Each size's graph writes its outputs to blocks of the graph pool, and those blocks stay taken for as
long as the outputs are held: for 35 sizes of a decoder that is 8.3 MiB of hidden states (35 times
bs x 1024 bf16), for logits hundreds of MiB. So a size smaller than one captured before ends its
graph with a copy of each batch-major output into the first rows of the larger size's output, and
keeps only views of those rows; its own output blocks go back to the pool for the next size. A call of
any size then writes where an earlier call's outputs are: handed_outputs.py copies the ones a caller
still holds first. The shared storage is owned by the outputs themselves, so it outlives clear_graphs().
"""
from __future__ import annotations

from typing import Any, Optional

from .static_address import overlaps
from ..pytree import flatten, unflatten


class SharedOutputs:
    """Where one size's outputs go: views of a larger size's outputs, leaf by leaf where they fit."""

    def __init__(self, adapter, larger_outputs, padded: int, usable: Optional[list] = None, inputs=(),
                 reserved=()):
        self.adapter = adapter
        # The size's own static inputs: an output that is one of them stays itself (a replay hands out
        # the caller's tensor there, captured_size.returned_inputs), not a copy in another size's storage.
        self.inputs = {id(t) for t in inputs}
        self.targets, self.spec = flatten(larger_outputs, adapter.is_tensor)
        self.padded = padded
        # Per leaf: whether the larger output is owned (a leaf held only through a non-owning alias is
        # pool memory other graphs use, and must not be written).
        self.usable = usable if usable is not None and len(usable) == len(self.targets) else [True] * len(self.targets)
        if reserved:
            # A larger output over `reserved` memory ((start, end) bytes: static input buffers, as where the
            # forward returns an input or a view of one) is no storage: a copy into it would write the input.
            self.usable = [ok and not overlaps(reserved, adapter.extent(t)) for ok, t in zip(self.usable, self.targets)]
        self.shared = [False] * len(self.targets)  # per leaf: redirect() moved it into a larger output

    def redirect(self, outputs):
        """`outputs` with each batch-major leaf replaced by the rows of the larger output it will be
        copied to (no copy yet); the other leaves, and outputs of another structure, stay as they are."""
        leaves, spec = flatten(outputs, self.adapter.is_tensor)
        if spec != self.spec:
            return outputs
        targets = [t if id(t) in self.inputs else self._target(big, t, ok)
                   for big, t, ok in zip(self.targets, leaves, self.usable)]
        self.shared = [dst is not t for dst, t in zip(targets, leaves)]
        return unflatten(spec, targets, template=outputs)

    def _target(self, big, t, usable: bool = True):
        adapter = self.adapter
        if not usable:
            return t
        shape, big_shape = list(adapter.shape(t)), list(adapter.shape(big))
        # Only dense tensors: a broadcast output (arange(n).expand(bs, -1)) has one element per
        # location for many indices, and a copy into it is not defined.
        fits = (len(shape) > 0 and shape[0] == self.padded and len(big_shape) == len(shape)
                and big_shape[0] >= self.padded and big_shape[1:] == shape[1:]
                and adapter.layout(big) == adapter.layout(t) and adapter.dense(big) and adapter.dense(t))
        return adapter.narrow(big, 0, self.padded) if fits else t

    def copy(self, outputs, redirected) -> None:
        """Inside the capture: copy each output to where redirect() placed it (only those it moved: a
        simulated replay's fresh outputs must not be copied into the ones that stayed)."""
        copy_ = self.adapter.copy_
        for src, dst, shared in zip(flatten(outputs, self.adapter.is_tensor)[0],
                                    flatten(redirected, self.adapter.is_tensor)[0], self.shared):
            if shared and src is not dst:
                copy_(dst, src)

    def mark_written(self, redirected) -> None:
        """A simulated capture: the version counters of the rows redirect() moved outputs into move, as
        a real capture's copy_ moves them (on the host, though the copy only runs at replay)."""
        mark = self.adapter.mark_written
        for dst, shared in zip(flatten(redirected, self.adapter.is_tensor)[0], self.shared):
            if shared:
                mark(dst)

    def merged(self, outputs, redirected):
        """`outputs` with each leaf redirect() moved replaced by where it moved."""
        leaves, spec = flatten(outputs, self.adapter.is_tensor)
        moved = flatten(redirected, self.adapter.is_tensor)[0]
        return unflatten(spec, [dst if shared else src for src, dst, shared in zip(leaves, moved, self.shared)],
                         template=outputs)


def for_size(adapter, sig, padded: int, inputs=()) -> Optional[SharedOutputs]:
    """The sharing for a new size `padded` of a signature (signature.Signature): into the largest size
    captured above it, or None where there is none. Only outputs whose batch dimension is dim 0
    (output_layout) share: a [8, 8] weight returned at batch 8 is not batch-major."""
    larger = sig.largest_above(padded)
    if larger is None:
        return None
    layout = sig.layout
    usable = [d == 0 for d in layout.dims] if layout.known else None
    return SharedOutputs(adapter, sig.entries[larger].captured.outputs, padded, usable, inputs, sig.fed_back or ())


def shares_storage(adapter, a: Any, b: Any) -> bool:
    """Whether two captured outputs' first tensor leaves live in one storage (tests and reports)."""
    la, lb = flatten(a, adapter.is_tensor)[0], flatten(b, adapter.is_tensor)[0]
    return bool(la and lb) and adapter.data_ptr(la[0]) == adapter.data_ptr(lb[0])
