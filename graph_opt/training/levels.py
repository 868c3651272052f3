"""What each key of a graphed block runs and is captured from: the eager forward (level 0) or the forward
traced by the compiler (levels 1 and 2; torch's Dynamo and AOTAutograd), and when a key moves between them.

- A traced key's first call runs eagerly and shows its outputs (first_call). With several carrying
  gradients it is traced only where one of them is computed from all the others (a loss from the logits
  it is returned with): a traced backward gives the outputs a loss leaves out zeros, not eager's None,
  and only then do those zeros add to gradients computed anyway. Otherwise it is captured from the eager
  forward, whose backward leaves them out (a logged norm's backward at zero would make 0 * inf).
- A key the compiler cannot trace (its limit of traces per forward spent) is captured from the eager
  forward, said and counted (untraced).
- At the default level (None: 0), a key whose eager capture failed on a tensor made from host data
  (transformers' `torch.tensor(0.0, device=...)`) is traced at level 1, where that tensor is made once,
  and so are the block's later keys (retrace). An explicit level=0 is never traced.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from ..errors import CaptureError, TraceLimitReached
from ..capture.failures import describe, made_from_host_data
from ..pytree import flatten, tensor_paths
from .graphs import KeyState

logger = logging.getLogger("graph_opt")


class KeyLevels:
    """A block's choice of forward per key (the block holds one as `block.levels`)."""

    def __init__(self, block, level: Optional[int]):
        self.block = block
        self.requested = level
        self.level = level or 0
        self.retrace = level is None  # until a key traced by this choice fails too
        self.trace_new_keys = False  # a key's eager capture failed on host data: the others would too
        self.traced: Optional[Callable] = None

    def bind(self) -> None:
        if self.level:
            self.traced_at(self.level)

    def traced_at(self, level: int) -> Callable:
        if self.traced is None:
            block = self.block
            self.traced = block.bridge.traced(block.call, level, block.name)
        return self.traced

    def eager_only(self, state: KeyState) -> bool:
        """Whether a key with no forward chosen yet runs the eager forward without a first look."""
        return self.level == 0 and not (state.retrace or self.trace_new_keys)

    def first_call(self, state: KeyState, needs_grad: bool, args, kwargs):
        block = self.block
        state.tried_trace = not self.level  # a retraced key: its forward is chosen here once
        block.counters.warmups += 1
        outs = block._eager(block.call, args, kwargs)
        level = self.level or 1
        if not self.level:
            block.counters.retraced += 1
        diff = []
        if needs_grad:
            leaves, spec = flatten(outs, block.bridge.is_tensor)
            diff = [(path, o) for path, o in zip(tensor_paths(spec), leaves) if block.bridge.requires_grad(o)]
        root = block.bridge.root_output([o for _, o in diff]) if len(diff) > 1 else None
        if len(diff) > 1 and root is None:
            state.run, state.level = block.call, 0
            if "several_outputs" not in block.warned:
                block.warned.add("several_outputs")
                logger.warning(_SEVERAL_OUTPUTS, block.name, ", ".join(p for p, _ in diff[:4]), level)
        else:
            state.run, state.level, state.root = self.traced_at(level), level, root
        return outs

    def warm_up(self, state: KeyState, args, kwargs, needs_grad: bool = False):
        """A warm-up call of a traced key (its first compiles). Where the compiler cannot trace it, or a
        trace graph_opt chose fails, the key falls back to the eager forward and this call runs it.
        Inside DistributedDataParallel(static_graph=True) a warm-up with a backward runs the eager forward:
        a traced backward gives every parameter it traced an autograd edge, and an empty gradient on one
        (a parameter read through .detach()) still runs DDP's hook, which static_graph refuses once its
        first steps left that parameter out. The capture traces such a key; its replays give edges only to
        the parameters that get a gradient (graphs.StepGraphs.kept)."""
        block = self.block
        if needs_grad and block.data_parallel.static_graph():
            return block._eager(block.call, args, kwargs)
        try:
            return block._eager(state.run, args, kwargs)
        except TraceLimitReached as exc:  # raised before the forward ran anything
            self.untraced(state, str(exc))
        except Exception as exc:  # noqa: BLE001 - a key traced by graph_opt's choice runs eagerly
            if self.level:
                raise
            block.capturer.failed(state, exc)
        return block._eager(block.call, args, kwargs)

    def untraced(self, state: KeyState, why: str) -> None:
        """A key the compiler could not trace is captured from the eager forward: counted, and said once."""
        block = self.block
        state.run, state.level, state.root = block.call, 0, None
        block.counters.untraced += 1
        if "untraced" not in block.warned:
            block.warned.add("untraced")
            logger.warning("%s: %s; this key and any other it cannot trace are captured from the eager forward "
                           "(level 0; stats().untraced counts them). Raise the limit, or call with fewer shapes "
                           "(pad the sequence length to a few buckets)", block.name, why)

    def after_failure(self, state: KeyState, exc: BaseException) -> bool:
        """A failed capture: True where the key is to be traced at level 1 from its next call (a level-0
        key of the default level stopped by a tensor made from host data). Only torch traces; graph_opt's
        own refusals are not retried."""
        block = self.block
        if state.level and not self.level:
            self.retrace = self.trace_new_keys = False  # tracing did not help: other keys are as they are
            return False
        if (self.level or state.level or not self.retrace or block.framework != "torch"
                or isinstance(exc, CaptureError) or not made_from_host_data(exc)):
            return False
        if state.tried_trace:  # tracing chose the eager forward for it (several outputs, no root; the
            return False       # compiler's limit): capturing that again would fail again, every few calls
        state.retrace, state.run, state.warmups = True, None, 0
        self.trace_new_keys = True
        block.counters.capture_failures += 1
        if "retraced" not in block.warned:
            block.warned.add("retraced")
            logger.warning("%s: capturing the eager forward failed: %s. Such keys are traced at level 1 instead "
                           "(Dynamo and AOTAutograd, eager kernels), where that tensor is made once; stats().retraced "
                           "counts them. Pass level=1 to start there (level=0 keeps the eager forward)",
                           block.name, describe(exc, traced=True))
        return True


_SEVERAL_OUTPUTS = ("%s: its forward returns several outputs that carry gradients, none computed from all the "
                    "others (%s); a traced backward would give those a loss leaves out zero gradients where eager "
                    "gives none (NaN where their backward makes 0 * inf), so such calls are captured from the eager "
                    "forward (level 0) instead of at level %d. Return the values you only log or monitor detached "
                    "(.detach()), or compute the loss inside the block from the others")
