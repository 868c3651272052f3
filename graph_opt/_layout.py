"""Where graph_opt.backends and graph_opt.benchmarks come from.

They live in backends/ and benchmarks/ at the repository root. `pip install .` copies them into
the package under these names (pyproject.toml's package-dir). When graph_opt is imported from a
checkout (an editable install, or the root on PYTHONPATH with nothing installed) the folders next
to graph_opt/ are mounted under those names here, so every way of running sees the same files.
"""
from __future__ import annotations

import importlib.util
import os
import sys

MOUNTED = {"graph_opt.backends": "backends", "graph_opt.benchmarks": "benchmarks"}


def mount_checkout_folders() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, folder in MOUNTED.items():
        init = os.path.join(root, folder, "__init__.py")
        if name in sys.modules or not os.path.isfile(init):
            continue  # already imported, or an installed copy (graph_opt/<name>/) is used
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(sys.modules["graph_opt"], name.rsplit(".", 1)[1], module)
