"""docs/api.md is the public API as the code has it: every name of graph_opt.__all__ and of
graph_opt.testing.__all__ has an entry, each entry's written signature is the object's own
(inspect.signature: names, kinds and defaults; annotations where written; a class's bases), and no entry
names something that does not exist. The entry format is described at the top of docs/api.md.
No framework is imported."""
import ast
import dataclasses
import inspect
import os
import re

import pytest

import graph_opt
import graph_opt.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api.md")
HEADING = re.compile(r"#{2,4}\s+`(graph_opt(?:\.\w+)*)`\s*$")
NAME = r"(graph_opt(?:\.\w+)*)"


def entries():
    """(name, the first python block after its heading) for each entry heading of docs/api.md."""
    lines = open(API, encoding="utf-8").read().splitlines()
    found, in_fence = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        heading = None if in_fence else HEADING.match(line)
        if not heading:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block = None
        if j < len(lines) and lines[j].strip() == "```python":
            end = next((k for k in range(j + 1, len(lines)) if lines[k].strip() == "```"), len(lines))
            block = "\n".join(lines[j + 1:end]).strip()
        found.append((heading.group(1), block))
    return found


ENTRIES = entries()


def public_names():
    return ({f"graph_opt.{n}" for n in graph_opt.__all__}
            | {f"graph_opt.testing.{n}" for n in graph_opt.testing.__all__})


def resolve(name):
    """(parent, object) for a dotted name under graph_opt, whose first part (and, under graph_opt.testing,
    second part) is public; AssertionError where it is not, or does not exist."""
    parts = name.split(".")[1:]
    assert parts, "graph_opt itself has no entry"
    assert parts[0] in graph_opt.__all__, f"{name}: {parts[0]} is not in graph_opt.__all__"
    if parts[0] == "testing" and len(parts) > 1:
        assert parts[1] in graph_opt.testing.__all__, f"{name}: {parts[1]} is not in graph_opt.testing.__all__"
    parent, obj = None, graph_opt
    for part in parts:
        assert hasattr(obj, part), f"{name}: no such attribute {part!r}"
        parent, obj = obj, getattr(obj, part)
    return parent, obj


def annotation_text(annotation) -> str:
    """An annotation as source text, with the quotes of postponed or forward references taken off."""
    if not isinstance(annotation, str):
        return getattr(annotation, "__qualname__", None) or repr(annotation)
    node = ast.parse(annotation, mode="eval").body
    while isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    return ast.unparse(node)


def written_parameters(args: ast.arguments):
    """(name, kind, default source or None, annotation source or None) of a parsed parameter list."""
    P = inspect.Parameter
    positional = [(a, P.POSITIONAL_ONLY) for a in args.posonlyargs] + [(a, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [(a, kind, d) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        params.append((args.vararg, P.VAR_POSITIONAL, None))
    params += [(a, P.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append((args.kwarg, P.VAR_KEYWORD, None))
    return [(a.arg, kind, d, a.annotation) for a, kind, d in params]


def code_default(obj, parameter: inspect.Parameter):
    """A parameter's default; for a dataclass field with a default factory, the value the factory makes."""
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        field = {f.name: f for f in dataclasses.fields(obj)}.get(parameter.name)
        if field is not None and field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
    return parameter.default


def check_call(name, written, parent, obj):
    assert callable(obj), f"{name} is written as a call but is a {type(obj).__name__}"
    tree = ast.parse(f"def _{written}: ...")
    fn = tree.body[0]
    signature = inspect.signature(obj)
    params = list(signature.parameters.values())
    if inspect.isclass(parent) and inspect.isfunction(inspect.getattr_static(parent, name.rsplit(".", 1)[1])):
        params = params[1:]  # a method, written without self
    doc = written_parameters(fn.args)
    assert [(n, k) for n, k, _, _ in doc] == [(p.name, p.kind) for p in params], (
        f"{name}: docs/api.md writes ({', '.join(n for n, *_ in doc)}), the code has {signature}")
    for (pname, _, default, annotation), p in zip(doc, params):
        assert (default is None) == (p.default is inspect.Parameter.empty), f"{name}: default of {pname}"
        if default is not None:
            assert ast.literal_eval(default) == code_default(obj, p), (
                f"{name}: {pname}={ast.unparse(default)} in docs/api.md, {p.default!r} in the code")
        if annotation is not None:
            assert p.annotation is not inspect.Parameter.empty, f"{name}: {pname} has no annotation in the code"
            assert ast.unparse(annotation) == annotation_text(p.annotation), f"{name}: annotation of {pname}"
    if fn.returns is not None:
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation in the code"
        assert ast.unparse(fn.returns) == annotation_text(signature.return_annotation), f"{name}: return annotation"


def check_entry(name, block):
    assert block, f"{name}: the heading is not followed by a python block"
    first = block.split("\n\n")[0].strip()
    parent, obj = resolve(name)
    if m := re.fullmatch(r"class\s+" + NAME + r"\s*(?:\((.*)\))?", first, re.S):
        assert m.group(1) == name, f"the block under {name} names {m.group(1)}"
        assert inspect.isclass(obj), f"{name} is written as a class but is a {type(obj).__name__}"
        bases = [b.strip() for b in (m.group(2) or "").split(",") if b.strip()] or ["object"]
        assert bases == [b.__name__ for b in obj.__bases__], f"{name}: bases {bases} in docs/api.md"
    elif m := re.fullmatch(NAME + r"\s*=\s*(.+)", first, re.S):
        assert m.group(1) == name, f"the block under {name} names {m.group(1)}"
        assert ast.literal_eval(m.group(2)) == obj, f"{name} = {obj!r} in the code"
    elif m := re.fullmatch(NAME + r"\s*(\(.*)", first, re.S):
        assert m.group(1) == name, f"the block under {name} names {m.group(1)}"
        check_call(name, m.group(2), parent, obj)
    else:
        assert first == name, f"the block under {name} does not start with it: {first[:60]!r}"
        assert inspect.ismodule(obj), f"{name} is written as a module but is a {type(obj).__name__}"


def test_every_public_name_has_an_entry_once():
    names = [n for n, _ in ENTRIES]
    assert not public_names() - set(names), f"no entry in docs/api.md: {sorted(public_names() - set(names))}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"more than one entry in docs/api.md: {repeated}"


@pytest.mark.parametrize("name, block", ENTRIES, ids=[n for n, _ in ENTRIES])
def test_the_entry_is_the_code(name, block):
    check_entry(name, block)


def test_a_wrong_entry_is_caught():
    """The check itself: a default, a parameter, a base or a name other than the code's fails."""
    wrong = [
        ("graph_opt.capture_model", "graph_opt.capture_model(model, make_inputs, sizes=None, progress=False)"),
        ("graph_opt.autocudagraph", "graph_opt.autocudagraph(layer_or_fn, *, warmup_steps=1)"),
        ("graph_opt.load_config", "graph_opt.load_config(path=None, **overrides)"),
        ("graph_opt.GuardFailed", "class graph_opt.GuardFailed(GraphOptError)"),
        ("graph_opt.stats", "graph_opt.stats(model) -> Stats"),
        ("graph_opt.no_such_name", "graph_opt.no_such_name()"),
    ]
    for name, block in wrong:
        with pytest.raises(AssertionError):
            check_entry(name, block)
