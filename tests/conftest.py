"""Shared fixtures, and `fw`: the framework a test of tests/both runs on.

The framework test folders are named paddle_tests/ and torch_tests/, not paddle/ and torch/: pytest puts
tests/ on sys.path for this conftest, and a folder named like a framework would then import as that
framework (a namespace package) on a machine that lacks it, instead of the tests skipping.
"""
import importlib
import logging
import os

import pytest

# Inductor's FX-graph and AOT-autograd caches, on torch 2.11 with CUDA, served a kernel compiled for
# another specialization of a Python float the forward reads (`x / self.temperature`) to a later
# model of the same class in the same process: "NameError: zf78 is not defined" in the Triton source,
# and the level-2 capture failed (26 of the GPU replay-safety tests, late in a run; all 374 pass with
# the caches off). Each test compiles afresh here; docs/torch.md says what a user sees.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture(autouse=True)
def _clean_graph_opt_env(monkeypatch):
    """Tests start with no GRAPH_OPT_* variable set, whatever the shell exported."""
    for key in list(os.environ):
        if key.startswith("GRAPH_OPT_"):
            monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def graph_opt_warnings(caplog):
    """The warnings the graph_opt logger emitted during the test."""
    caplog.set_level(logging.INFO, logger="graph_opt")

    def collect(level=logging.WARNING):
        return [r.getMessage() for r in caplog.records if r.name == "graph_opt" and r.levelno >= level]

    return collect


# What tests/both runs each test on, and the graph_opt levels each framework has (Paddle's CPU build has no
# compiler: its level 2 would be level 1 again). A module may name its own (tests/gpu runs "torch" alone).
FRAMEWORKS = ("torch", "paddle")
LEVELS = {"torch": (0, 1, 2), "paddle": (0, 1)}


@pytest.fixture
def fw(request):
    """The framework's model zoo (tests/torch_zoo, tests/paddle_zoo): its models and the shims tests/both
    takes; the test skips where the framework is not installed."""
    pytest.importorskip(request.param)
    zoo = importlib.import_module(f"{request.param}_zoo")
    zoo.reset()
    return zoo


def pytest_generate_tests(metafunc):
    """A test that takes `fw` (itself or through a fixture) runs once per framework; one that also takes
    `level` runs at each of that framework's levels, level 2 marked `inductor`. `@pytest.mark.per_framework
    (name, {framework: values})` parametrizes another argument per framework the same way."""
    if "fw" not in metafunc.fixturenames:
        return
    names = getattr(metafunc.module, "FRAMEWORKS", FRAMEWORKS)
    explicit = {a.strip() for m in metafunc.definition.iter_markers("parametrize")
                for a in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])}
    per = {m.args[0]: m.args[1] for m in metafunc.definition.iter_markers("per_framework")}
    if "level" in metafunc.fixturenames and "level" not in explicit:
        per.setdefault("level", LEVELS)
    if not per:
        metafunc.parametrize("fw", names, indirect=True)
        return
    (arg, values), = per.items()  # one per-framework argument is all a test here needs
    cases = [pytest.param(name, v, id=f"{name}-{arg}{v}" if arg == "level" else f"{name}-{v}",
                          marks=[pytest.mark.inductor] if arg == "level" and v == 2 else [])
             for name in names for v in values[name]]
    metafunc.parametrize(("fw", arg), cases, indirect=["fw"])


@pytest.fixture
def logs(caplog):
    """caplog, recording graph_opt's warnings."""
    caplog.set_level(logging.WARNING, logger="graph_opt")
    return caplog


def pytest_configure(config):
    config.addinivalue_line("markers", "inductor: compiles with Inductor on CPU (C++ codegen; seconds per graph)")
    config.addinivalue_line("markers", "per_framework(name, values): parametrize `name` per framework (tests/conftest.py)")


def pytest_collection_modifyitems(session, config, items):
    """Heaviest files first (a module's _CI_SECONDS; a file that takes another's tests with
    sections.shared_tests does not take it), the rest in collection order: test.sh's two workers take whole files in
    this order (--dist loadfile --no-loadscope-reorder), and a heavy file started last would leave one
    worker running it alone."""
    def weight(item):
        module = getattr(item, "module", None)
        return -getattr(module, "_CI_SECONDS", 0)

    items.sort(key=weight)  # stable: a file's tests stay together and in order
    _deselect_inductor_cases_left_to_the_gpu(config, items)


def _deselect_inductor_cases_left_to_the_gpu(config, items):
    """A CPU module may name the Inductor cases (the `inductor` mark) it runs in `_INDUCTOR_ON_CPU`, by
    test name or by name with its parameters; its other Inductor cases are deselected. Level 2 guards and
    checks a call as level 1 does, and Inductor's C++ compile costs seconds per graph here: the CPU runs
    the cases where Inductor's kernels change what a replay must get right (writes, views, layouts,
    numbers the kernels take), and tests/gpu runs every case at every level. Private, as _CI_SECONDS."""
    kept, dropped, named = [], [], set()
    for item in items:
        module = getattr(item, "module", None)
        wanted = getattr(module, "_INDUCTOR_ON_CPU", None)
        if wanted is not None and module not in named:
            named.add(module)
            missing = sorted(n for n in wanted if not callable(getattr(module, n.split("[")[0], None)))
            if missing:  # a misspelt name would deselect the case it meant to keep
                raise pytest.UsageError(f"{module.__name__}._INDUCTOR_ON_CPU names no test: {missing}")
        if wanted is None or item.get_closest_marker("inductor") is None:
            kept.append(item)
        elif item.name in wanted or getattr(item, "originalname", item.name) in wanted:
            kept.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_finish(session):
    """Freeze what collection imported (torch with Dynamo, Paddle, transformers: millions of objects), as a
    server freezes its heap after start-up: every collection then walks only what the tests made. Each
    capture_model collects once (capture_phase.paused_gc), which otherwise cost ~0.15 s a capture here."""
    import gc
    import sys

    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401  (imported by every torch test's first fixture anyway)
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _frozen_leftovers():
    """After each test, freeze what it left alive, its garbage collected first. What stays is mostly the
    frameworks' own lazily built state (Inductor's pattern tables, Dynamo's and the fake-tensor caches:
    over 300,000 objects after one file), which every capture_model's collection would otherwise walk
    again: that walk grew to 0.2 s a capture, half the suite's time. A test that checks what is freed
    makes its objects after this point (test_a_captured_model_is_freed_when_its_user_lets_it_go)."""
    import gc

    yield
    gc.collect()
    gc.freeze()
