"""The plugin's process-wide hooks around one SOT call (_Scope), and the splitting helpers SOT
reads while translating (a splitting op breaks the subgraph and runs eagerly between captured ones).
Where SOT may translate, two more: dy2static's calls bounded in depth, and SOT's collections skipped.

They share a module on purpose: _Scope sets _sot_split_names, the module global _sot_split_hook reads.
"""
from __future__ import annotations

import paddle.jit.dy2static as _jst
from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer
from paddle.jit.sot.opcode_translator.executor import executor_cache
from paddle.jit.sot import psdb
from paddle.jit.sot.utils.envs import ENV_MIN_GRAPH_SIZE

from ... import guards
from ...capture import split

_STATE_LOCK = guards.state_lock


class _Scope:
    """The plugin's hooks around one SOT call: the run_impl hook, the splitting ops and, where SOT
    may translate, MIN_GRAPH_SIZE=0 (so small subgraphs reach run_program and its passes).
    A plain class, not a generator context manager: replays and static calls pass through it.
    What it sets is process-wide (a class attribute, module globals, an env flag) and it saves the
    previous values on itself: it holds guards.state_lock from __enter__ to __exit__, so two threads
    cannot restore each other's hooks."""

    __slots__ = ("hook", "names", "min_graph_size", "saved", "saved_env", "saved_translation")

    def __init__(self, hook, names, min_graph_size: bool):
        self.hook = hook
        self.names = names
        self.min_graph_size = min_graph_size

    def __enter__(self):
        global _sot_split_names
        _STATE_LOCK.acquire()
        try:
            self.saved = (PartialProgramLayer.HOOKED_RUN_IMPL, _sot_split_names,
                          split.set_hook(_sot_split_hook if self.names else None))
            PartialProgramLayer.HOOKED_RUN_IMPL = self.hook
            _sot_split_names = self.names
            if self.min_graph_size:
                self.saved_env = ENV_MIN_GRAPH_SIZE.get()
                ENV_MIN_GRAPH_SIZE.set(0)
                self.saved_translation = (_jst.Call, executor_cache.gc)
                _jst.Call, executor_cache.gc = _bounded_call, _NO_COLLECTIONS
        except BaseException:
            _STATE_LOCK.release()
            raise

    def __exit__(self, *exc):
        global _sot_split_names
        try:
            PartialProgramLayer.HOOKED_RUN_IMPL, _sot_split_names, hook = self.saved
            split.set_hook(hook)
            if self.min_graph_size:
                ENV_MIN_GRAPH_SIZE.set(self.saved_env)  # as Paddle's own EnvironmentVariableGuard restores
                _jst.Call, executor_cache.gc = self.saved_translation
        finally:
            _STATE_LOCK.release()


# dy2static (the AST translation SOT runs for a layer marked @paddle.jit.marker.unified) calls every function
# through _jst.Call, which converts it anew at each level of a recursion: a function that recursed without end
# there (PaddleFormers' PretrainedConfig.__getattribute__, without not_to_static(PretrainedConfig.get)) was
# converted about once per frame of Python's recursion limit, 20 ms each: 12-20 s to fail a Qwen3 capture at
# the limit of 1000, 48 s at 2000 (2-core CPU). While graph_opt translates, a converted function that is
# already this many levels deep on the stack raises RecursionError at once.
_MAX_CONVERTED_DEPTH = 64
_converted_depth: dict = {}


def _bounded_call(func):
    converted = _real_call(func)
    key = getattr(func, "__func__", func)  # a bound method (super().f, self.f): its function
    if converted is func:
        return converted  # not converted (a builtin, a Paddle API, not_to_static): no dy2static code recurses here

    def call(*args, **kwargs):
        depth = _converted_depth.get(key, 0)
        if depth >= _MAX_CONVERTED_DEPTH:
            raise RecursionError(f"dy2static's conversion of {getattr(key, '__qualname__', key)} called itself "
                                 f"{depth} levels deep (graph_opt stops it there: {__name__})")
        _converted_depth[key] = depth + 1
        try:
            return converted(*args, **kwargs)
        finally:
            if depth:
                _converted_depth[key] = depth
            else:
                del _converted_depth[key]

    return call


_real_call = _jst.Call


class _NoCollections:
    """SOT runs gc.collect() after every frame it translates (executor_cache.start_translate): 0.1-0.2 s each
    with PaddleFormers loaded, about half of a level-1 capture on CPU. The capture phase collects once
    before and keeps the collector off (capture_phase.paused_gc); a call without graphs leaves the
    translation's garbage to the automatic collector."""

    @staticmethod
    def collect(*args, **kwargs):
        return 0


_NO_COLLECTIONS = _NoCollections()


# SOT reads these helpers while translating: no imports inside them (SOT cannot simulate an import).
# The splitting ops SOT must break at, for the strategy now running. A module global on purpose:
# SOT guards the globals a translation read by value, so a model with other splitting ops (or none)
# gets its own translation instead of reusing one that breaks elsewhere.
_sot_split_names: frozenset = frozenset()


def _run_eagerly(op, args, kwargs):
    psdb.fallback(True)
    return op.fn(*args, **kwargs)


def _split_at(op, args, kwargs):
    """psdb.breakgraph() ends the subgraph at the call; psdb.fallback(True) then keeps the function
    out of SOT entirely, so it runs eagerly between captured subgraphs (and outside any graph).
    SOT cannot break inside a Python loop of the frame it is translating: a splitting op called
    directly in such a loop makes SOT run that whole frame eagerly (capture then reports it)."""
    psdb.breakgraph()
    return _run_eagerly(op, args, kwargs)


def _sot_split_hook(op, args, kwargs):
    if op.name in _sot_split_names:
        return _split_at(op, args, kwargs)
    return op.fn(*args, **kwargs)
