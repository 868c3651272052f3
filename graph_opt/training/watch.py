"""What a graphed block binds to (framework_of_call) and watches of its module (TrainingWatch, held by
GraphedBlock as `block.watch`).

After capture a block's graphs read the module's parameters and buffers by address and bake its
training flags and plain attributes: a parameter, buffer or submodule replaced or added, a parameter
frozen or unfrozen, or a plain attribute set to another value is found at the next call, and the
graphs are dropped and captured again. The parts it is made of (module_watch.py) are those the
inference check uses; the training flags are part of a key instead, and the tensors' slots and
addresses are compared at every call.

What the forward writes itself is its own, not a change: attributes it sets and tensors it binds
anew in an eager run stop being watched, and the parameters it writes in place are put back after a
capture.
"""
from __future__ import annotations

import operator
import sys
from typing import Any, Callable, Dict, List, Tuple

from ..errors import GraphOptInputError
from ..watch.module_watch import Attributes, Classes, Hooks, Registrations, TrainingFlags, plain_attributes
from ..watch.held_state import state_key
from ..pytree import flatten

_UNSET = object()
_GONE = object()


class TrainingWatch:
    """The module as a block's graphs read it: the parts of module_watch.py, and its tensors' slots,
    addresses and trainable flags, compared at every call (moved())."""

    def __init__(self, adapter, bridge, module):
        self.adapter = adapter
        self.bridge = bridge
        self.module = module
        self.modules: List[Tuple[str, dict]] = []
        self.flags = TrainingFlags(adapter)
        self.registrations = Registrations(adapter)
        self.hooks = Hooks(adapter)
        self.attributes = Attributes(adapter)
        self.classes = Classes(adapter)
        self.owners: List[dict] = []  # owner dicts, names and tensors of parameters and buffers
        self.names: List[str] = []
        self.tensors: List[Any] = []
        self.addresses: List[int] = []  # their addresses at capture
        self.all_params: List[Any] = []  # every parameter, and whether each was trainable at capture
        self.trainable: List[bool] = []
        self.attr_written: set = set()  # plain attributes the forward itself writes: not watched
        self.own_at: list = []  # ((id, name), its __dict__, name) of those, checked before each replay
        self.tensors_bound: set = set()  # (id of a module's __dict__, name): tensor attributes it binds anew
        # Parameters an eager run of the forward wrote in place (an EMA codebook kept as a frozen
        # Parameter): a capture runs the forward, and puts them back after, as it does the buffers.
        self.params_written: List[Any] = []
        self.ran_eagerly = False
        self.watch_modes()

    @property
    def armed(self) -> bool:
        """Whether arm() took the module's tensors (nothing is stale before the first capture)."""
        return bool(self.tensors)

    def watch_modes(self) -> None:
        """The training flags of the module and every submodule it holds now (one added since is in
        the key from its next capture on)."""
        self.modules = self.adapter.module_dicts(self.module)
        self.flags.snapshot(self.modules)

    def mode(self) -> tuple:
        """The training flags of the module and its submodules (a graph captured in training mode replays
        dropout), read again only after a train()/eval() call anywhere or a change of the module's own."""
        return self.flags.now()

    def arm(self) -> None:
        """Take the module as the graphs about to be captured read it."""
        self.watch_modes()
        bound = self.tensors_bound
        owned = [o for o in self.bridge.owned_tensors(self.module) if (id(o[0]), o[1]) not in bound]
        self.owners = [owner for owner, _, _ in owned]
        self.names = [name for _, name, _ in owned]
        self.tensors = [t for _, _, t in owned]
        self.addresses = self.bridge.addresses(self.tensors)
        self.all_params = self.bridge.all_parameters(self.module)
        self.trainable = self.bridge.trainable_flags(self.all_params)
        self.registrations.snapshot(self.module)
        self.classes.snapshot(self.module)
        # Hooks of submodules run inside the forward, so a graph replays those there were at capture
        # (the module's own run around the block at every call)
        self.hooks.snapshot(self.flags.dicts)
        self._arm_attributes()

    def moved(self) -> bool:
        """A parameter or buffer replaced (a new object, or its data swapped), one added or a submodule
        replaced (a new head, a LoRA adapter) or given another class, the trainable set changed (a parameter frozen or
        unfrozen), a plain attribute set to another value, or a hook of a submodule registered or
        removed: the graphs read and compute gradients for what was captured."""
        tensors = self.tensors
        return (any(map(operator.is_not, map(dict.get, self.owners, self.names), tensors))
                or self.bridge.addresses(tensors) != self.addresses
                or self.bridge.trainable_flags(self.all_params) != self.trainable
                or self.attributes.differs()
                or self.registrations.changed(self.module)
                or self.classes.changed()
                or self.hooks.changed())

    # -- what the forward writes itself ------------------------------------------------------------
    def attributes_now(self) -> Dict[Tuple[int, str], Any]:
        """Every plain attribute of the module and its submodules, private ones too: what a run writes."""
        return plain_attributes(self.adapter, self.modules, own_root=True, private=True)

    def note_writes(self, before: Dict[Tuple[int, str], Any]) -> None:
        """Attributes changed since `before` by a run of the forward are its own: no longer watched."""
        written = {k for k, v in self.attributes_now().items() if before.get(k, _UNSET) != v}
        if written - self.attr_written:
            self.attr_written |= written
            self._arm_attributes()

    def _arm_attributes(self) -> None:
        """Watch the plain attributes of the module and its submodules (a dropout schedule sets `p`) as
        they are now, but those its forward writes itself at its first calls: a replay runs no Python,
        so they are not inputs a user sets (one written at every call fails the capture)."""
        self.attributes.snapshot(self.modules, self.adapter.module_classes(self.module), self.attr_written)
        by_id = {id(d): d for _, d in self.modules}
        # What the forward writes itself, checked against each key's capture before a replay
        self.own_at = [(k, by_id[k[0]], k[1]) for k in self.attr_written if k[0] in by_id]

    def own_values(self) -> list:
        return [_own_now(e) for e in self.own_at]

    def own_as_captured(self, state) -> bool:
        """The attributes the forward writes itself hold what they held when `state`'s graphs were
        captured: the capture found that a run from there leaves them so (else it failed), so a replay
        is what the forward would do. A value that depends on the call (`self.rows = x.shape[0]` with
        shapes alternating) or one written after this key's capture runs the call eagerly instead."""
        attrs = state.attrs or {}
        return all(_own_now(e) == attrs.get(e[0]) for e in self.own_at)

    def own_changed(self, state) -> list:
        attrs = state.attrs or {}
        return [f"{e[2]!r}" for e in self.own_at if _own_now(e) != attrs.get(e[0])]

    def eager(self, run: Callable, args, kwargs):
        """An eager (or traced, not replayed) call of the block: attributes it writes are the forward's
        own, and stop being watched."""
        before = self.before_run()
        version = self.adapter.version
        versions = [(p, version(p)) for p in self.bridge.all_parameters(self.module)]
        try:
            return run(*args, **kwargs)
        finally:
            self.after_run(before)
            self.ran_eagerly = True
            for p, v in versions:
                if version(p) != v and not any(p is q for q in self.params_written):
                    self.params_written.append(p)

    def before_run(self) -> tuple:
        """What a run of the forward is compared with after it (after_run)."""
        return self.attributes_now(), self.tensor_attributes()

    def after_run(self, before: tuple) -> None:
        """The attributes the run wrote and the tensor attributes it bound anew are the forward's own."""
        self.note_writes(before[0])
        self.note_rebinding(before[1])

    def tensor_attributes(self) -> Dict[Any, Any]:
        """(id of a module's __dict__, name) -> the tensor it holds there as a plain attribute."""
        return {(id(owner), name): t for owner, name, t in self.bridge.tensor_attributes(self.module)}

    def note_rebinding(self, before: Dict[Any, Any]) -> None:
        """Tensor attributes a run of the forward bound anew (legacy weight_norm's `weight`, a tensor kept
        for a dashboard, a cache grown at a longer sequence) are its own, as the plain attributes it
        writes: no longer watched, so their next binding is not taken for a replacement."""
        now = self.tensor_attributes()
        bound = {k for k, t in now.items() if before.get(k) is not t}
        if bound - self.tensors_bound:
            self.tensors_bound |= bound
            if self.tensors:
                self.arm()

    def written_parameters(self) -> list:
        """(parameter, copy) of those the forward may write in place, for a capture to put back: every
        frozen one (a write through .data moves no version counter) and the trainable ones an eager run
        was seen writing; before any eager run (warmup_steps=0), every one."""
        bridge = self.bridge
        everything = bridge.all_parameters(self.module)
        if self.ran_eagerly:
            chosen = [p for p in everything if not bridge.requires_grad(p) or any(p is q for q in self.params_written)]
        else:
            chosen = everything
        with self.adapter.no_grad():
            return [(p, self.adapter.clone(p)) for p in chosen]


def _own_now(entry) -> Any:
    value = entry[1].get(entry[2], _GONE)
    return None if value is _GONE else state_key(value)


def framework_of_call(args, kwargs, name: str) -> str:
    """The framework of a function's tensors, judged from the first tensor found."""
    candidates = [fw for fw in ("torch", "paddle") if fw in sys.modules]
    for fw in candidates:
        tensor_type = sys.modules[fw].Tensor
        leaves, _ = flatten((args, kwargs), lambda x, t=tensor_type: isinstance(x, t))
        if leaves:
            return fw
    raise GraphOptInputError(
        f"autocudagraph: {name} was called without a tensor argument; a graphed function takes paddle or "
        "torch tensors (nested in dicts, lists or tuples is fine)")
