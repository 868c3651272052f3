"""The code blocks of README.md and docs/*.md marked runnable run as pasted, from a folder that is not the
repository, and do what they say.

The marker is an HTML comment on the line before the opening fence, naming the command the prose tells a
user to run:

    <!-- runnable: GRAPH_OPT_SIMULATE_CUDAGRAPH=1 python quickstart.py -->
    ```python
    ...
    ```

The block is saved under the file name the command gives, in a temporary folder, and run there in a
fresh process with the command's VAR=value settings (graph_opt found through PYTHONPATH, as an install
would find it). The command must appear in the page's prose too, so that what is tested is what a reader
is told. A block that prints stats() must show sizes captured and at least one replay without a fallback.
A block skips only when a module it imports (paddle, torch, transformers) is not installed."""
import ast
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

_CI_SECONDS = 20  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MARKER = re.compile(r"^<!-- runnable: (.+?) -->$")


def runnable_blocks():
    """(page, line, command, code, prose) for every marked block."""
    found = []
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            lines = f.read().split("\n")
        prose = "\n".join(line for line in lines if not MARKER.match(line))
        for i, line in enumerate(lines):
            marker = MARKER.match(line.strip())
            if not marker:
                continue
            assert lines[i + 1].startswith("```python"), f"{page}:{i + 1}: a runnable marker precedes a ```python fence"
            end = lines.index("```", i + 2)
            found.append((os.path.relpath(page, ROOT), i + 1, marker.group(1), "\n".join(lines[i + 2:end]), prose))
    return found


BLOCKS = runnable_blocks()


def test_both_readme_quick_starts_are_marked_runnable():
    assert [page for page, *_ in BLOCKS].count("README.md") >= 2


@pytest.mark.parametrize("page,line,command,code,prose", BLOCKS, ids=[f"{p}:{n}" for p, n, *_ in BLOCKS])
def test_a_runnable_block_runs_as_pasted(page, line, command, code, prose, tmp_path):
    assert f"`{command}`" in prose, f"{page}:{line}: the command {command!r} is not in the page's prose"
    *settings, python, script = shlex.split(command)
    assert python == "python" and script.endswith(".py"), f"{page}:{line}: expected 'VAR=value ... python X.py'"
    for module in sorted(_imported_modules(code) - {"graph_opt"}):
        pytest.importorskip(module)
    (tmp_path / script).write_text(code + "\n")
    env = dict(os.environ, PYTHONPATH=ROOT)  # the conftest has cleared GRAPH_OPT_* from os.environ
    env.update(setting.split("=", 1) for setting in settings)
    done = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{page}:{line} exited {done.returncode}:\n{out[-4000:]}"
    stats = re.search(r"Stats\(.*\)", done.stdout)
    if stats:
        fields = dict(re.findall(r"\b(captures|replays|fallbacks)=(\d+)", stats.group(0)))
        assert int(fields["captures"]) > 0, f"{page}:{line}: no size captured:\n{stats.group(0)}"
        assert int(fields["replays"]) >= 1 and fields["fallbacks"] == "0", \
            f"{page}:{line}: the call did not replay:\n{stats.group(0)}"


def _imported_modules(code):
    modules = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules
