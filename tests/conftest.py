"""Shared fixtures.

The framework test folders are named paddle_tests/ and torch_tests/, not paddle/ and torch/: pytest puts
tests/ on sys.path for this conftest, and a folder named like a framework would then import as that
framework (a namespace package) on a machine that lacks it, instead of the tests skipping.
"""
import logging
import os

import pytest


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


def pytest_configure(config):
    config.addinivalue_line("markers", "inductor: compiles with Inductor on CPU (C++ codegen; seconds per graph)")
