"""graph_opt/watch/dict_reads.py: pinned functions' __code__, classes' __mro__ and cells' contents are compared
through one gc.get_referents call (Reads._same_referents); any other difference in that list is looked at pin
by pin. Framework-free: Reads is plain Python."""

from graph_opt.watch.dict_reads import Reads


def _reads(*pins):
    return Reads([], [], [], [], pinned=[(f"pin {i}", obj, name, value) for i, (obj, name, value) in enumerate(pins)])


def _make(source: str, name: str):
    scope = {}
    exec(compile(source, "<test>", "exec"), scope)
    return scope[name]


def test_a_functions_code_swapped_is_a_change_until_put_back():
    fn = _make("def f(x):\n    return x + 1\n", "f")
    other = _make("def g(x):\n    return x - 1\n", "g")
    reads = _reads((fn, "__code__", fn.__code__))
    assert reads.ref_pins and not reads.differs()
    code = fn.__code__
    fn.__code__ = other.__code__
    assert reads.differs()
    assert reads.first_change()[0] == "pin 0"
    fn.__code__ = code
    assert not reads.differs()


def test_an_equal_code_object_is_no_change_and_a_different_one_is():
    """An equal code object (same source compiled again) runs as the one it replaces."""
    source = "def f(x):\n    return x * 2\n"
    fn = _make(source, "f")
    reads = _reads((fn, "__code__", fn.__code__))
    fn.__code__ = _make(source, "f").__code__
    assert not reads.differs()
    fn.__code__ = _make("def f(x):\n    return x * 3\n", "f").__code__
    assert reads.differs()


def test_a_functions_other_fields_changing_are_looked_at_pin_by_pin_and_taken_again():
    fn = _make("def f(x, y=1):\n    return x + y\n", "f")
    reads = _reads((fn, "__code__", fn.__code__))
    before = list(reads.ref_seen)
    fn.note = "a __dict__ made on first use"
    fn.__defaults__ = (2,)
    assert not reads.differs()
    assert reads.ref_seen != before  # taken again: the next compare is one list compare


class _EqualsAll:
    def __eq__(self, other):
        raise ValueError("ambiguous")  # an array's __eq__ would


def test_a_default_whose_eq_raises_is_no_error_and_no_change():
    fn = _make("def f(x, y=None):\n    return x\n", "f")
    fn.__defaults__ = (_EqualsAll(),)
    reads = _reads((fn, "__code__", fn.__code__))
    fn.__defaults__ = (_EqualsAll(),)
    assert not reads.differs()


def test_a_cell_holding_a_class_is_read_by_identity_and_its_rebinding_is_a_change():
    class A:
        pass

    class B:
        pass

    holder = A

    def reader():
        return holder

    cell = reader.__closure__[0]
    reads = _reads((cell, "cell_contents", A))
    assert not reads.ref_pins
    holder = B  # noqa: F841 - rebinds the cell
    assert reads.differs()
    holder = A  # noqa: F841
    assert not reads.differs()


def test_a_cell_holding_a_value_compared_by_equality_is_read_by_identity():
    """A list rebound to an equal list is another object: a cell of one is not batched (== would pass it)."""
    value = [1, 2]

    def reader():
        return value

    cell = reader.__closure__[0]
    reads = _reads((cell, "cell_contents", value))
    assert not reads.ref_pins
    value = [1, 2]  # noqa: F841
    assert reads.differs()


def test_a_classs_bases_changed_is_a_change_read_by_identity():
    class Base:
        pass

    class Other:
        pass

    class Child(Base):
        pass

    reads = _reads((Child, "__mro__", Child.__mro__))
    assert not reads.ref_pins and not reads.differs()
    Child.__bases__ = (Other,)
    assert reads.differs()
    Child.__bases__ = (Base,)
    assert not reads.differs()
    assert reads.first_change() is None  # the new __mro__ of the same classes is held everywhere


def test_a_built_in_class_is_not_batched():
    reads = _reads((dict, "__mro__", dict.__mro__))
    assert not reads.ref_pins and not reads.differs()
    assert reads.pin_objs == [dict]


def test_a_cell_rebound_to_an_object_equal_to_anything_is_a_change():
    """unittest.mock.ANY == anything: a list compare of cells' contents would pass it."""
    from unittest import mock

    class A:
        pass

    holder = A

    def reader():
        return holder

    reads = _reads((reader.__closure__[0], "cell_contents", A))
    holder = mock.ANY  # noqa: F841
    assert reads.differs()


def test_an_object_given_a_class_whose_metaclass_says_equal_to_anything_is_a_change():
    class Loose(type):
        def __eq__(cls, other):
            return True

        __hash__ = type.__hash__

    class A:
        pass

    class B(metaclass=Loose):
        pass

    obj = A()
    reads = Reads([], [], [], [], classes=[("obj.__class__", obj, A)])
    assert not reads.differs()
    obj.__class__ = B
    assert reads.differs()
