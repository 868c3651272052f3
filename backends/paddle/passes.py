"""PIR program passes for Paddle static programs: loop inputs kept sound, loop-carried copies dropped.

How Paddle 3.3's executor runs a ``pd_op.while`` (while_instruction.cc, yield_instruction.cc,
dependency_builder.cc, pir_interpreter.cc; each point is shown by a test in tests/paddle_tests):

(E1) Buffers. When the loop starts, result k shares operand k's buffer; each iteration, block
     argument k shares result k's buffer; after the body, result k shares the buffer of the value
     yielded in slot k. An in-place op (``assign_out_``, ``add_``...) writes its operand's variable,
     and its result *is* that variable. So ``paddle.assign(new, output=loop_var)`` in a body writes
     the buffer of the value that fed the loop, in the first iteration and, while the slot keeps
     yielding that buffer, in every later one.
(E2) Ordering. Instructions are ordered only through the variables they read and write. The while
     is recorded as reading its operands; its body's writes to a block argument are invisible
     outside it. An op that reads an operand (before or after the loop) and the loop that writes
     that operand's buffer get no edge between them.
(E3) Schedules. ``Executor.run`` runs a program on a thread pool, in any order the edges allow:
     such a read sees the operand before, during or after the loop. ``run_program`` (to_static,
     SOT) traces one order, program order.
(E4) Memory. A while releases its operands' variables when it starts. An op that reads an
     operand after the loop then fails with "Tensor holds no memory"; a persistable operand is
     gone for the next run. Fed ``pd_op.data`` variables, and reads from inside the body, are not
     affected.

A program has one of two meanings, and the passes take it as ``semantics``:

* ``"static"`` (programs built with the static API and run by an Executor): values are values. A
  loop's operand keeps the value it had; ``assign(new, output=loop_var)`` updates the loop's state,
  not the tensor that fed it. (E1)+(E2) break that in some runs, and (E4) in every run.
* ``"eager"`` (programs SOT traced from dygraph code, run by run_program): program order, with
  in-place writes seen by every later read of the same tensor, as in the dygraph code; the
  buffer sharing of (E1) mirrors Python's references there. Only (E4) breaks it.

The passes, one file each: protect_inplace_writes.py (the safety pass; it runs first) and
remove_loop_carried_copies.py. What both read of a program (which op writes or shares which
buffer, the while-loop analysis) is pir_analysis.py.

Rewrite a program before its first run: executors cache what they compiled.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import paddle

from .pir_analysis import PassResult, _check
from .protect_inplace_writes import protect_inplace_writes, prune_copies
from .remove_loop_carried_copies import remove_loop_carried_copies


PROGRAM_PASSES: Dict[str, Callable[..., PassResult]] = {
    "protect_inplace_writes": protect_inplace_writes,
    "remove_loop_carried_copies": remove_loop_carried_copies,
}


def run_passes(program, names: Sequence[str], semantics: str = "static",
               outputs: Optional[Sequence[object]] = None) -> PassResult:
    """Run the named passes on program, in order, then drop safety copies later passes made moot."""
    names = list(names)
    for name in names:
        if name not in PROGRAM_PASSES:
            raise ValueError(
                f"unknown program pass {name!r}; known passes: {', '.join(sorted(PROGRAM_PASSES))}"
            )
    _check(program, semantics)
    result = PassResult()
    # New ops (the safety copies) are built as PIR ops even when called from dygraph code (the
    # plugin runs passes on SOT's programs at their first run).
    with paddle.base.framework._dygraph_guard(None), paddle.pir.core.program_guard(program):
        for name in names:
            PROGRAM_PASSES[name](program, semantics, result, outputs)
        if result.inserted_ops:
            prune_copies(program, semantics, result, outputs)
    return result
