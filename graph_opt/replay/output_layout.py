"""Which dimension of each output is the batch, learned from the forward's outputs at two batch sizes.

A replay at a padded size returns the real rows of each output. Which dimension holds them cannot be
read off one output: an output [6, bs] with the batch in dim 1, or a weight [8, 8] returned at batch 8,
have a dimension equal to the padded size by coincidence. So the runner looks at the outputs at two
different sizes (the first captured size, and an eager run of the same inputs cut to fewer rows):

- a tensor whose shape is the same at both sizes has no batch dimension: returned whole;
- a tensor whose shape differs in exactly one dimension, equal to the batch size each time: cut there;
- any other tensor (a flattened [bs * seq, h], a [bs, bs] matrix) cannot be cut, and neither can a
  non-tensor output that changes with the batch (`x.shape[0]`): calls whose real size is not the
  padded size do not replay (one warning naming the output); at a captured size they do.

Every later captured size is checked against what was learned, and a contradiction is learned too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..pytree import TENSOR, flatten, leaf_paths, unflatten


@dataclass
class Observation:
    """The outputs of one run at `size` rows: their structure (non-tensor values included) and tensor shapes."""

    size: int
    spec: Any
    shapes: List[Tuple[int, ...]]


def observe(adapter, outputs, size: int) -> Observation:
    leaves, spec = flatten(outputs, adapter.is_tensor)
    return Observation(size, spec, [tuple(adapter.shape(t)) for t in leaves])


@dataclass
class OutputLayout:
    """Per tensor output leaf its batch dimension (None: none); what cannot be cut to real rows."""

    dims: List[Optional[int]] = field(default_factory=list)
    uncuttable: List[str] = field(default_factory=list)  # outputs that change with the batch otherwise
    known: bool = False  # learned from two sizes; until then nothing is cut
    blocked: List[str] = field(default_factory=list)  # why padded calls differ from eager (capture_checks)

    @property
    def exact_only(self) -> bool:
        """Whether only calls of exactly a captured size may replay."""
        return bool(self.uncuttable) or not self.known or bool(self.blocked)

    def why_exact_only(self) -> str:
        if self.blocked:
            return self.blocked[0]
        if not self.known:
            return "its outputs were seen at one batch size only, so which dimension is the batch is unknown"
        return (f"output {', '.join(self.uncuttable)} changes with the batch size in a way a replay at a padded "
                "size cannot cut to the real rows")

    def cut(self, adapter, outputs, real: int):
        """outputs with each batch dimension cut to `real` rows."""
        leaves, spec = flatten(outputs, adapter.is_tensor)
        dims = self.dims
        if len(dims) != len(leaves):
            return outputs
        return unflatten(spec, [t if d is None else adapter.narrow(t, d, real) for t, d in zip(leaves, dims)],
                         template=outputs)


def learn(observations: List[Observation]) -> OutputLayout:
    """The layout that every observation agrees with (see the module doc)."""
    sizes = {o.size for o in observations}
    if len(sizes) < 2:
        return OutputLayout(known=False)
    first = observations[0]
    uncuttable: List[str] = []
    if any(o.spec != first.spec for o in observations[1:]):
        # A non-tensor value (or the structure itself) changes with the batch.
        if any(len(o.shapes) != len(first.shapes) for o in observations[1:]):
            return OutputLayout(dims=[None] * len(first.shapes), uncuttable=["(its structure)"], known=True)
        uncuttable.extend(_changed_constants(observations))
    paths = [p for p, kind in leaf_paths(first.spec) if kind is TENSOR]
    dims: List[Optional[int]] = []
    for i, path in enumerate(paths):
        shapes = [(o.size, o.shapes[i]) for o in observations]
        dim = _batch_dim(shapes)
        if dim is _IRREGULAR:
            uncuttable.append(f"{path} (shapes {', '.join(str(list(s)) for _, s in shapes)})")
            dims.append(None)
        else:
            dims.append(dim)
    return OutputLayout(dims=dims, uncuttable=uncuttable, known=True)


_IRREGULAR = object()


def _batch_dim(shapes):
    """The one dimension equal to the batch size in every (size, shape); None where no dimension
    changes; _IRREGULAR otherwise."""
    ranks = {len(s) for _, s in shapes}
    if len(ranks) != 1:
        return _IRREGULAR
    (rank,) = ranks
    changing = [d for d in range(rank) if len({s[d] for _, s in shapes}) > 1]
    if not changing:
        return None
    if len(changing) == 1 and all(s[changing[0]] == size for size, s in shapes):
        return changing[0]
    return _IRREGULAR


def _changed_constants(observations: List[Observation]) -> List[str]:
    per_obs = [[(p, v) for p, v in leaf_paths(o.spec) if v is not TENSOR] for o in observations]
    changed = []
    for i, (path, value) in enumerate(per_obs[0]):
        values = [obs[i][1] for obs in per_obs if i < len(obs)]
        if any(v != value for v in values[1:]):
            changed.append(f"{path} (a non-tensor: {', '.join(repr(getattr(v, 'value', v)) for v in values)})")
    return changed or ["(a non-tensor value)"]
