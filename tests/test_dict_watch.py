"""graph_opt/watch/dict_watch.py: one compare for "was any of these dicts written", from Python 3.12.

Before 3.12 the interpreter offers no watcher and watch() must say so (None), so that its callers compare
versions instead. From 3.12 every kind of write is seen, a set of the same object is not a write, and
the interpreter exits cleanly with dicts still watched (a watcher left set crashes it at shutdown)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graph_opt.watch import dict_watch

ROOT = Path(__file__).resolve().parents[1]
WATCHES = sys.version_info >= (3, 12) and sys.implementation.name == "cpython"
needs_watcher = pytest.mark.skipif(not WATCHES, reason="dict watchers are CPython 3.12+; the GPU hosts run 3.12")


def test_no_watcher_before_3_12_means_none():
    if WATCHES:
        assert dict_watch.can_watch()
        assert dict_watch.watch([{}]) is not None
    else:
        assert not dict_watch.can_watch()
        assert dict_watch.watch([{}]) is None


class Holder:
    pass


@needs_watcher
@pytest.mark.parametrize("write", [
    lambda d, h: d.__setitem__("a", object()),  # a value replaced
    lambda d, h: d.__setitem__("new", 1),
    lambda d, h: d.__delitem__("a"),
    lambda d, h: d.clear(),
    lambda d, h: d.update(b=2),
    lambda d, h: d.pop("a"),
    lambda d, h: setattr(h, "x", 2),  # an instance's __dict__
    lambda d, h: setattr(Holder, "y", 3),  # a class's dict, behind its mappingproxy
])
def test_every_write_moves(write):
    d = {"a": object()}
    h = Holder()
    h.x = 1
    class_dict = [r for r in __import__("gc").get_referents(vars(Holder)) if isinstance(r, dict)][0]
    moved = dict_watch.watch([d, vars(h), class_dict])
    assert not moved()
    try:
        write(d, h)
        assert moved()
    finally:
        if hasattr(Holder, "y"):
            del Holder.y


@needs_watcher
def test_same_object_set_and_reads_do_not_move():
    value = object()
    d = {"a": value, "b": 1}
    moved = dict_watch.watch([d])
    d["a"] = value
    d.get("b"), list(d), "a" in d, d.copy()
    assert not moved()
    other = {"c": 1}
    other["c"] = 2  # an unwatched dict
    assert not moved()


@needs_watcher
def test_a_dict_freed_moves():
    d = {"a": 1}
    moved = dict_watch.watch([d])
    del d  # the watch holds no reference: an object's __dict__ replaced frees the old one
    assert moved()


@needs_watcher
def test_interpreter_exits_cleanly_with_dicts_watched():
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from graph_opt.watch import dict_watch
        keep = [{"k": i} for i in range(100)]
        class C: pass
        moved = dict_watch.watch(keep + [vars(C())])
        keep[0]["k"] = 5
        print("moved", moved())
    """ % str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "moved True"
