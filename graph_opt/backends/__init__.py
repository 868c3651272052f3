"""Framework backends. Only modules under this package import a framework, and only when a model of
that framework is used: `import graph_opt` imports neither paddle nor torch."""
from __future__ import annotations

import importlib
from typing import Any

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
    """The backend module of a framework: it exposes ADAPTER, check_version(), static_strategy(), static_call()."""
    module = importlib.import_module(f"{__name__}.{framework}.backend")
    module.check_version()
    return module
