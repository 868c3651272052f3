"""Every change graph_opt makes to a framework goes through one registry (graph_opt/backends/patches.py):
nothing is patched at import, each group is installed at first use, removal puts every original back
and the next use installs it again, and docs/patches.md lists each one. Run in a fresh interpreter
(tests/patches_probe.py): another test's model has installed them here long ago."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = [f for f in ("torch", "paddle") if importlib.util.find_spec(f) is not None]
if not FRAMEWORKS:
    pytest.skip("needs torch or paddle", allow_module_level=True)


@pytest.fixture(scope="module")
def report():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "patches_probe.py"), *FRAMEWORKS],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "GLOG_minloglevel": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_removal_restores_every_original_and_the_next_use_installs_them_again(report):
    assert report["refused_while_held"] == [True, True]  # a captured model, then a graphed block
    assert report["problems"] == []
    assert report["removed"] == len(report["installed"]) > 0 and report["left"] == 0
    assert report["reinstalled"] == report["removed"]
    for fw in FRAMEWORKS:  # train()/eval(), a registration, an attribute set and a parameter's .data assigned
        # (modes, registrations, attributes, conversions): torch does not count attributes (docs/patches.md)
        want = [True, True, fw == "paddle", True]
        assert report["bumps_before"][fw] == want and report["bumps_after"][fw] == want, fw


def test_nothing_is_patched_at_import():
    code = ("import graph_opt, graph_opt.backends.patches as p; "
            + "".join(f"import graph_opt.backends.{fw}.backend; " for fw in FRAMEWORKS)
            + "print(len(p.installed()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0"


def test_docs_list_every_patch_with_its_group(report):
    text = (ROOT / "docs" / "patches.md").read_text()
    missing = [where for _, where, _ in report["installed"] if f"`{where}`" not in text]
    assert not missing, f"docs/patches.md does not list {missing}"
    groups = {group for group, _, _ in report["installed"]}
    assert all(f"### `{g}`" in text for g in groups), groups
