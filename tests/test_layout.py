"""The layout shows the architecture: no import circle among graph_opt's modules (type hints under
TYPE_CHECKING aside), and no runtime file over 500 lines."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("graph_opt", "backends")
MAX_LINES = 500


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":
        parts = ["graph_opt"] + parts  # installed as graph_opt.backends
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.AST):
    """Import statements that run: not those under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level and id(n) not in skipped]


def _graph():
    files = [p for folder in RUNTIME for p in (ROOT / folder).rglob("*.py")]
    modules = {_module(p): p for p in files}
    edges = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = base + ("." + node.module if node.module else "")
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    edges[name].add(f"{target}.{alias.name}")
                elif target in modules and target != "graph_opt":  # the package itself re-exports
                    edges[name].add(target)
    return edges


def test_no_import_circle():
    edges = _graph()
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_graph_sees_imports():
    """The check above would pass on a graph with no edges: it has the ones every runner has."""
    edges = _graph()
    assert "graph_opt.capture.capture_phase" in edges["graph_opt.replay.runner"]
    assert "graph_opt.replay.signature" in edges["graph_opt.replay.runner"]


def test_no_runtime_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for folder in RUNTIME for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"runtime files over {MAX_LINES} lines: {long}"
