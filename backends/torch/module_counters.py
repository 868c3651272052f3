"""Process-wide counters of changes to torch modules, each installed once by patching nn.Module (or
RemovableHandle, nn.Parameter): parameter, buffer and submodule registrations, train()/eval(), hook
handles made or removed, _apply conversions and parameters' `.data` assigned. A replay compares one
integer and looks at the model only after a
bump (graph_opt.watch.replay_guards, through the adapter; dynamo.py for the registrations).
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _module_mod

from .. import patches
from ..call_counters import count_calls

_registrations = [0]  # parameter, buffer or submodule registrations in this process
_REPLACED = "a replay looks at the model's tensors again only after a registration (replaced, added or removed)"


def _install_registration_hooks() -> None:
    patches.once("torch.registrations", _registration_hooks)


def _registration_hooks() -> None:
    compiling = torch.compiler.is_compiling

    # Not counted while Dynamo traces: a forward that registers a module (Hugging Face Llama slices
    # `self.layers[:n]`, a new ModuleList each call) would make the count a guard of its graph, failing
    # at every replay. Such a registration is the forward's own, not a change of the model.
    def bump(*args):
        if not compiling():
            _registrations[0] += 1

    for kind in ("parameter", "buffer", "module"):
        register = getattr(_module_mod, f"register_module_{kind}_registration_hook")
        patches.on_removal(register(bump).remove, f"torch.nn.modules.module.register_module_{kind}_registration_hook",
                           _REPLACED)
    # torch calls those hooks for tensors and modules only: `lin.bias = None` (register_parameter(name,
    # None)), register_buffer(name, None) and `del m.attr` change what a forward reads without them.
    count_calls(torch.nn.Module, ("register_parameter", "register_buffer", "__delattr__"), _registrations,
                _REPLACED + ": `lin.bias = None` and `del m.attr` reach no registration hook", unless=compiling)
    # torch.func.functional_call (and stateless, make_functional) swaps tensors and submodules by writing
    # module._parameters / _buffers / _modules directly, bypassing those hooks: a replay would run the
    # captured tensors instead of the ones passed. NamedMemberAccessor looks these helpers up at call time.
    from torch.nn.utils import _named_member_accessor as accessor

    count_calls(accessor, ("set_tensor", "swap_tensor", "swap_submodule"), _registrations,
                _REPLACED + ": torch.func.functional_call swaps tensors in and out through these", unless=compiling)


def module_fingerprint(model) -> tuple:
    """(path, id) of every submodule, parameter slot and buffer slot; a slot holding None has id 0."""
    return module_state(model, layouts=False)[0]


def tensor_layout(t) -> tuple:
    """(id, address, dtype, device, shape, strides): which tensor a graph read, and where and how."""
    return id(t), t.data_ptr(), t.dtype, t.device, t.shape, t.stride()


def module_state(model, layouts: bool = True) -> tuple:
    """(module_fingerprint, path -> tensor_layout of every parameter and buffer the model holds, or
    None), from one walk of the module tree."""
    fingerprint, held = [], ({} if layouts else None)
    for path, m in model.named_modules(remove_duplicate=False):
        prefix = path + "." if path else ""
        if path:
            fingerprint.append((path, id(m)))
        for slots in (m._parameters, m._buffers):
            for k, t in slots.items():
                fingerprint.append((prefix + k, 0 if t is None else id(t)))
                if layouts and t is not None:
                    held[prefix + k] = tensor_layout(t)
    return tuple(fingerprint), held


_mode_changes = [0]  # calls of nn.Module.train / eval in this process


def _install_mode_counter() -> None:
    patches.once("torch.modes", lambda: count_calls(  # eval() calls train(False)
        torch.nn.Module, ("train",), _mode_changes,
        "a replay reads the training flags of every submodule again only after a train() or eval()"))


_hook_changes = [0]  # hook handles made or removed in this process


def _install_hook_counter() -> None:
    def install():
        from torch.utils.hooks import RemovableHandle

        count_calls(RemovableHandle, ("__init__", "remove"), _hook_changes,
                    "a replay compares the model's hooks with those at capture only after a hook handle was made "
                    "or removed")

    patches.once("torch.hooks", install)


_conversions = [0]  # calls of nn.Module._apply in this process
_CONVERTED = "a replay compares the tensors' addresses, dtypes and devices with those at capture only after a conversion"


def _install_conversion_counter() -> None:
    def install():
        count_calls(torch.nn.Module, ("_apply",), _conversions, _CONVERTED + " (to(), half(), cuda())")
        # swap_tensors keeps both objects and exchanges their data: load_state_dict does it outside _apply
        # under torch.__future__.set_swap_module_params_on_conversion(True). Looked up at call time.
        count_calls(torch.utils, ("swap_tensors",), _conversions,
                    _CONVERTED + ": load_state_dict swaps tensors through it under swap_module_params_on_conversion")

        # `p.data = t` keeps the Parameter and moves it onto other memory, as a conversion does (torch's
        # setter is C code: a property of nn.Parameter's own wraps it, and parameters alone get it)
        data = torch._C.TensorBase.data
        get, set_ = data.__get__, data.__set__

        def set_data(self, value):
            _conversions[0] += 1
            try:
                set_(self, value)
            finally:
                _conversions[0] += 1

        patches.replace(torch.nn.Parameter, "data", property(get, set_data, doc=data.__doc__),
                        _CONVERTED + ": a parameter's .data assigned keeps the object and moves its memory",
                        where="torch.nn.Parameter.data")

    patches.once("torch.conversions", install)
