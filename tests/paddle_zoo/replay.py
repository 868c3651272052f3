"""The Paddle models of the inference replay-safety tests (tests/both/test_replay_*.py and Paddle's own), each
named for what its forward does that a replay must get right; MODELS holds those the shared tests take."""
import collections
import dataclasses
import types
from typing import Any

import paddle

import graph_opt
from replay_support import HIDDEN, CountsInPlaceMixin, KeepsRowsMixin

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


ScaledByClosure, set_closure_scale = _closure_model()


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
