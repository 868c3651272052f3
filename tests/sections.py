"""The tests of another module, for a module that runs them again under its own fixtures: tests/gpu runs
the sections of tests/both (and torch's own) on a CUDA device; the scenarios of tests/multirank_kit.py and
tests/models/hf_models_kit.py run on CPU and on GPUs.

    globals().update(shared_tests("test_host_outputs"))

puts that module's test functions in the calling module, where pytest collects them with the calling
module's fixtures (its shim on the device, real graphs) in place of tests/both/conftest.py's. Importing
this module makes the sections importable by name, for the constants they share.
"""
import importlib
import os
import sys

_BOTH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "both")
if _BOTH not in sys.path:
    sys.path.insert(0, _BOTH)  # the sections import by their names, as pytest imports them


def shared_tests(*sections):
    """The test functions of the modules named `sections` (importable by name), by name."""
    tests = {}
    for section in sections:
        module = importlib.import_module(section)
        tests.update((name, value) for name, value in vars(module).items()
                     if name.startswith("test_") and callable(value))
    return tests
