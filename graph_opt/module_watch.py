"""What both watches of a module read (inference's replay_guards.ModelState, training's
training_watch.ModuleWatch): the plain attributes of a module and its submodules, keyed so that a
value set to another (1 to 1.0, -0.0 for 0.0 included) or another object bound shows."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from .held_state import state_key


def plain_attributes(adapter, dicts: Sequence[dict], root: Optional[dict],
                     private: bool = False) -> Dict[Tuple[int, str], Any]:
    """(id of a module's __dict__, name) -> key of each plain value (number, string, bool, None) the
    root module holds (`self.temperature`) and of the public ones its submodules hold (a dropout's `p`;
    not the framework's own, nor private bookkeeping such as transformers' `_is_hf_initialized`, unless
    `private`: what a run writes is looked for there too); and of the other objects the root holds
    itself (an enum, a list), by identity. `root` None: submodules only."""
    out = {}
    framework = adapter.framework_attributes
    is_tensor = adapter.is_tensor
    for d in dicts:
        where, own = id(d), d is root
        for k, v in d.items():
            if k != "training" and (own or (private or k[:1] != "_") and k not in framework):
                key = state_key(v)
                if key[0] != "id" or own and k not in framework and k != "forward" \
                        and not k.startswith("_graph_opt") and not is_tensor(v):
                    out[(where, k)] = key
    return out
