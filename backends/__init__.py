"""Framework backends. Only modules under this package import a framework, and only when a model of
that framework is used: `import graph_opt` imports neither paddle nor torch."""
from __future__ import annotations

import importlib
import itertools
import types
from typing import Any, Tuple

_FRAMEWORKS = (("paddle", "paddle."), ("torch", "torch."))


def framework_of(cls: type) -> str:
    """'paddle' or 'torch' for a paddle.nn.Layer / torch.nn.Module subclass, judged from its bases."""
    for base in cls.__mro__:
        module = getattr(base, "__module__", "") or ""
        for name, prefix in _FRAMEWORKS:
            if module.startswith(prefix) and base.__name__ in ("Layer", "Module"):
                return name
    raise TypeError(
        f"@support_graph_optimization needs a paddle.nn.Layer or torch.nn.Module subclass, got {cls.__qualname__}"
    )


def load(framework: str) -> Any:
    """The backend module of a framework: it exposes ADAPTER, check_version() and static_strategy()."""
    module = importlib.import_module(f"{__name__}.{framework}.backend")
    module.check_version()
    return module


def version_tuple(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string such as '3.3.1', '2.11.0+cu130' or '0.0.0' (a dev build)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


_copies = itertools.count(1)


def private_copy(fn: types.FunctionType) -> types.FunctionType:
    """fn with a code object of its own.

    SOT and Dynamo cache translations per code object, and a frame that fell back once stays fallen
    back for every caller: a private copy keeps one model's mode (and splitting ops) from deciding
    how another model of the same class is translated. Code objects compare by value (SOT keys a dict
    on them), so the copy carries one unused constant that makes it unequal to the original.
    """
    code = fn.__code__.replace(co_consts=fn.__code__.co_consts + (f"graph_opt private copy {next(_copies)}",))
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    return copy


def frame_locals(fn: types.FunctionType, arguments: dict):
    """(locals, refresh) of a frame of fn called with these bound arguments, as a framework's guards read
    them in a check before a replay: the arguments and fn's closure variables (zero-argument super()
    makes one, __class__). refresh() reads the closure's cells again, as a new frame would; None when fn
    has no closure."""
    frame = dict(arguments)
    cells = tuple(zip(fn.__code__.co_freevars, fn.__closure__ or ()))

    def refresh() -> None:
        for name, cell in cells:
            try:
                frame[name] = cell.cell_contents
            except ValueError:  # an empty cell: the frame would not hold it either
                frame.pop(name, None)

    refresh()
    return frame, (refresh if cells else None)
