"""Red team of Paddle level 1's comparison by content of an object the forward makes at every call
(backends/paddle/sot_guards.py FrameArguments, _Content). Each object here gets its non-tensor contents
from a tensor's values inside a splitting op (eager between the pieces), so that nothing else the replay
checks sees the difference: a replay must run the captured frames only where those contents are the
captured ones, and equal eager on the padded call either way."""
import collections
import dataclasses

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from paddle_zoo.replay import Scaled  # noqa: E402
from paddle_zoo.replay_ops import PaddleF  # noqa: E402
from replay_support import HIDDEN, eager_padded, pair, warned  # noqa: E402

_CI_SECONDS = 8


def _positives(k):
    return int((k > 0).sum())


class _Holder:
    def __init__(self, k):
        self.k = k
        self.n = 0
        self.items = []
        self.flag = False


@graph_opt.splitting_op
def _count(q, holder):
    holder.n = _positives(holder.k)
    return q * 1.0


@graph_opt.splitting_op
def _append(q, holder):
    holder.items.extend([1.0] * _positives(holder.k))
    return q * 1.0


@graph_opt.splitting_op
def _flag(q, holder):
    holder.flag = _positives(holder.k) > 0
    return q * 1.0


class _IntAttribute(Scaled):
    def forward(self, x, k):
        holder = _Holder(k)
        return _count(self.lin(x), holder) * float(holder.n)


class _ListLength(Scaled):
    def forward(self, x, k):
        holder = _Holder(k)
        return _append(self.lin(x), holder) * float(len(holder.items) + 1)


class _FlagReadInABranch(Scaled):
    def forward(self, x, k):
        holder = _Holder(k)
        h = _flag(self.lin(x), holder)
        if holder.flag:
            h = h * 3.0
        return h + 1.0


_Pair = collections.namedtuple("_Pair", "h n")


@graph_opt.splitting_op
def _as_namedtuple(q, k):
    return _Pair(q * 1.0, _positives(k))


class _NamedTuple(Scaled):
    def forward(self, x, k):
        out = _as_namedtuple(self.lin(x), k)
        return out.h * float(out.n)


@dataclasses.dataclass
class _Plain:
    k: object
    n: int


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenSlots:
    k: object
    n: int


@dataclasses.dataclass(slots=True)
class _Slots:
    k: object
    n: int


@graph_opt.splitting_op
def _as_plain(q, k):
    return q * 1.0, _Plain(k * 2.0, _positives(k))


@graph_opt.splitting_op
def _as_frozen_slots(q, k):
    return q * 1.0, _FrozenSlots(k * 2.0, _positives(k))  # a new tensor in it at every call


@graph_opt.splitting_op
def _as_slots(q, k):
    return q * 1.0, _Slots(k * 2.0, _positives(k))


class _ReturnsPlain(Scaled):
    def forward(self, x, k):
        h, d = _as_plain(self.lin(x), k)
        return h * float(d.n) + d.k


class _ReturnsFrozenSlots(Scaled):
    def forward(self, x, k):
        h, d = _as_frozen_slots(self.lin(x), k)
        return h * float(d.n) + d.k


class _ReturnsSlots(Scaled):
    def forward(self, x, k):
        h, d = _as_slots(self.lin(x), k)
        return h * float(d.n) + d.k


class _NumelOfNonzero(Scaled):
    """`idx.numel() == 0` on a tensor whose shape follows the data: a branch on the values."""

    def forward(self, x, k):
        idx = paddle.nonzero(k.reshape([-1]) > 0)
        h = self.lin(x)
        if idx.numel() == 0:
            return h
        return h * 2.0


def _inputs(n, positives):
    """x, and k with `positives` entries > 0 and the other entries -1 (the count is what the objects hold)."""
    k = paddle.full([n, HIDDEN], -1.0)
    if positives:
        k[0, :positives] = 1.0
    return paddle.randn([n, HIDDEN]), k


