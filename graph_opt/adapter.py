"""The one small protocol through which the framework-neutral core talks to a framework.

Implementations live in backends/<framework>/adapter.py; nothing else in the core
touches a tensor except through these methods.
"""
from __future__ import annotations

from typing import Any, ContextManager, Optional, Protocol, Sequence, Tuple


class DeviceGraph(Protocol):
    """One captured graph: capture_begin() ... capture_end(), then replay() any number of times."""

    def capture_begin(self) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class Adapter(Protocol):
    name: str

    # tensors
    def is_tensor(self, x: Any) -> bool: ...

    def shape(self, t) -> Sequence[int]: ...

    def dtype(self, t) -> Any: ...  # compared with != on every replayed leaf: keep it a plain attribute read

    def zeros_like(self, t, dim: Optional[int], size: int): ...  # like t, with t.shape[dim] = size

    def narrow(self, t, dim: int, length: int): ...  # a view of the first `length` rows along dim

    def copy_(self, dst, src) -> None: ...  # in place, shapes equal

    def data_ptr(self, t) -> int: ...

    def version(self, t) -> int: ...  # counts in-place writes to t's memory (views share it)

    def mark_written(self, t) -> None: ...  # moves version(t) as a write would, values untouched

    def nbytes(self, t) -> int: ...

    def numel(self, t) -> int: ...

    def host_bytes(self, t) -> bytes: ...  # a host tensor's elements, as the bytes a kernel reads

    def extent(self, t) -> Tuple[int, int]: ...  # (start, end) bytes its elements span, gaps of a view included

    def same_values(self, a, b) -> bool: ...  # same shape, dtype and elements

    def keep_changes(self, before, want, got): ...  # got where want differs from before, want elsewhere

    def alias(self, t): ...  # a new tensor object over t's memory

    def keep_values(self, t) -> None: ...  # an alias made to hold a copy of its values, in memory of its own

    def model_tensors(self, model) -> list: ...  # its parameters and buffers

    def shifted(self, t): ...  # a copy of t plus a ramp of distinct values (floating tensors)

    def other_writes(self, before, want, got): ...  # want where it differs from before, got elsewhere

    def layout(self, t) -> Any: ...  # hashable (dtype, device): what a buffer must share to hold t

    def weak_alias(self, t): ...  # t's memory without owning it, where the graph pool allows; else t

    def static_address(self, t) -> bool: ...  # marked to be read in place (graph_opt.static_address)

    # execution context
    def grad_enabled(self) -> bool: ...

    def no_grad(self) -> ContextManager: ...

    def synchronize(self) -> None: ...

    # graphs
    def graphs_supported(self) -> bool: ...

    def new_pool(self) -> Any: ...

    def new_graph(self, pool: Any) -> DeviceGraph: ...

    def capture_stream(self) -> ContextManager: ...  # entered around warmups, capture and split ops

    def memory_in_use(self) -> Optional[int]: ...  # device bytes reserved, None where not measurable

    def release_memory(self) -> None: ...
