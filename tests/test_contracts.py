"""graph_opt/contracts.py is what the core needs from a framework: every member the core calls on an
adapter, an autograd bridge, a strategy or a graph recorder is declared there, and every backend (and
both recorders, the device's and the host stand-in's) has every member declared. A member used but not
declared, or declared but missing from an implementation, fails here."""
import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from graph_opt import contracts

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted((ROOT / "graph_opt").rglob("*.py"))
# The names the core gives the three seams' objects (local variables and attributes)
SEAMS = {"adapter": contracts.Adapter, "_adapter": contracts.Adapter,
         "bridge": contracts.AutogradBridge, "_bridge": contracts.AutogradBridge,
         "strategy": contracts.StaticStrategy, "_strategy": contracts.StaticStrategy,
         "recorder": contracts.Recorder}


def declared(protocol) -> set:
    names = set()
    for cls in protocol.__mro__:
        if cls.__module__ != contracts.__name__:
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def used_by_core() -> dict:
    """Per protocol: {member: files} of `<seam name>.member` in graph_opt/*.py."""
    found = {}
    for path in CORE:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in SEAMS:
                found.setdefault(SEAMS[name], {}).setdefault(node.attr, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("protocol", [contracts.Adapter, contracts.AutogradBridge, contracts.StaticStrategy,
                                      contracts.Recorder], ids=lambda p: p.__name__)
def test_every_member_the_core_calls_is_declared(protocol):
    used = used_by_core().get(protocol, {})
    assert used, f"the scan found no use of {protocol.__name__}: the seam names changed"
    missing = {m: sorted(files) for m, files in used.items() if m not in declared(protocol)}
    assert not missing, f"used by the core but not declared in contracts.{protocol.__name__}: {missing}"


def test_the_traits_are_data_the_core_reads_not_probes():
    """No getattr(strategy, "...", default): a strategy declares its traits (StrategyTraits)."""
    probes = []
    for path in CORE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and node.args:
                target = ast.unparse(node.args[0])
                if target.split(".")[-1] in SEAMS and SEAMS[target.split(".")[-1]] is contracts.StaticStrategy:
                    probes.append(f"{path.name}: {ast.unparse(node)}")
    assert not probes, probes


@pytest.mark.parametrize("recorder", ["device_graphs:DeviceGraphs", "host_graphs:HostGraphs"])
def test_both_recorders_have_every_declared_member_with_its_parameters(recorder):
    """The device's graphs and the host stand-in's are called alike: same members, same parameters."""
    module, name = recorder.split(":")
    cls = importlib.import_module(f"graph_opt.recorders.{module}").__dict__[name]
    missing = sorted(declared(contracts.Recorder) - _members(cls))
    assert not missing, f"{name} lacks {missing}"
    differ = [m for m in declared(contracts.Recorder)
              if list(inspect.signature(getattr(cls, m)).parameters)[1:]
              != list(inspect.signature(getattr(contracts.Recorder, m)).parameters)[1:]]
    assert not differ, f"{name}: parameters differ from contracts.Recorder's in {differ}"


def _members(obj) -> set:
    return {n for n in dir(obj) if not n.startswith("__")}


def _instance_attributes(cls) -> set:
    """Attributes a class's __init__ assigns on self."""
    tree = ast.parse(inspect.getsource(cls))
    init = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    found = set()
    for node in ast.walk(init) if init else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                    found.add(target.attr)
    return found


def _backends():
    out = []
    if importlib.util.find_spec("torch"):
        out.append("torch")
    if importlib.util.find_spec("paddle"):
        out.append("paddle")
    return out


@pytest.mark.parametrize("framework", _backends())
def test_each_backend_has_every_declared_member(framework):
    import graph_opt.backends as backends
    from graph_opt.capture.level0 import EagerStrategy

    backend = backends.load(framework)
    missing = sorted(declared(contracts.Adapter) - _members(backend.ADAPTER))
    assert not missing, f"{framework} adapter lacks {missing}"
    bridge = importlib.import_module(f"graph_opt.backends.{framework}.autograd_bridge")
    cls = next(v for k, v in vars(bridge).items() if k.endswith("AutogradBridge") and inspect.isclass(v))
    missing = sorted(declared(contracts.AutogradBridge) - _members(cls))
    assert not missing, f"{framework} bridge lacks {missing}"
    strategy = {"torch": "graph_opt.backends.torch.dynamo:DynamoStrategy",
                "paddle": "graph_opt.backends.paddle.sot:SotStrategy"}[framework]
    module, name = strategy.split(":")
    for cls in (importlib.import_module(module).__dict__[name], EagerStrategy):
        assert isinstance(cls.traits, contracts.StrategyTraits), cls
        missing = sorted(declared(contracts.StaticStrategy) - _members(cls) - _instance_attributes(cls))
        assert not missing, f"{cls.__name__} lacks {missing}"

