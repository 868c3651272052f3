"""The files that compare replays bitwise, run again with every linear layer rounding by its row count
(tests/row_count_probe.py): a bitwise comparison of a padded replay with eager on the real rows alone
would pass on one CPU and fail on another; here it fails on every CPU."""
import importlib.util
import os
import subprocess
import sys

import pytest

_CI_SECONDS = 42  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

TESTS = os.path.dirname(os.path.abspath(__file__))
FILES = [
    "both/test_replay_module_changes.py",
    "both/test_replay_arguments_and_outputs.py",
    "both/test_replay_input_writes.py",
    "both/test_replay_forward_state.py",
    "both/test_replay_padding_rows.py",
    "both/test_replay_marked_arguments.py",
    "both/test_host_outputs.py",
    "torch_tests/test_torch_replay_ambient_modes.py",
    "torch_tests/test_torch_replay_module_changes.py",
    "torch_tests/test_torch_replay_arguments.py",
    "torch_tests/test_torch_replay_writes_and_state.py",
    "torch_tests/test_torch_lifecycle.py",
    "torch_tests/test_torch_host_constants.py",
    "paddle_tests/test_replay_safety.py",
    "paddle_tests/test_sot_failures.py",
]


@pytest.mark.skipif(not any(importlib.util.find_spec(fw) for fw in ("torch", "paddle")), reason="needs torch or paddle")
def test_no_test_compares_a_padded_replay_bitwise_with_eager_on_fewer_rows():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    # Not the freed-id cases: they need the allocator to give a freed object's place to the next one made,
    # which the probe's extra tensors make less likely (and they call only captured sizes).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "row_count_probe",
           "-k", "not id_reused", *[os.path.join(TESTS, f) for f in FILES]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
