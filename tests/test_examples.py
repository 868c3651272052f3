"""Each script in examples/ runs with --smoke in a process of its own, exits 0 and says its correctness
check matched. The examples need transformers (torch) or paddle: without them a case skips."""
import os
import subprocess
import sys

import pytest

_CI_SECONDS = 15  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = [
    ("hf_causal_lm_serving.py", "transformers"),
    ("decode_loop.py", "torch"),
    ("bert_finetune_autocudagraph.py", "transformers"),
    ("paddle_sot_level1.py", "paddle"),
    ("fastdeploy_style.py", "paddle"),
]


@pytest.mark.parametrize("script,needs", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_runs_and_matches_eager(script, needs):
    pytest.importorskip(needs)
    env = dict(os.environ, PYTHONPATH=ROOT)  # the conftest has cleared GRAPH_OPT_* from os.environ
    done = subprocess.run([sys.executable, os.path.join("examples", script), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{out[-4000:]}"
    assert "correctness: matched" in done.stdout, out[-4000:]
