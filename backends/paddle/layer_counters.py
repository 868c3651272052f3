"""Process-wide counters of changes to Paddle layers, each installed once by patching paddle.nn.Layer (or
HookRemoveHelper, EagerParamBase): parameters, buffers and sublayers set (Paddle has no registration
hooks), attributes set, train()/eval(), hooks registered or removed, _apply conversions and
parameters' `.data` assigned. A replay compares one integer and looks at the model only after a bump
(graph_opt.watch.module_watch, through the adapter).
"""
from __future__ import annotations

import functools

import paddle

from .. import patches
from ..call_counters import count_calls

_registrations = [0]  # tensors or layers set on a Layer, in this process
_conversions = [0]  # calls of Layer._apply, and parameters' .data assigned, in this process
_attribute_sets = [0]  # attributes of layers set or deleted in this process
_REPLACED = "a replay looks at the model's tensors again only after a registration (Paddle has no registration hooks)"
_ATTRIBUTES = "a level-0 replay compares the sublayers' attributes with those at capture only after one was set"
_CONVERTED = "a replay compares the tensors' addresses, dtypes and places with those at capture only after a conversion"


def _install_registration_counter() -> None:
    patches.once("paddle.registrations", _registration_counter)


def _registration_counter() -> None:
    layer = paddle.nn.Layer
    setattr_ = layer.__setattr__

    @functools.wraps(setattr_)
    def counted_setattr(self, name, value):
        _attribute_sets[0] += 1
        try:
            setattr_(self, name, value)
        finally:
            _attribute_sets[0] += 1
        # A registered parameter, buffer or sublayer set to None (`lin.bias = None`) keeps its name there
        if isinstance(value, (paddle.Tensor, layer)) or value is None and _registered(self, name):
            _registrations[0] += 1

    patches.replace(layer, "__setattr__", counted_setattr, _REPLACED + ": a tensor or layer set as an attribute; "
                    "a level-0 replay compares the sublayers' attributes with those at capture only after one was set")
    count_calls(layer, ("add_parameter", "register_buffer", "add_sublayer", "__delattr__"), _registrations, _REPLACED)
    count_calls(layer, ("__delattr__",), _attribute_sets, _ATTRIBUTES)
    count_calls(layer, ("_apply",), _conversions, _CONVERTED + " (to(), astype())")
    # `p.data = t` keeps the parameter and moves it onto other memory, as a conversion does (Paddle's setter
    # is C code: a property of EagerParamBase's own wraps it, and parameters alone get it)
    from paddle.base.framework import EagerParamBase

    data = paddle.Tensor.data
    get, set_ = data.__get__, data.__set__

    def set_data(self, value):
        _conversions[0] += 1
        try:
            set_(self, value)
        finally:
            _conversions[0] += 1

    patches.replace(EagerParamBase, "data", property(get, set_data, doc=data.__doc__),
                    _CONVERTED + ": a parameter's .data assigned keeps the object and moves its memory",
                    where="paddle.base.framework.EagerParamBase.data")


def _registered(layer, name: str) -> bool:
    d = layer.__dict__
    return any(name in (d.get(slot) or ()) for slot in ("_parameters", "_buffers", "_sub_layers"))


_hook_changes = [0]  # Layer hooks registered or removed in this process


def _install_hook_counter() -> None:
    def install():
        from paddle.nn.layer.layers import HookRemoveHelper

        count_calls(HookRemoveHelper, ("__init__", "remove"), _hook_changes,
                    "a replay compares the model's hooks with those at capture only after a hook was registered or "
                    "removed")

    patches.once("paddle.hooks", install)


_mode_changes = [0]  # calls of Layer.train / eval in this process


def _install_mode_counter() -> None:
    patches.once("paddle.modes", lambda: count_calls(
        paddle.nn.Layer, ("train", "eval"), _mode_changes,
        "a replay reads the training flags of every sublayer again only after a train() or eval()"))
