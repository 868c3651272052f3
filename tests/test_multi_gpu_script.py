"""scripts/multi-gpu.sh, the one run of everything that needs several GPUs: where it cannot run (fewer than
two GPUs, as on CI) it says so and exits 3 without running anything; a bad world size is refused."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "multi-gpu.sh")


def _run(*args, tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_bad_world_size_is_refused_with_what_is_accepted(tmp_path):
    done = _run("four", tmp_path=tmp_path)
    assert done.returncode == 2 and "WORLD=four: expected a number of ranks" in done.stderr


def test_without_two_gpus_nothing_runs_and_the_script_says_so(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are present: the script would run everything")
    done = _run(tmp_path=tmp_path)
    assert done.returncode == 3 and "needs two or more GPUs" in done.stderr, (done.stdout, done.stderr)
    assert not (tmp_path / "logs").exists()