def _run(cls, calls):
    """Capture cls at level 1 in pieces; each call (rows, positives) must equal eager on the padded call."""
    m, twin = pair(PaddleF(), cls, level=1, config={"full_cuda_graph": False})
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda n: _inputs(n, 0), progress=False)
        assert report.failed is None, report.failed
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for rows, positives in calls:
            x, k = _inputs(rows, positives)
            want = eager_padded(PaddleF(), twin, x, k, batch=(0, 1))
            assert np.array_equal(m(x, k).numpy(), want.numpy()), (rows, positives)
    return graph_opt.stats(m)


# calls: (rows, positives); the capture had 0 positives. A call whose contents differ falls back; so does a
# padded one (the forward reads a tensor's value: the padding rows could decide it). The calls of 4 rows and
# no positives replay.
_CALLS = [(4, 0), (4, 3), (4, 0), (3, 5), (4, 3), (3, 0)]
_SAME_CONTENTS = _CALLS.count((4, 0))


@pytest.mark.parametrize("cls", [_IntAttribute, _ListLength, _FlagReadInABranch, _NamedTuple, _ReturnsPlain],
                         ids=lambda c: c.__name__.strip("_"))
def test_an_object_whose_contents_change_never_replays_the_old_graph(cls):
    s = _run(cls, _CALLS)
    assert s.replays == _SAME_CONTENTS and s.disabled_reason is None, (s.replays, s.fallback_reasons)


def test_numel_of_a_tensor_whose_shape_follows_the_data_is_a_branch_on_values(logs):
    """Not taken for a shape-only read (pir_analysis.shape_only_outputs): padded calls run without graphs,
    and a call taking the other branch runs it (the frames after diverge from the capture's)."""
    s = _run(_NumelOfNonzero, _CALLS)
    assert s.fallback_reasons == {"outputs": 2} and s.disabled_reason is None, s.fallback_reasons
    assert warned(logs, "reads a tensor's value on the host")


@pytest.mark.parametrize("cls", [_ReturnsFrozenSlots, _ReturnsSlots], ids=["frozen-slots", "slots"])
def test_a_dataclass_with_slots_holding_a_new_tensor_is_compared_by_its_fields(cls):
    """No __dict__: it was compared by its own __eq__, which compares the tensors it holds by value (and
    raised: Paddle's `bool` of a many-element tensor), or by identity where unhashable. The first made every
    replay fail, and dropped the graphs for good ("replay of size 4 failed: AssertionError: When Variable is
    used as the condition of if/while"); the second never replayed."""
    s = _run(cls, _CALLS)
    assert s.replay_failures == 0 and s.disabled_reason is None, s.disabled_reason
    assert s.replays == _SAME_CONTENTS, s.fallback_reasons


def test_the_warning_names_the_object_inside_a_tuple_argument(logs):
    """A splitting op returning (tensor, object): the frame after it gets the tuple. The warning said the
    tuple was "computed otherwise ... from a model attribute, or by a branch on a tensor's value", showing
    only the tensor's repr; it names the object's type."""
    _run(_ReturnsPlain, [(4, 3)])
    assert warned(logs, "got another `", "a tuple holding a _Plain whose non-tensor contents"), \
        [r.getMessage() for r in logs.records]
    assert not warned(logs, "from a model attribute")


def test_slots_of_every_class_are_walked_and_private_names_found():
    from graph_opt.backends.paddle.sot_guards import _Content

    class Base:
        __slots__ = ("__hidden",)

        def __init__(self, hidden):
            self.__hidden = hidden

    class Child(Base):
        __slots__ = "extra"

    def key(obj):
        return _Content().key(obj)

    assert key(Child(1)) == key(Child(1)) and key(Child(1)) != key(Child(2))
    unset, set_ = Child(1), Child(1)
    set_.extra = 0
    assert key(unset) != key(set_)
    assert key(paddle.CPUPlace()) == key(paddle.CPUPlace())  # C types keep their own __eq__
