"""What the soak and fault suite (tests/both/test_soak_and_faults.py) and the frameworks' soak models
(tests/torch_zoo/soak.py, tests/paddle_zoo/soak.py) share: the mode table, the bounds, SoakKit (what one
framework brings to the suite) and the fault gate of the second splitting op. Imports neither framework.
"""
import dataclasses
import logging
import threading
from typing import Callable

import graph_opt
from graph_opt.capture import split


HIDDEN = 16


SIZES = [1, 2, 4, 8]


# float32: a padded batch multiplies more rows (another matmul blocking) than the unpadded eager run,
# and a compiled program (a whole-forward SOT program, Inductor's kernels) may run other kernels than
# eager: the real rows then differ from eager in the last bits, never more than this.
ROW_TOLERANCE = 1e-5


# From call 1,000 to call 10,000 (9,000 calls): a leak of 1 KiB per call would add 8.8 MiB of RSS, and
# one object per call 9,000 Python memory blocks (the block count catches leaks too small for RSS).
# Measured on 2 cores: Paddle +1.5 to +3.5 MiB (see its SOT_FRAMES), torch +0.0 to +0.1 MiB, blocks flat.
RSS_GROWTH_BOUND = 10 * 2**20


BLOCK_GROWTH_BOUND = 2_000


WARNINGS = logging.WARNING


CALLS = 10_000


# level x use_cudagraph x full_cuda_graph: every row of the mode table (full_cuda_graph is meaningless
# without graphs; both values are run anyway).
MODES = {
    f"L{level}-{'graphs' if use else 'nographs'}-{'full' if full else 'piecewise'}":
        dict(graph_opt_level=level, use_cudagraph=use, full_cuda_graph=full)
    for level in (0, 1, 2) for use in (False, True) for full in (True, False)
}


FAULT_MODES = {  # level 2 is level 1 but for the compiler (none on Paddle's CPU build, Inductor on torch)
    "L0-full": dict(graph_opt_level=0, full_cuda_graph=True),
    "L0-piecewise": dict(graph_opt_level=0, full_cuda_graph=False),
    "L1-full": dict(graph_opt_level=1, full_cuda_graph=True),
    "L1-piecewise": dict(graph_opt_level=1, full_cuda_graph=False),
}


@dataclasses.dataclass(frozen=True)
class SoakKit:
    """What one framework brings to the suite."""

    name: str  # in the soak's printed summary
    build: Callable  # build(seed=0, **cfg) -> (model, its undecorated eager twin with the same weights)
    capture: Callable  # capture(model, **kwargs) -> capture_model's report
    rng: Callable  # rng(seed) -> the random source make_inputs draws from
    make_inputs: Callable  # make_inputs(bs, rows_g=None, rng=None) -> (x, g); rng None: rng(bs)
    read: Callable  # an output as compared: a copy, still valid after the next call
    diff: Callable  # diff(out, want) -> largest |out - want| of two read outputs; inf when shapes differ
    equal: Callable  # equal(out, want) -> bitwise equal
    no_grad: Callable  # no_grad() -> a context
    strategy: type  # the capture strategy of levels >= 1
    translation: tuple  # (owner, attribute, message): the "translation" fault raises at its first call
    leftover_state: Callable  # leftover_state(model) -> {flag: set}, the framework's capture state
    compile_count: Callable  # compile_count() -> graphs compiled so far (none may come after warm-up)
    recompile_message: str
    eager_error: type  # what the eager twin raises for batch dims that disagree
    eager_error_match: str  # ... and a part of its message
    # (mode, "captured" / "above max"): where the path runs eager's kernels on the same rows, bitwise
    bitwise: frozenset
    busy_mode: str  # the mode of the call-while-another-thread-replays test
    # the framework's Python memory blocks that one call of a mode may keep (see BLOCK_GROWTH_BOUND)
    frames_per_call: dict = dataclasses.field(default_factory=dict)
    no_mismatch: frozenset = frozenset()  # modes that get no call with disagreeing batch dims in the soak


def leftover_capture_state(kit, model=None):
    return {
        "is_capturing": graph_opt.is_capturing(),
        "sot_warmup": graph_opt.in_sot_warmup_mode(),
        "split_hook": split._split_hook is not None,
        **kit.leftover_state(model),
    }


# -- the gate: each framework's second splitting op calls gate_fault() first ------------------------
FAULT = {"split": False, "hold": None}


def gate_fault():
    """Raises once when armed, while a size is being captured; with FAULT["hold"] = (thread id,
    entered, release), blocks that thread in here."""
    if FAULT["split"] and graph_opt.is_capturing():
        FAULT["split"] = False
        raise RuntimeError("injected failure in a splitting op")
    hold = FAULT["hold"]
    if hold is not None and hold[0] == threading.get_ident():
        hold[1].set()
        assert hold[2].wait(30)
