"""Run in a fresh interpreter by tests/test_patches.py: installs every patch group of the frameworks
named on the command line, checks what removal restores, and prints a JSON report."""
import json
import sys

frameworks = sys.argv[1:]
report = {"installed": [], "restored": True, "problems": []}
import graph_opt  # noqa: E402,F401
from graph_opt.backends import patches  # noqa: E402

originals = {}
if "torch" in frameworks:
    import torch
    from torch.utils.hooks import RemovableHandle
    from torch.nn.modules import module as module_mod

    originals.update({
        "Module.train": (torch.nn.Module, "train", torch.nn.Module.__dict__["train"]),
        "Module._apply": (torch.nn.Module, "_apply", torch.nn.Module.__dict__["_apply"]),
        "Module.register_parameter": (torch.nn.Module, "register_parameter", torch.nn.Module.__dict__["register_parameter"]),
        "Parameter.data": (torch.nn.Parameter, "data", torch.nn.Parameter.__dict__.get("data")),
        "RemovableHandle.__init__": (RemovableHandle, "__init__", RemovableHandle.__dict__["__init__"]),
        "torch.utils.swap_tensors": (torch.utils, "swap_tensors", torch.utils.swap_tensors),
        "torch._C._set_cublas_allow_tf32": (torch._C, "_set_cublas_allow_tf32", torch._C._set_cublas_allow_tf32),
    })
    hooks_before = len(module_mod._global_parameter_registration_hooks)
    unpatched_setattr = torch.nn.Module.__dict__["__setattr__"]  # never patched (docs/patches.md)
if "paddle" in frameworks:
    import paddle

    originals.update({
        "Layer.__setattr__": (paddle.nn.Layer, "__setattr__", paddle.nn.Layer.__dict__["__setattr__"]),
        "Layer.train": (paddle.nn.Layer, "train", paddle.nn.Layer.__dict__["train"]),
        "EagerParamBase.data": (paddle.base.framework.EagerParamBase, "data",
                                paddle.base.framework.EagerParamBase.__dict__.get("data")),
        "paddle.grad": (paddle, "grad", paddle.grad),
    })


def install_all():
    for fw in frameworks:
        backend = graph_opt.backends.load(fw)
        a = backend.ADAPTER
        a.registration_counter(), a.hook_counter(), a.mode_counter(), a.conversion_counter(), a.attribute_counter()
        if fw == "torch":
            a.math_mode_counter()
        backend.autograd_bridge()


def bumps():
    """Each counter moves when the framework does what it counts."""
    out = {}
    for fw in frameworks:
        a = graph_opt.backends.load(fw).ADAPTER
        modes, regs, attrs, convs = a.mode_counter(), a.registration_counter(), a.attribute_counter(), \
            a.conversion_counter()
        before = (modes[0], regs[0], attrs[0], convs[0])
        if fw == "torch":
            m = torch.nn.Linear(2, 2)
            m.eval()
            m.register_buffer("b", torch.zeros(1))
            m.scale = 2.0
            m.weight.data = torch.zeros(2, 2)
        else:
            m = paddle.nn.Linear(2, 2)
            m.eval()
            m.w2 = paddle.create_parameter([1], "float32")
            m.scale = 2.0
            m.weight.data = paddle.zeros([2, 2])
        out[fw] = [modes[0] > before[0], regs[0] > before[1], attrs[0] > before[2], convs[0] > before[3]]
    return out


def refused_while_graphs_are_held():
    """remove_all() with a captured model, then a graphed block, holding graphs: refused, until
    clear_graphs(); a replay would no longer see what the counters count."""
    from graph_opt.errors import GraphOptError

    fw = frameworks[0]
    if fw == "torch":
        base, lin, zeros, no_grad = torch.nn.Module, torch.nn.Linear, lambda n: torch.zeros(n, 4), torch.no_grad
    else:
        base, lin, zeros, no_grad = paddle.nn.Layer, paddle.nn.Linear, lambda n: paddle.zeros([n, 4]), paddle.no_grad

    class Tiny(base):
        def __init__(self, graph_opt_config=None):
            super().__init__()
            self.lin = lin(4, 4)

        def forward(self, x):
            return self.lin(x)

    refusals = []
    with graph_opt.testing.simulate_cuda_graphs():
        m = graph_opt.support_graph_optimization(type("Graphed", (Tiny,), {}))(
            graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=[2]))
        m.eval()
        with no_grad():
            graph_opt.capture_model(m, zeros, progress=False)
        block = graph_opt.autocudagraph(Tiny(), warmup_steps=0)
        block(zeros(2))
        for holder in (m, block):
            try:
                patches.remove_all()
                refusals.append(False)
            except GraphOptError as exc:
                refusals.append("clear_graphs" in str(exc))
            graph_opt.clear_graphs(holder)
    return refusals


install_all()
report["refused_while_held"] = refused_while_graphs_are_held()
report["installed"] = [(p.group, p.where, p.why) for p in patches.installed()]
for key, (owner, name, original) in originals.items():
    if getattr(owner, name) is original:
        report["problems"].append(f"{key} was not patched")
if "torch" in frameworks and torch.nn.Module.__dict__["__setattr__"] is not unpatched_setattr:
    report["problems"].append("Module.__setattr__ was patched: Dynamo then refuses forwards that set attributes")
report["bumps_before"] = bumps()
report["removed"] = patches.remove_all()
for key, (owner, name, original) in originals.items():
    now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    if now is not original:
        report["problems"].append(f"{key} not restored")
if "torch" in frameworks and len(module_mod._global_parameter_registration_hooks) != hooks_before:
    report["problems"].append("torch's global registration hooks not removed")
report["left"] = len(patches.installed())
install_all()  # installed again at the next use
report["reinstalled"] = len(patches.installed())
report["bumps_after"] = bumps()
print(json.dumps(report))
