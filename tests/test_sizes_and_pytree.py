"""Capture sizes, the padding table and the argument flattening the dispatch key is built from."""
import dataclasses
from collections import namedtuple

import pytest

from graph_opt.pytree import TENSOR, flatten, objects_holding_tensors, shallow_copier, tensor_leaf_owners, unflatten
from graph_opt.replay.sizes import PaddingTable, default_capture_sizes


def test_default_sizes_are_dense_then_coarse_and_include_the_max():
    sizes = default_capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert default_capture_sizes(512)[35:38] == [272, 288, 304]
    assert default_capture_sizes(100)[-2:] == [96, 100]
    assert default_capture_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [3, 7, 100], default_capture_sizes(256)])
def test_padding_table_gives_the_smallest_captured_size_at_least_real(sizes):
    table = PaddingTable(sizes)
    for real in range(1, max(sizes) + 1):
        expected = min(s for s in sizes if s >= real)
        assert table.padded_size(real) == expected
    assert table.padded_size(max(sizes) + 1) == 0
    assert table.padded_size(10 ** 6) == 0


class T:
    """A stand-in tensor."""

    def __init__(self, n):
        self.n = n


def is_t(x):
    return isinstance(x, T)


@dataclasses.dataclass
class Meta:
    ids: object
    lens: object
    mode: str


Pair = namedtuple("Pair", "a b")


def test_flatten_nested_structures_round_trip():
    a, b, c, d = T(1), T(2), T(3), T(4)
    obj = ((a, [b, {"k": c, "s": "decode"}], Pair(d, 3), Meta(a, b, "x"), None), {"flag": True})
    leaves, spec = flatten(obj, is_t)
    assert leaves == [a, b, c, d, a, b]
    rebuilt = unflatten(spec, leaves, template=obj)
    assert rebuilt[0][1][1] == {"k": c, "s": "decode"}
    assert rebuilt[0][2] == Pair(d, 3)
    assert rebuilt[0][3] == Meta(a, b, "x") and rebuilt[0][3] is not obj[0][3]
    assert rebuilt[1] == {"flag": True}


def test_spec_holds_non_tensor_values_so_they_key_the_dispatch():
    _, s1 = flatten(((T(1), "decode", 2), {}), is_t)
    _, s2 = flatten(((T(9), "decode", 2), {}), is_t)
    _, s3 = flatten(((T(1), "prefill", 2), {}), is_t)
    assert s1 == s2 and hash(s1) == hash(s2)
    assert s1 != s3


def test_unhashable_non_tensor_values_match_only_by_identity():
    cfg = {"a": [1, 2]}
    obj = object.__new__(type("Opaque", (), {"__hash__": None}))
    _, s1 = flatten(((T(1), obj), {}), is_t)
    _, s2 = flatten(((T(1), obj), {}), is_t)
    _, s3 = flatten(((T(1), object.__new__(type(obj))), {}), is_t)
    assert s1 == s2 and s1 != s3
    _, s4 = flatten(((cfg,), {}), is_t)  # a dict is a node, not a leaf: its values are constants
    assert s4[1][0][1][0][0] == "d"


def test_leaf_owners_map_tensors_to_top_level_arguments():
    a, b, c = T(1), T(2), T(3)
    leaves, spec = flatten(((a, [b, 5]), {"meta": {"x": c}}), is_t)
    assert tensor_leaf_owners(spec) == [0, 1, "meta"]
    assert spec[1][0][1][0] is TENSOR


@dataclasses.dataclass(slots=True)
class _Slotted:
    y: object
    extras: list


def test_shallow_copies_give_each_call_its_own_containers_and_share_the_leaves():
    import collections

    t = T(1)
    outputs = {"d": {"y": t, "parts": [t]}, "slotted": _Slotted(t, [t]), "nt": Pair(t, [t]),
               "dd": collections.defaultdict(list, y=t), "od": collections.OrderedDict(y=t)}
    copy = shallow_copier(outputs)
    mine = copy()
    mine["d"]["parts"].append(1)
    mine["slotted"].extras.append(1)
    mine["nt"].b.append(1)
    mine["dd"]["new"].append(1)
    del mine["od"]["y"]
    theirs = copy()
    assert theirs["d"]["parts"] == [t] and theirs["slotted"].extras == [t] and theirs["nt"].b == [t]
    assert list(theirs["dd"]) == ["y"] and theirs["dd"].default_factory is list and list(theirs["od"]) == ["y"]
    assert theirs["d"]["y"] is t and theirs["slotted"].y is t and theirs is not outputs
    assert shallow_copier(t) is None and shallow_copier((t, (t,))) is None


def test_objects_holding_tensors_are_found_in_attributes_slots_and_their_containers():
    class Holder:
        def __init__(self, value):
            self.value = value

    class Slots:
        __slots__ = ("value",)

        def __init__(self, value):
            self.value = value

    t = T(1)
    found = objects_holding_tensors({"a": Holder([t]), "b": Slots(t), "c": Holder("text"), "d": 3},
                                    is_t)
    assert found == ["output['a'] (a Holder object)", "output['b'] (a Slots object)"]
