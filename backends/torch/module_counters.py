"""Process-wide counters of changes to torch modules, each installed once by patching nn.Module (or
RemovableHandle): parameter, buffer and submodule registrations, train()/eval(), hook handles made or
removed, and _apply conversions. A replay compares one integer and looks at the model only after a
bump (graph_opt.replay_guards, through the adapter; dynamo.py for the registrations).
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _module_mod

from ..call_counters import count_calls

_registrations = [0]  # parameter, buffer or submodule registrations in this process
_hooks_installed = False


def _install_registration_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return

    compiling = torch.compiler.is_compiling

    # Not counted while Dynamo traces: a forward that registers a module (Hugging Face Llama slices
    # `self.layers[:n]`, a new ModuleList each call) would make the count a guard of its graph, failing
    # at every replay. Such a registration is the forward's own, not a change of the model.
    def bump(*args):
        if not compiling():
            _registrations[0] += 1

    _module_mod.register_module_parameter_registration_hook(bump)
    _module_mod.register_module_buffer_registration_hook(bump)
    _module_mod.register_module_module_registration_hook(bump)
    # torch calls those hooks for tensors and modules only: `lin.bias = None` (register_parameter(name,
    # None)), register_buffer(name, None) and `del m.attr` change what a forward reads without them.
    count_calls(torch.nn.Module, ("register_parameter", "register_buffer", "__delattr__"), _registrations,
                unless=compiling)
    # torch.func.functional_call (and stateless, make_functional) swaps tensors and submodules by writing
    # module._parameters / _buffers / _modules directly, bypassing those hooks: a replay would run the
    # captured tensors instead of the ones passed. NamedMemberAccessor looks these helpers up at call time.
    from torch.nn.utils import _named_member_accessor as accessor

    count_calls(accessor, ("set_tensor", "swap_tensor", "swap_submodule"), _registrations, unless=compiling)
    _hooks_installed = True


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
_mode_counter_installed = False


def _install_mode_counter() -> None:
    global _mode_counter_installed
    if _mode_counter_installed:
        return
    count_calls(torch.nn.Module, ("train",), _mode_changes)  # eval() calls train(False)
    _mode_counter_installed = True


_hook_changes = [0]  # hook handles made or removed in this process
_hook_counter_installed = False


def _install_hook_counter() -> None:
    global _hook_counter_installed
    if _hook_counter_installed:
        return
    from torch.utils.hooks import RemovableHandle

    count_calls(RemovableHandle, ("__init__", "remove"), _hook_changes)
    _hook_counter_installed = True


_conversions = [0]  # calls of nn.Module._apply in this process
_conversion_counter_installed = False


def _install_conversion_counter() -> None:
    global _conversion_counter_installed
    if _conversion_counter_installed:
        return
    count_calls(torch.nn.Module, ("_apply",), _conversions)
    # swap_tensors keeps both objects and exchanges their data: load_state_dict does it outside _apply
    # under torch.__future__.set_swap_module_params_on_conversion(True). Looked up at call time.
    count_calls(torch.utils, ("swap_tensors",), _conversions)
    _conversion_counter_installed = True
