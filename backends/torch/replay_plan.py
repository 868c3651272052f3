"""One size's piecewise replay without the split module (ReplayPlan): each piece's graph and each eager
piece's function on the arguments it got at capture, in the captured order, and what an eager piece's
call at capture recorded for it (EagerCall)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from ...errors import ReplayDivergence
from ...pytree import flatten
from ...replay.static_address import same_memory

if TYPE_CHECKING:
    from .pieces import GraphState


@dataclass
class EagerCall:
    fn: Callable
    args: List[Any]  # as held for replays: graph-written tensors through their aliases
    dests: List[tuple] = field(default_factory=list)  # (leaf index of the result, where a graph reads it, in place)
    same: List[tuple] = field(default_factory=list)  # (leaf, earlier leaf): one tensor at capture
    passed: List[tuple] = field(default_factory=list)  # (leaf, tensor argument): its argument at capture


class ReplayPlan:
    """One size's piecewise replay without the split module: each piece's graph.replay() and each eager
    piece's function on the arguments it got at capture, in the captured order; an eager piece's fresh
    results are copied where the graphs that read them read (vLLM's piecewise backend does the same).

    Sound where every argument of an eager piece is the same object at every replay: the inputs the
    transformed code gathers (checked pure by the caller) and graph-written tensors. Where an eager
    piece reads another eager piece's result, or returns anything but tensors and None, the split
    module's forward keeps running (it passes each replay's values).
    """

    def __init__(self, steps: List[Callable]):
        self.steps = tuple(steps)

    def __call__(self) -> None:
        for step in self.steps:
            step()

    @staticmethod
    def build(state: GraphState, owners: Dict[int, torch.Tensor]) -> Optional["ReplayPlan"]:
        """The plan of the capture that just ended, or None where it would not be sound (see above)."""
        if not state.plannable:
            return None
        steps: List[Callable] = []
        for call in state.calls:
            if isinstance(call, EagerCall):
                steps.append(_eager_step(state.adapter, call.fn, [owners.get(id(a), a) for a in call.args],
                                         call.dests, call.same, call.passed))
            else:
                steps.append(call.replay)
        return ReplayPlan(steps)


def _eager_step(adapter, fn: Callable, args: List[Any], dests: List[tuple], same=(), passed=()) -> Callable:
    if not dests and not same and not passed:
        return functools.partial(fn, *args)

    tensor_args = flatten(args, _is_tensor)[0]

    def step():
        leaves, _ = flatten(fn(*args), _is_tensor)
        if any(leaves[j] is not leaves[j0] for j, j0 in same) or \
                any(leaves[j] is not tensor_args[k] for j, k in passed):
            raise ReplayDivergence("an eager piece returned other tensors than at capture, where one tensor "
                                   "reached the graphs after it through two names")
        held = None
        for j, dst, in_place in dests:
            src = leaves[j]
            if in_place:
                if not same_memory(adapter, src, dst):
                    raise ReplayDivergence(_NOT_IN_PLACE)
                continue
            if held is None:
                held = {memory_of(a) for a in tensor_args}
            if memory_of(src) in held:
                raise ReplayDivergence("an eager piece returned its argument or a view of it, where at capture it "
                                       "returned a new tensor that the graphs after it read from a copy")
            if src.shape != dst.shape:
                raise ReplayDivergence(f"an eager piece returned shape {tuple(src.shape)} at replay where the "
                                       f"capture had {tuple(dst.shape)}; the graphs after it baked that shape")
            dst.copy_(src)

    return step


def memory_of(t: torch.Tensor):
    """Where t's elements live: tensors with one storage share it (a view, or the tensor itself)."""
    return t.untyped_storage().data_ptr() if t.numel() else ("empty", id(t))


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


# An eager piece returned its argument's memory at capture; at replay it must again.
_NOT_IN_PLACE = ("an eager piece returned a new tensor where at capture it returned its argument or a view of it, "
                 "whose memory the graphs after it read")
