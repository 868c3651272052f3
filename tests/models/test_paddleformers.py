"""PaddleFormers models (tests/models/paddleformers/paddleformers_models.py) on Paddle CPU, run in a
process of their own: PaddleFormers pins transformers below 5.4, and the Hugging Face torch tests in
this process use a newer one. scripts/python-env.sh (./test.sh) installs PaddleFormers and the
dependencies its models need into .venv/paddleformers (tests/models/paddleformers/requirements.txt)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_CI_SECONDS = 55  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

pytest.importorskip("paddle")

ROOT = Path(__file__).resolve().parents[2]
DEPS = Path(os.environ.get("PADDLEFORMERS_DEPS", ROOT / ".venv" / "paddleformers"))
INNER = Path(__file__).parent / "paddleformers" / "paddleformers_models.py"


def test_paddleformers_architectures_at_levels_0_and_1_and_llama_and_qwen2_in_training_graphs():
    if not (DEPS / "paddleformers").is_dir():
        pytest.skip(f"PaddleFormers is not installed in {DEPS}: ./test.sh installs it")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INNER)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join(run.stdout.splitlines()[-30:])
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) == 34 and "skipped" not in run.stdout.splitlines()[-1], tail
