"""The plugin's process-wide hooks around one SOT call (_Scope), and the splitting helpers SOT
reads while translating (a splitting op breaks the subgraph and runs eagerly between captured ones).

They share a module on purpose: _Scope sets _sot_split_names, the module global _sot_split_hook reads.
"""
from __future__ import annotations

from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer
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

    __slots__ = ("hook", "names", "min_graph_size", "saved", "saved_env")

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
        finally:
            _STATE_LOCK.release()


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
