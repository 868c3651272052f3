"""docs/code-map.md lists every source file of the package (graph_opt/, backends/, benchmarks/), and
nothing that is gone."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_map_lists_every_file_and_no_other():
    text = (ROOT / "docs" / "code-map.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", text, re.M))
    files = {str(p.relative_to(ROOT)) for folder in ("graph_opt", "backends", "benchmarks")
             for p in (ROOT / folder).rglob("*.py")}
    assert not files - listed, f"not in docs/code-map.md: {sorted(files - listed)}"
    assert not listed - files, f"in docs/code-map.md but gone: {sorted(listed - files)}"
