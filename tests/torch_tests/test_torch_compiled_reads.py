"""backends/torch/compiled_reads.py: the identity checks of dict_reads.Reads that no dict write shows, run as
one call of torch's C++ guard tree. Every change the Python check sees, the compiled one sees; an alike
value (an equal code object, a __mro__ of the same classes) is accepted and the compiled check made anew."""
import types

import pytest

pytest.importorskip("torch")

from graph_opt.backends.torch.compiled_reads import compile_identities  # noqa: E402
from graph_opt.watch.dict_reads import Reads  # noqa: E402


def _make(source: str, name: str):
    scope = {}
    exec(compile(source, "<test>", "exec"), scope)
    return scope[name]


def _reads(compiled: bool, classes=(), owners=(), pins=()):
    reads = Reads([], [], [], [], classes=list(classes), owners=list(owners),
                  pinned=[(f"pin {i}", obj, name, value) for i, (obj, name, value) in enumerate(pins)])
    reads.versioned(lambda d: 0, [])  # no dict read: only the checks no dict write shows
    if compiled:
        reads.compile_with(compile_identities)
    assert not reads.differs() and not reads.differs()
    assert (reads._fast is not None) == compiled
    return reads


both = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])


@both
def test_the_compiled_check_answers_alone_while_nothing_moved(compiled, monkeypatch):
    fn = _make("def f(x):\n    return x + 1\n", "f")
    reads = _reads(compiled, pins=[(fn, "__code__", fn.__code__)])
    calls = []
    monkeypatch.setattr(reads, "_same_dicts", lambda: calls.append(1) or Reads._same_dicts(reads))
    for _ in range(3):
        assert not reads.differs()
    assert len(calls) == (0 if compiled else 3)


@both
def test_a_code_swap_is_a_change_an_equal_code_is_not(compiled):
    source = "def f(x):\n    return x * 2\n"
    fn = _make(source, "f")
    code = fn.__code__
    reads = _reads(compiled, pins=[(fn, "__code__", code)])
    fn.__code__ = _make("def f(x):\n    return x * 3\n", "f").__code__
    assert reads.differs() and reads.differs()
    fn.__code__ = code
    assert not reads.differs()
    fn.__code__ = _make(source, "f").__code__  # the same source compiled again: runs alike
    assert not reads.differs() and not reads.differs()
    assert (reads._fast is not None) == compiled  # made anew from the equal code
    fn.__code__ = _make("def f(x):\n    return x * 4\n", "f").__code__
    assert reads.differs()


@both
def test_a_class_assigned_to_an_object_is_a_change(compiled):
    class A:
        pass

    class B:
        pass

    obj = A()
    reads = _reads(compiled, classes=[("obj.__class__", obj, A)])
    obj.__class__ = B
    assert reads.differs()
    obj.__class__ = A
    assert not reads.differs()


class _Holder:
    def __init__(self):
        self.scale = 2.0


@both
def test_an_objects_dict_replaced_is_a_change(compiled):
    obj = _Holder()
    d = vars(obj)
    reads = _reads(compiled, owners=[("obj.__dict__", obj, d)])
    obj.__dict__ = {"scale": 2.0}
    assert reads.differs()
    obj.__dict__ = d
    assert not reads.differs()


@both
def test_a_cell_rebound_or_emptied_is_a_change(compiled):
    was = object()
    cell = types.CellType(was)  # a closure's cell, as a function holding `was` would have
    reads = _reads(compiled, pins=[(cell, "cell_contents", was)])
    cell.cell_contents = 2.5
    assert reads.differs()
    cell.cell_contents = was
    assert not reads.differs()
    del cell.cell_contents
    assert reads.differs()


@both
def test_a_classs_bases_changed_is_a_change_and_set_back_is_not(compiled):
    base, other = type("Base", (), {}), type("Other", (), {})
    child = type("Child", (base,), {})
    reads = _reads(compiled, pins=[(child, "__mro__", child.__mro__)])
    child.__bases__ = (other,)
    assert reads.differs()
    child.__bases__ = (base,)  # a new __mro__ tuple of the same classes
    assert not reads.differs() and not reads.differs()
    assert (reads._fast is not None) == compiled


@both
def test_defaults_none_and_set_are_read(compiled):
    fn = _make("def f(self, name, extra=1, *, kw=2):\n    return name\n", "f")
    bare = _make("def g(self, name):\n    return name\n", "g")
    reads = _reads(compiled, pins=[(fn, "__defaults__", fn.__defaults__), (fn, "__kwdefaults__", fn.__kwdefaults__),
                                   (bare, "__defaults__", None), (bare, "__kwdefaults__", None)])
    bare.__defaults__ = (3,)
    assert reads.differs()
    bare.__defaults__ = None
    assert not reads.differs()
    defaults = fn.__defaults__
    fn.__defaults__ = (1,)  # an equal tuple, another object: Dynamo's guard is on the object
    assert reads.differs()
    fn.__defaults__ = defaults
    assert not reads.differs()
    fn.__kwdefaults__ = None
    assert reads.differs()


def test_a_check_that_cannot_be_compiled_leaves_the_python_check():
    fn = _make("def f(x):\n    return x\n", "f")
    assert compile_identities([(fn, "no such kind", None, None)]) is None
    assert compile_identities([(fn, "attr", "__code__", _make("def g():\n    pass\n", "g").__code__)]) is None
    reads = Reads([], [], [], [], pinned=[("pin", fn, "__code__", fn.__code__)])
    reads.versioned(lambda d: 0, [])
    asked = []
    reads.compile_with(lambda items: asked.append(1))
    for _ in range(6):
        assert not reads.differs()
    assert reads._fast is None and reads._compile is None and len(asked) == 3  # three misses in a row, then Python
    fn.__code__ = _make("def h(x):\n    return -x\n", "h").__code__
    assert reads.differs()


def test_the_compiled_check_holds_what_it_compares():
    """An id compared stays that object's: the checker holds the expected values."""
    import gc
    import weakref

    obj = _Holder()
    fast = compile_identities([(obj, "dict", None, vars(obj))])
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    assert ref() is not None and fast()


def test_a_write_while_the_compiled_check_is_made_is_seen():
    """The values are read before the Python check: another thread's write just after they were read
    fails the check now, not after the next write (found by a red team)."""
    obj = _Holder()
    d = vars(obj)
    reads = _reads(True, owners=[("obj.__dict__", obj, d)])
    real = reads._identities

    def racing():
        items = real()
        obj.__dict__ = {"scale": 3.0}  # written just after the values were read
        return items

    reads._identities = racing
    reads._fast = None  # made anew at this call
    assert reads.differs()
    reads._identities = real
    obj.__dict__ = d
    assert not reads.differs() and not reads.differs()
    assert reads._fast is not None


@both
def test_a_cell_set_back_to_an_equal_plain_value_is_no_change(compiled):
    """A float computed anew, equal by type and value: the function computes as it did. Another type or
    value still stops replays."""
    was = 1.5
    cell = types.CellType(was)  # a closure's cell, as a function holding `was` would have
    reads = _reads(compiled, pins=[(cell, "cell_contents", was)])
    cell.cell_contents = 4.0
    assert reads.differs()
    cell.cell_contents = float("1.5")
    assert cell.cell_contents is not was
    assert not reads.differs() and not reads.differs()
    assert (reads._fast is not None) == compiled
    for other in (2, "1.5", 1.5000001):
        cell.cell_contents = other
        assert reads.differs(), other
