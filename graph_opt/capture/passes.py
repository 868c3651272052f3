"""Program passes the plugin runs on static programs (level >= 1), and optimize_program()."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

# Names accepted by the config's program_passes, in the order they run by default; the
# implementations are registered in backends/paddle/passes.py (PROGRAM_PASSES). The safety
# pass comes first.
KNOWN_PASSES = ("protect_inplace_writes", "remove_loop_carried_copies")
SEMANTICS = ("static", "eager")


def optimize_program(program, passes: Optional[Sequence[str]] = None, semantics: str = "static",
                     fetch_list: Optional[Sequence] = None) -> Dict[str, int]:
    """Run program passes on a Paddle PIR program in place; returns what they did.

    The result counts ``copies_inserted`` (loop operands copied so that every schedule gives the
    program's meaning), ``reads_rewired`` and ``copies_removed`` (loop-carried copies dropped).

    semantics: "static" for programs built with the static API (a loop's operand keeps its value),
    "eager" for programs traced from dygraph code, where in-place writes are seen by later reads;
    the plugin uses "eager" for the programs SOT builds. `program` may also be a program from
    ``paddle.static.load_inference_model`` (save it again to keep the result).

    fetch_list: the values you will fetch, if known. Without it any value may be fetched, so every
    loop operand the loop writes is copied (with static semantics); with it, only those something
    can still see.
    """
    from ..backends.paddle import passes as impl

    names = list(KNOWN_PASSES if passes is None else passes)
    for name in names:
        if name not in KNOWN_PASSES:
            raise ValueError(f"unknown pass {name!r}; known passes are {', '.join(KNOWN_PASSES)}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics={semantics!r}: must be one of {', '.join(SEMANTICS)}")
    return impl.run_passes(program, names, semantics, fetch_list).as_dict()
