"""The padding rows of the static input buffers: a set value, never an earlier call's data.

A call of 3 rows replays the graph of size 4: the forward runs on 4 rows, and row 3 is whatever the
static buffer holds there. Left alone that is the last larger call's row 3, and a forward whose
padding rows have effects (a KV-cache write at `slot_mapping[3]`) repeats that call's write. So rows
past the real ones hold a value the user can set per argument, `pad_values={"slot_mapping": -1}`
(default 0), as vLLM pads slot mappings with -1 for kernels that skip them.

Filling costs one kernel per dynamic input, so it happens only where needed: the buffers are filled
with the pad value when allocated, and the runner tracks how many leading rows may hold real data
(`dirty`); a call of fewer rows than that fills rows [real, dirty) once, after which they are clean
for every smaller padded size. In a decode loop of constant batch size nothing is filled.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ..errors import GraphOptConfigError

_NUMBER = (bool, int, float)


def check_pad_values(cls_name: str, pad_values: Optional[Mapping[str, Any]], params: List[str],
                     accepts_kwargs: bool) -> Optional[Dict[str, Any]]:
    """pad_values as given to @support_graph_optimization, checked: argument name -> a number."""
    if pad_values is None:
        return None
    if not isinstance(pad_values, Mapping) or not pad_values:
        raise GraphOptConfigError(
            f"@support_graph_optimization(pad_values={pad_values!r}) on {cls_name}: expected a non-empty dict of "
            "forward argument name -> the number its padding rows hold, e.g. {'slot_mapping': -1}")
    for name, value in pad_values.items():
        if not isinstance(name, str) or (name not in params and not accepts_kwargs):
            raise GraphOptConfigError(
                f"pad_values key {name!r} is not an argument of {cls_name}.forward; its arguments are "
                f"{', '.join(params)}")
        if not isinstance(value, _NUMBER):
            raise GraphOptConfigError(
                f"pad_values[{name!r}]={value!r} on {cls_name}: expected a number (an int, float or bool) for the "
                f"padding rows of argument {name!r}")
    return dict(pad_values)


class Padding:
    """The padding rows of one signature's static buffers (see the module doc)."""

    __slots__ = ("adapter", "buffers", "dims", "values", "dirty")

    def __init__(self, adapter, buffers: List[Any], dims: List[Optional[int]], values: List[Any]):
        self.adapter = adapter
        # (buffer, batch dim, pad value) of each dynamic leaf; the full max-size buffers
        self.buffers = [(b, d, v) for b, d, v in zip(buffers, dims, values) if d is not None]
        self.dims = dims
        self.values = values
        self.dirty = 0  # rows [0, dirty) may hold an earlier call's real data; the rest hold the pad value
        for buf, dim, value in self.buffers:
            if value != 0:  # allocated as zeros
                adapter.fill_(buf, value)

    def wrote(self, real: int) -> None:
        """A call of `real` rows, before its rows are copied in: every row past them holds the pad value
        again (one fill of the rows an earlier, larger call left, where there are any), and rows
        [0, real) count as written, also when a copy then raises."""
        dirty = self.dirty
        if dirty > real:
            fill = self.adapter.fill_rows
            for buf, dim, value in self.buffers:
                fill(buf, dim, real, dirty, value)
        self.dirty = real

    def touched(self, rows: int) -> None:
        """Rows [0, rows) were written otherwise (a capture's inputs, a forward writing its inputs)."""
        if rows > self.dirty:
            self.dirty = rows
