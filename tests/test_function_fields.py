"""graph_opt/watch/function_fields.py: a view of a function's __code__ / __defaults__ / __kwdefaults__ pointer
sees each of them assigned anew, and is offered only where the interpreter's layout is the known one."""
import sys

import pytest

from graph_opt.watch import function_fields


def _target(a, b=1, *, c=2):
    return a + b + c


def _other(a, b=5, *, c=7):
    return a * b * c


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="the views read CPython's function layout")
def test_a_view_sees_each_field_assigned_anew_and_nothing_else():
    assert function_fields._layout_holds()
    saved = (_target.__code__, _target.__defaults__, _target.__kwdefaults__)
    views = {name: function_fields._view(_target, name) for name in ("__code__", "__defaults__", "__kwdefaults__")}
    assert all(view.value == expected for view, expected in views.values())
    _target.__doc__, _target.__name__ = "changed", "renamed"  # not what the views read
    assert all(view.value == expected for view, expected in views.values())
    try:
        for name, new in (("__code__", _other.__code__), ("__defaults__", (9,)), ("__kwdefaults__", None)):
            setattr(_target, name, new)
            view, expected = views[name]
            assert view.value != expected and view.value == (None if new is None else id(new)), name
    finally:
        _target.__code__, _target.__defaults__, _target.__kwdefaults__ = saved
        _target.__name__ = "_target"
    assert all(view.value == expected for view, expected in views.values())


def test_the_viewer_is_offered_only_with_the_known_layout(monkeypatch):
    monkeypatch.setattr(function_fields, "_CHOICE", [])
    monkeypatch.setattr(function_fields, "_layout_holds", lambda: False)
    assert function_fields.viewer() is None
