"""Inference replays never silently wrong, on Paddle: tests/replay_safety_kit.py with simulated graphs.
(Autocast and inference_mode are torch's; Paddle's CPU build runs auto_cast regions in float32.)"""
import collections
import dataclasses
import pickle
import types
from typing import Any

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from replay_safety_kit import *  # noqa: E402,F401,F403  the shared tests, collected here
from replay_safety_kit import HIDDEN, eager_padded, pair, warned  # noqa: E402

_CI_SECONDS = 5  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

GLOBAL_SCALE = 1.0  # read by ScaledByGlobal.forward


class Scaled(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.temperature = 1.0

    def forward(self, x):
        return self.lin(x) / self.temperature


class ScaledByGlobal(Scaled):
    def forward(self, x):
        return self.lin(x) * GLOBAL_SCALE


def _closure_model():
    scale = 1  # an int: Dynamo traces a float closure variable as a symbolic float, which Inductor's CUDA
    # code generation of torch 2.11 failed on ("zf69 is not defined"; the capture fell back, one warning)

    class ScaledByClosure(Scaled):
        def forward(self, x):
            return super().forward(x) * scale  # super() puts __class__ in the closure too

    def set_scale(value):
        nonlocal scale
        scale = value

    return ScaledByClosure, set_scale


ScaledByClosure, _set_closure_scale = _closure_model()


class OptionalBias(Scaled):
    def __init__(self):
        super().__init__()
        self.extra = None

    def forward(self, x):
        y = self.lin(x)
        if self.extra is not None:
            y = y + self.extra
        return y


class Mode(paddle.nn.Layer):
    def forward(self, x):
        return x * 2.0 if self.training else x - 1.0


class ModeSwitch(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.inner = Mode()

    def forward(self, x):
        return self.inner(self.lin(x))


class BatchInDim1(paddle.nn.Layer):
    """x is [6, batch]: the batch is dim 1 of the input and of output y; w has no batch dim."""

    def __init__(self):
        super().__init__()
        self.scale = self.create_parameter([6, 1], default_initializer=paddle.nn.initializer.Constant(0.75))
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return {"y": paddle.tanh(x) * self.scale, "w": self.lin.weight * 2.0}


class CountsRows(Scaled):
    def forward(self, x):
        return {"y": self.lin(x), "n_rows": x.shape[0]}


class Scales(Scaled):
    def forward(self, x, scale, shift):
        return {"scaled": x.argmax(-1) * scale, "inverse": 1.0 / ((x.abs() + 1.0) * shift)}


class WritesInput(Scaled):
    def forward(self, x):
        x.add_(paddle.ones_like(x))
        return self.lin(x)


class KVCache(paddle.nn.Layer):
    """A KV-cache-style write at the rows' positions, then a read of them."""

    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cache", paddle.zeros([16, HIDDEN]))

    def forward(self, x, pos):
        self.cache.scatter_(pos, self.lin(x))
        return paddle.index_select(self.cache, pos) * 2.0


class BatchMean(Scaled):
    def forward(self, x):
        return self.lin(x - x.mean(0, keepdim=True))


class BranchOnBatch(Scaled):
    def forward(self, x):
        y = self.lin(x)
        if x.shape[0] > 5:
            y = y * 2.0
        return y


class Positions(Scaled):
    def forward(self, x):
        return {"y": self.lin(x), "pos": paddle.arange(4).expand([x.shape[0], 4])}


class Square(Scaled):
    def forward(self, x):
        return self.lin(x) + x.sum(0)


class HostShapes(Scaled):
    """Outputs read on the host: 8 values whatever the batch, and one with the batch in dim 1."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", paddle.arange(8, dtype="float32"))

    def forward(self, x):
        return {"y": self.lin(x), "fixed": self.table * 2.0, "by_column": paddle.tanh(x).t()[:6]}


class WritesFirst(Scaled):
    def forward(self, a, b):
        a.scale_(2.0)
        return self.lin(b)


@dataclasses.dataclass
class Batch:
    x: Any

    def __post_init__(self):
        self.scale = self.x.abs().max() + 1.0  # not a field: computed from the rows the caller made


@dataclasses.dataclass
class Out(collections.OrderedDict):
    """A Hugging Face ModelOutput in small: a dataclass and an OrderedDict of its non-None fields."""

    y: Any = None
    z: Any = None

    def __post_init__(self):
        for key in ("y", "z"):
            if getattr(self, key) is not None:
                self[key] = getattr(self, key)

    def to_tuple(self):
        return tuple(self[key] for key in self.keys())


class TakesContainers(Scaled):
    def forward(self, batch, extra):
        return Out(y=self.lin(batch.x / batch.scale) + extra["b"], z=paddle.tanh(extra["b"]))


class State:
    """A user's state object passed to forward (as a KV cache object would be)."""

    def __init__(self, bias):
        self.bias = bias


class TakesState(Scaled):
    def forward(self, x, state):
        return self.lin(x) + state.bias


class AdvancesState(Scaled):
    def forward(self, x, state):
        state.bias = state.bias + self.lin(x)  # a cache object the forward advances
        return state.bias * 2.0


class AddsInPlace(Scaled):
    def forward(self, x):
        y = self.lin(x)
        y.add_(paddle.ones_like(y))  # in place on an intermediate tensor: SOT drops it (Paddle 3.3.1)
        return y * 2.0


class WritesUntracked(Scaled):
    def forward(self, x):
        x.copy_(x * 2.0 + 1.0, False)  # copy_ (and set_value) do not move the inplace version
        return self.lin(x)


class CountsSmallBatches(Scaled):
    """Writes a buffer only for batches of fewer than 4 rows: a size-4 graph never writes it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("small_batches", paddle.zeros([1]))

    def forward(self, x):
        if x.shape[0] < 4:
            self.small_batches.set_value(self.small_batches + 1)
        return self.lin(x)


class InstallsHook(Scaled):
    """Registers a hook on a submodule at its first call, as transformers installs its output capturing."""

    def forward(self, x):
        if not getattr(self, "hooked", False):
            self.lin.register_forward_post_hook(lambda module, inputs, output: output * 2.0)
            self.hooked = True
        return self.lin(x)


class ReturnsContainers(Scaled):
    def forward(self, x):
        y = self.lin(x)
        return {"y": y, "parts": [y * 2.0]}


class Result:
    """A user's result object (not a dataclass): graph_opt cannot rebuild it."""

    def __init__(self, y):
        self.y = y


class ReturnsObject(Scaled):
    def forward(self, x):
        return Result(self.lin(x))


class CountsSteps(Scaled):
    """A step counter the forward advances and reads (as a decoder's position buffer), through set_value:
    its inplace version does not move."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", paddle.zeros([1]))

    def forward(self, x):
        self.steps.set_value(self.steps + 1)
        return self.lin(x) + self.steps


class TalliesRows(Scaled):
    """Counts the rows it has seen: padding rows would count too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rows_seen", paddle.zeros([1]))

    def forward(self, x):
        self.rows_seen.set_value(self.rows_seen + x.shape[0])
        return self.lin(x)


class ArgCache(Scaled):
    """Accumulates into a cache passed as an argument, at the rows' slots (not idempotent: a second run
    of the same call would add twice), then reads those slots."""

    def forward(self, x, cache, slots):
        paddle.index_add_(cache, slots, 0, self.lin(x))
        return paddle.index_select(cache, slots) * 2.0


class ReadsTable(Scaled):
    def forward(self, x, table):
        return self.lin(x) * table


@graph_opt.support_graph_optimization
class Picklable(Scaled):
    """Defined at module level: pickling needs the class importable."""


class MeanLoss(Scaled):
    """Returns a 0-d statistic over the batch beside the rows: a loss."""

    def forward(self, x):
        y = self.lin(x)
        return y, (y * y).mean()


class Embeds(Scaled):
    """Token ids in: a dummy batch of them is all zeros, as the padding rows are."""

    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(32, HIDDEN)

    def forward(self, ids):
        return self.lin(self.emb(ids))


class EmbedsBatchMean(Embeds):
    def forward(self, ids):
        h = self.emb(ids)
        return self.lin(h - h.mean(0, keepdim=True))


class PairsRows(Scaled):
    """Runs only an even number of rows, as eager does."""

    def forward(self, x):
        return self.lin(x.reshape([-1, 2, HIDDEN])).reshape(x.shape)


class HoldsDecorated(Scaled):
    """Holds a model decorated on its own (or, for the eager twin, the inner model given)."""

    def __init__(self, inner=None):
        super().__init__()
        self.inner = inner if inner is not None else _DecoratedInner(
            graph_opt_config=graph_opt.GraphOptConfig(cudagraph_capture_sizes=[2, 4, 8]))

    def forward(self, x):
        return self.lin(self.inner(x))


_DecoratedInner = graph_opt.support_graph_optimization(type("DecoratedInner", (Scaled,), {}))


class CountsInObject(Scaled):
    """A step counter held in a plain object (as a cache object holds its tensors), not a buffer."""

    def __init__(self):
        super().__init__()
        self.state = types.SimpleNamespace(steps=paddle.zeros([1]))

    def forward(self, x):
        self.state.steps.set_value(self.state.steps + 1)
        return self.lin(x) + self.state.steps


class HoldsLargeBuffer(Scaled):
    """More state than a capture at a call copies aside (capture_checks.STATE_BYTES)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", paddle.zeros([17 << 20]))

    def forward(self, x):
        self.table[-1:] = self.table[-1:] + 1  # a step count at its end
        return self.lin(x) + self.table[:HIDDEN] + self.table[-1]


class ReadsLargeBuffer(HoldsLargeBuffer):
    """The same large state, read only (a rope table)."""

    def forward(self, x):
        return self.lin(x) + self.table[:HIDDEN]


class Steps(Scaled):
    """A step of a two-state recurrence (Verlet): the new state and the old one, which the caller passes
    back as the next step's second argument."""

    def forward(self, x, x_prev):
        return 2.0 * x - x_prev + 0.01 * self.lin(x), x


class PassesThrough(Scaled):
    def forward(self, x):
        return x, self.lin(x)


class AddsIntoAndReturns(Scaled):
    """An in-place residual: the state written and returned, called as `h = m(h, y)`."""

    def forward(self, h, y):
        h.add_(self.lin(y))
        return h


class WritesAndPasses(Scaled):
    def forward(self, x, y, z):
        x.add_(paddle.ones_like(x))
        return self.lin(x) + y, z


class CountsCalls(Scaled):
    """A Python counter the forward advances and computes with: a replay would do neither."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * float(self.calls)


class LogsCalls(Scaled):
    """Appends to a Python list at every call (a log the output does not use)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return self.lin(x)


class KeepsRows(KeepsRowsMixin, Scaled):
    pass


class CountsInPlace(CountsInPlaceMixin, Scaled):
    pass


class ReadyOnce(Scaled):
    """Sets a Python flag at its first call only: a replay need not set it again."""

    def __init__(self):
        super().__init__()
        self.ready = False

    def forward(self, x):
        if not self.ready:
            self.ready = True
        return self.lin(x)


class RowState(Scaled):
    """A recurrent state per batch row, a buffer [max batch, H] updated in place by row position (an RNN's or
    Mamba's decode state): padding rows would write the rows past the call's own, which a larger call reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("h", paddle.zeros([8, HIDDEN]))

    def forward(self, x):
        n = x.shape[0]
        h = paddle.tanh(self.h[:n] * 0.5 + self.lin(x))
        self.h[:n] = h
        return h * 2.0


class ArgRowState(Scaled):
    """RowState's state passed as a marked argument [max batch, H]."""

    def forward(self, x, state):
        n = x.shape[0]
        h = paddle.tanh(state[:n] * 0.5 + self.lin(x))
        state[:n] = h
        return h * 2.0


class PenaltyCounts(Embeds):
    """A repetition penalty: a count per token id, advanced by every row's id (padding rows hold id 0)."""

    def __init__(self):
        super().__init__()
        self.head = paddle.nn.Linear(HIDDEN, 32)
        self.register_buffer("counts", paddle.zeros([32]))

    def forward(self, ids):
        logits = self.head(self.lin(self.emb(ids))) - self.counts
        paddle.index_add_(self.counts, ids, 0, paddle.ones([ids.shape[0]]))
        return logits


class CallsTwice(paddle.nn.Layer):
    """Calls a block (a decorated model, captured on its own) twice in one forward, and uses both outputs."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, y):
        a = self.block(x)
        b = self.block(y)
        return a * 2.0 - b


class BranchOnValue(Scaled):
    """A Python branch on a tensor value at the end of forward, with no program after it."""

    def forward(self, x):
        h = self.lin(x)
        if x.min() > 0:
            h = h * 2.0
        return h


class LoopOnValue(Scaled):
    """A Python loop on a tensor value at the end of forward: its number of turns depends on the values."""

    def forward(self, x):
        h = self.lin(x) * 3.0
        while h.abs().max() > 1:
            h = h * 0.5
        return h


class DecayRowState(Scaled):
    """A state per row that decays and adds an input term, zero at the start (an SSM's decode state):
    padding rows of zeros leave a zero state as it was, and decay any other."""

    def __init__(self):
        super().__init__()
        self.register_buffer("h", paddle.zeros([8, HIDDEN]))

    def forward(self, x):
        n = x.shape[0]
        self.h[:n] = self.h[:n] * 0.9 + self.lin(x) * x
        return self.h[:n] * 2.0


class RowAverage(Scaled):
    """A running average per row that the caller reads (m.avg); the output does not read it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", paddle.zeros([8, HIDDEN]))

    def forward(self, x):
        n = x.shape[0]
        self.avg[:n] = self.avg[:n] * 0.9 + x * 0.1
        return self.lin(x)


class LastRows(Scaled):
    """The last hidden row of each slot, kept for the caller (m.last) and never read by the forward: a
    later call overwrites its rows, so only the caller sees what padding rows wrote there meanwhile."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", paddle.zeros([8, HIDDEN]))

    def forward(self, x):
        n = x.shape[0]
        y = self.lin(x)
        self.last[:n] = y
        return y * 2.0


class ArgLastRows(Scaled):
    """LastRows' rows passed as an argument the forward writes, not marked: copied back whole."""

    def forward(self, x, last):
        n = x.shape[0]
        y = self.lin(x)
        last[:n] = y
        return y * 2.0


class SlotCache(Scaled):
    """A cache of 16 slots written at each row's slot (a KV cache and its slot mapping); padding rows hold
    slot 0 unless pad_values reserves another."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", paddle.zeros([16, HIDDEN]))

    def forward(self, x, slots):
        self.cache.scatter_(slots, self.lin(x))
        return paddle.index_select(self.cache, slots) * 2.0


class PenaltyAtIds(Embeds):
    """Counts per token id, read only at the call's own ids (a frequency penalty)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counts", paddle.zeros([32]))

    def forward(self, ids):
        out = self.lin(self.emb(ids)) - paddle.gather(self.counts, ids).unsqueeze(-1)
        paddle.index_add_(self.counts, ids, 0, paddle.ones([ids.shape[0]]))
        return out


class ReturnsTwice(Scaled):
    """The same tensor as two outputs."""

    def forward(self, x):
        y = self.lin(x)
        return y, y


class ReturnsRowsOfMarked(Scaled):
    """Writes its rows of a marked argument and returns them: eager's output is a view of that argument."""

    def forward(self, x, cache):
        n = x.shape[0]
        cache[:n] = self.lin(x)
        return cache[:n]


class _Head(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return x * self.scale


class ScaledHead(paddle.nn.Layer):
    """A plain attribute of a submodule the forward reads (a dropout's p, a head's scale)."""

    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.head = _Head()

    def forward(self, x):
        return self.head(self.lin(x))


MODELS = types.SimpleNamespace(ScaledHead=ScaledHead, ReturnsTwice=ReturnsTwice, ReturnsRowsOfMarked=ReturnsRowsOfMarked, DecayRowState=DecayRowState, RowAverage=RowAverage, LastRows=LastRows, ArgLastRows=ArgLastRows, SlotCache=SlotCache, PenaltyAtIds=PenaltyAtIds, BranchOnValue=BranchOnValue, LoopOnValue=LoopOnValue, CallsTwice=CallsTwice, RowState=RowState, ArgRowState=ArgRowState, PenaltyCounts=PenaltyCounts, Scaled=Scaled, KeepsRows=KeepsRows, CountsCalls=CountsCalls, CountsInPlace=CountsInPlace, LogsCalls=LogsCalls, ReadyOnce=ReadyOnce, ScaledByGlobal=ScaledByGlobal, OptionalBias=OptionalBias,
                               ModeSwitch=ModeSwitch, BatchInDim1=BatchInDim1, CountsRows=CountsRows, Scales=Scales,
                               WritesInput=WritesInput, KVCache=KVCache, BatchMean=BatchMean, Positions=Positions,
                               Square=Square, HostShapes=HostShapes,
                               BranchOnBatch=BranchOnBatch, WritesFirst=WritesFirst,
                               TakesContainers=TakesContainers, TakesState=TakesState,
                               ArgCache=ArgCache, ReadsTable=ReadsTable, AdvancesState=AdvancesState,
                               WritesUntracked=WritesUntracked, AddsInPlace=AddsInPlace,
                               CountsSteps=CountsSteps, TalliesRows=TalliesRows,
                               ScaledByClosure=ScaledByClosure, ReturnsContainers=ReturnsContainers,
                               ReturnsObject=ReturnsObject, InstallsHook=InstallsHook,
                               CountsSmallBatches=CountsSmallBatches,
                               MeanLoss=MeanLoss, Embeds=Embeds, EmbedsBatchMean=EmbedsBatchMean,
                               PairsRows=PairsRows, HoldsDecorated=HoldsDecorated,
                               CountsInObject=CountsInObject, HoldsLargeBuffer=HoldsLargeBuffer,
                               ReadsLargeBuffer=ReadsLargeBuffer,
                               AdvancesInPlace=CountsSteps,  # set_value: in place, no assignment
                               Steps=Steps, PassesThrough=PassesThrough, WritesAndPasses=WritesAndPasses,
                               AddsIntoAndReturns=AddsIntoAndReturns)


class PaddleF:
    static_writes_inputs = False  # SOT: "Paddle static graph(PIR) not support input out tensor for now"
    static_makes_python_stores = False  # its replays run SOT's programs alone

    @staticmethod
    def graphs():
        return graph_opt.testing.simulate_cuda_graphs()  # no Paddle GPU build runs here

    @staticmethod
    def place(model):
        return model

    @staticmethod
    def models():
        return MODELS

    @staticmethod
    def seed(n):
        paddle.seed(n)

    @staticmethod
    def copy_weights(dst, src):
        dst.set_state_dict(src.state_dict())

    @staticmethod
    def randn(*shape, seed=0):
        import numpy as np

        return paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype("float32"))

    @staticmethod
    def arange(n, start=0):
        return paddle.arange(start, start + n, dtype="int64")

    @staticmethod
    def ids(values):
        return paddle.to_tensor(values, dtype="int64")

    @staticmethod
    def parameter(shape, value):
        return paddle.create_parameter(shape, "float32", default_initializer=paddle.nn.initializer.Constant(value))

    @staticmethod
    def no_grad():
        return paddle.no_grad()

    @staticmethod
    def equal(a, b):
        return list(a.shape) == list(b.shape) and a.dtype == b.dtype and bool((a.numpy() == b.numpy()).all())

    @staticmethod
    def close(a, b):
        import numpy as np

        return list(a.shape) == list(b.shape) and a.dtype == b.dtype and np.allclose(a.numpy(), b.numpy(), 1e-5, 1e-5)

    inductor_drops_the_sign_of_zero = False

    @staticmethod
    def same_with_nan(a, b, exact=True):
        import numpy as np

        return list(a.shape) == list(b.shape) and np.allclose(a.numpy(), b.numpy(), rtol=0 if exact else 1e-5,
                                                              atol=0, equal_nan=True)

    @staticmethod
    def shape(t):
        return list(t.shape)

    @staticmethod
    def dtype_name(t):
        return str(t.dtype).replace("paddle.", "")

    @staticmethod
    def clone(t):
        return t.clone()

    @staticmethod
    def scale(t, k):
        return t * k

    @staticmethod
    def pre_hook(model, fn):
        model.register_forward_pre_hook(lambda layer, args: fn(args))

    @staticmethod
    def post_hook(model, fn):
        return model.register_forward_post_hook(lambda layer, args, out: fn(out))

    @staticmethod
    def zero_buffer(t):
        t.zero_()

    @staticmethod
    def rows(t, start, stop):
        return t[start:stop]

    @staticmethod
    def pad_rows(t, size, value=0):
        """t with rows of `value` appended up to `size` rows, as a padded call's static buffer holds it."""
        return paddle.concat([t, paddle.full([size - t.shape[0], *t.shape[1:]], value, dtype=t.dtype)])

    def containers(self, n, seed=0):
        return Batch(self.randn(n, HIDDEN, seed=seed)), collections.OrderedDict(b=self.randn(n, HIDDEN, seed=seed + 7))

    @staticmethod
    def state_object():
        return State(paddle.zeros([HIDDEN]))

    @staticmethod
    def full_like_row(x, value):
        return paddle.full(x.shape[1:], value)

    @staticmethod
    def replace_weight(module, value):
        module.weight = paddle.create_parameter(module.weight.shape, "float32",
                                                default_initializer=paddle.nn.initializer.Constant(value))

    @staticmethod
    def to_double(x):
        return x.to(dtype="float64") if isinstance(x, paddle.nn.Layer) else x.astype("float64")

    @staticmethod
    def parameters(m):
        return list(m.parameters())

    @staticmethod
    def freeze(p):
        p.stop_gradient = True

    @staticmethod
    def numpy(t):
        return t.numpy()

    @staticmethod
    def tolist(t):
        return t.numpy().tolist()

    @staticmethod
    def transpose(t):
        return t.transpose([1, 0])

    @staticmethod
    def set_global_scale(value):
        global GLOBAL_SCALE
        GLOBAL_SCALE = value

    @staticmethod
    def set_closure_scale(value):
        _set_closure_scale(value)

    @staticmethod
    def picklable_model(level):
        paddle.seed(0)
        return Picklable(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level,
                                                                   cudagraph_capture_sizes=[2, 4, 8]))

    @staticmethod
    def save_load(m):
        return pickle.loads(pickle.dumps(m))


@pytest.fixture
def F():
    return PaddleF()


@pytest.fixture(params=[0, 1], ids=lambda v: f"level{v}")
def level(request):
    return request.param


@pytest.fixture(params=[True, False], ids=["graphs", "no-graphs"])
def graphs(request):
    return request.param


def test_a_decorated_submodule_fails_the_capture_clearly(F, M, logs):
    check_a_decorated_submodule_fails_the_capture_clearly(F, M, 1, logs)


class _CacheWrittenThroughAView(paddle.nn.Layer):
    """A decode step whose cache is a buffer, written through a slice: no version counter moves."""

    def __init__(self):
        super().__init__()
        self.kv = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.out = paddle.nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("cache", paddle.zeros([8, 4, HIDDEN]))

    def forward(self, x, pos):
        b = x.shape[0]
        onehot = paddle.nn.functional.one_hot(pos, 4).unsqueeze(-1)
        self.cache[:b].set_value(self.cache[:b] * (1 - onehot) + onehot * self.kv(x).unsqueeze(1))
        return self.out(self.cache[:b].sum(1))


def test_a_buffer_written_through_a_view_is_written_by_every_call_or_the_capture_says_why(F, level, logs):
    """Level 0 records the write; SOT's programs drop it (level 1), and the capture finds that by the
    buffer's values and leaves the model to eager calls, with one warning naming the buffer. The cache is
    one row per sequence (`cache[:b]`): at level 0 a padded call's padding rows would write the rows of
    sequences past the call's own, which a larger call reads, so padded calls run without graphs."""
    m, twin = pair(F, _CacheWrittenThroughAView, level)
    with F.graphs():
        report = graph_opt.capture_model(
            m, lambda n: (F.randn(n, HIDDEN, seed=n), paddle.full([n], n % 4, "int64")), progress=False)
        assert (report.failed is None) == (level == 0), report.failed
        for model in (m, twin):
            model.cache.set_value(paddle.zeros([8, 4, HIDDEN]))
        with paddle.no_grad():
            for step in range(4):
                x, pos = F.randn(3, HIDDEN, seed=10 + step), paddle.full([3], step, "int64")
                assert F.equal(m(x, pos), twin(x, pos)), f"step {step}"
                assert F.equal(m.cache, twin.cache), f"step {step}: the cache"
    assert graph_opt.stats(m).replays == 0
    assert warned(logs, "buffer 'cache'", "padding rows write" if level == 0 else "")


class _DefaultDtype(Scaled):
    def forward(self, x):
        return self.lin(x) + paddle.zeros([HIDDEN]) + 0.1  # follows Paddle's default dtype


def test_the_default_dtype_is_part_of_what_a_replay_must_match(F, level, logs):
    """paddle.set_default_dtype after capture: the graphs made float32 zeros; the call answers as eager
    (at level 1 too: SOT's translation, as graph_opt runs it, would keep the float32 program)."""
    m, twin = pair(F, _DefaultDtype, level)
    with F.graphs():
        graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    x = F.randn(3, HIDDEN, seed=1)
    paddle.set_default_dtype("float64")
    try:
        with F.graphs(), paddle.no_grad():
            out, ref = m(x), twin(x)
    finally:
        paddle.set_default_dtype("float32")
    assert out.dtype == ref.dtype == paddle.float64 and F.equal(out, ref)
    assert graph_opt.stats(m).fallback_reasons == {"ambient": 1}
    assert warned(logs, "under no auto_cast and paddle.set_default_dtype('float64'); the graphs were captured under "
                        "no auto_cast and paddle.set_default_dtype('float32')")
    with F.graphs(), paddle.no_grad():
        assert F.equal(m(x), eager_padded(F, twin, x)) and graph_opt.stats(m).replays == 1


class _Recurrent(paddle.nn.Layer):
    """Paddle's RNN layers hold a buffer without memory (`_dropout_state`): data_ptr() of it raises."""

    def __init__(self):
        super().__init__()
        self.rnn = paddle.nn.LSTM(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.rnn(x)[0]


def test_a_recurrent_layer_with_a_buffer_without_memory_is_captured(F, level):
    m, twin = pair(F, _Recurrent, level)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, 5, HIDDEN, seed=n), progress=False)
    assert report.failed is None, report.failed
    with F.graphs(), paddle.no_grad():
        for real in (4, 2, 8):
            x = F.randn(real, 5, HIDDEN, seed=real)
            assert F.equal(m(x), twin(x)), f"{real} rows"
    assert graph_opt.stats(m).replays == 3


class _CountsInt(Scaled):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_python_state_the_forward_sets_fails_a_level_1_capture_naming_it(F, logs):
    """SOT's translated code does not make the store as a replay needs: the level-1 capture is refused
    for what it is (it used to fail its check, blaming the numbers)."""
    m, twin = pair(F, _CountsInt, 1)
    with F.graphs():
        report = graph_opt.capture_model(m, lambda n: F.randn(n, HIDDEN, seed=n), progress=False)
    assert report.failed is not None
    assert warned(logs, "sets Python state as it runs", "'calls'")
    twin.calls = m.calls
    with F.graphs(), paddle.no_grad():
        x = F.randn(3, HIDDEN, seed=1)
        assert F.equal(m(x), twin(x)) and m.calls == twin.calls


# -- level 1: paths the capture did not take (SOT runs the frames it did not record as plain Python) -------
class _BranchingSub(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.lin(x)
        if x.min() > 0:
            h = h * 2.0
        return h


class _SharesABranchingSub(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.sub = _BranchingSub()

    def forward(self, x):
        return self.sub(x) + 1.0


def _level1(cls, **options):
    return pair(PaddleF(), cls, level=1, **options)


def _positive(n, seed):
    x = paddle.randn([n, HIDDEN])
    return x * x + 0.1


def test_a_second_model_running_a_branch_sot_translated_for_the_first_keeps_padded_calls_eager(logs):
    """SOT translates a sublayer's frame once and every model running that code reuses it: the second
    model's capture translates nothing, and its padded calls must still see the branch."""
    for seed in (0, 1):
        m, twin = _level1(_SharesABranchingSub)
        with graph_opt.testing.simulate_cuda_graphs():
            graph_opt.capture_model(m, lambda n: paddle.randn([n, HIDDEN]), progress=False)
        with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
            for real in (3, 5, 4):
                x = _positive(real, seed + real)
                np.testing.assert_allclose(m(x).numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
        assert graph_opt.stats(m).fallback_reasons == {"outputs": 2}, seed


@graph_opt.splitting_op
def _positive_rows(x):
    return bool(x.min() > 0)


@pytest.mark.parametrize("spelling", ["bool", "item", "int", "all", "numpy", "generator", "splitting op"])
def test_a_branch_on_a_value_read_on_the_host_keeps_padded_calls_eager(spelling, logs):
    """`if bool(t)`, `.item()`, `int(t)`, `all(t)` (SOT breaks the graph at the call, not at a jump), a
    generator expression (a frame SOT leaves to plain Python), a splitting op (run eagerly between pieces):
    the read is seen as the forward runs in the capture phase."""
    decide = {"bool": lambda x: bool(x.min() > 0), "item": lambda x: x.min().item() > 0,
              "int": lambda x: int(x.min() > 0) == 1, "all": lambda x: all(x.min(axis=1) > 0),
              "numpy": lambda x: f"{x.min().numpy():.3f}" != "0.000",
              "generator": lambda x: all(v > 0 for v in x.min(axis=1)), "splitting op": _positive_rows}[spelling]

    class Reads(Scaled):
        def forward(self, x):
            h = self.lin(x)
            if decide(x):
                h = h * 2.0
            return h

    m, twin = _level1(Reads, config={"full_cuda_graph": spelling != "splitting op"})
    with graph_opt.testing.simulate_cuda_graphs():
        report = graph_opt.capture_model(m, lambda n: paddle.randn([n, HIDDEN]), progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for real in (3, 5, 1):
            x = _positive(real, real)
            np.testing.assert_allclose(m(x).numpy(), twin(x).numpy(), rtol=1e-5, atol=1e-5)
    # (SOT may translate no program at all for such a forward: the capture fails and it runs eagerly)
    assert report.failed is not None or warned(logs, "reads a tensor's value on the host")


class _CountsWhenPositive(Scaled):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", paddle.zeros([2]))
        self.hits = 0

    def forward(self, x, w):
        h = self.lin(x)
        if x.mean() > 0:
            self.count[0] = self.count[0] + 1.0
            self.hits += 1
            x.add_(paddle.ones_like(x))
            return w, h * 2.0 + x + self.count[0]
        return h, w


def test_a_path_the_capture_did_not_take_runs_once_and_returns_and_writes_what_eager_does():
    """A call taking the branch the capture did not runs it once (no replay abandoned and run again: the
    count and a Python value advance once), writes the caller's argument as eager does, returns the
    caller's own tensor where that path returns its argument, and its outputs are kept when held."""
    m, twin = _level1(_CountsWhenPositive, dims={"x": 0})
    w = paddle.arange(HIDDEN, dtype="float32")
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: (-paddle.randn([n, HIDDEN]).abs() - 0.1, w), progress=False)
    m.count.set_value(paddle.zeros([2]))
    m.hits = 0
    kept = []
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for i in range(4):
            x = _positive(4, i) * (1.0 if i % 2 == 0 else -1.0)
            x_twin = x.clone()
            out, want = m(x, w), twin(x_twin, w)
            taken = i % 2 == 0
            assert out[0 if taken else 1] is w, "the argument returned is the caller's tensor"
            got, expected = out[1 if taken else 0], want[1 if taken else 0]
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(x.numpy(), x_twin.numpy())  # written on that path, as eager writes it
            kept.append((got, expected.clone()))
            assert float(m.count[0]) == float(twin.count[0]) and m.hits == twin.hits, i
    for got, expected in kept:
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert graph_opt.stats(m).replays == 4


class _WritesWhenPositive(Scaled):
    def forward(self, x):
        h = self.lin(x)
        if x.mean() > 0:
            x.add_(paddle.ones_like(x))
            return h * 2.0 + x
        return h


def test_a_path_the_capture_did_not_take_in_the_common_calls_shortcut_writes_its_argument_back():
    """The same answer from the shortcut (fast_replay.py) as from the full path: its third call, the
    branch taken again once the shortcut answers, wrote nothing into the caller's x before."""
    m, twin = _level1(_WritesWhenPositive)
    with graph_opt.testing.simulate_cuda_graphs():
        graph_opt.capture_model(m, lambda n: -paddle.randn([n, HIDDEN]).abs() - 0.1, progress=False)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        for i in range(4):
            x = _positive(4, i) * (1.0 if i % 2 == 0 else -1.0)
            x_twin = x.clone()
            np.testing.assert_allclose(m(x).numpy(), twin(x_twin).numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(x.numpy(), x_twin.numpy())
    assert graph_opt.stats(m).replays == 4
    assert state_of(m).runner.shortcut is not None and state_of(m).runner.shortcut.plans
