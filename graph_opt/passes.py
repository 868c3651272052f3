"""Program passes the plugin runs on static programs (level >= 1), and optimize_program()."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

# Names accepted by the config's program_passes; the implementations live in backends/paddle/passes.py.
KNOWN_PASSES = ("remove_loop_carried_copies",)


def optimize_program(program, passes: Optional[Sequence[str]] = None) -> Dict[str, int]:
    """Run program passes on a Paddle PIR program in place; returns {pass name: rewrites}.

    `program` may be a pir Program, or a directory / path prefix of a saved inference model, which is
    loaded, rewritten and returned counts only (save it again to keep the result).
    """
    from .backends.paddle import passes as impl

    names = list(KNOWN_PASSES if passes is None else passes)
    for name in names:
        if name not in KNOWN_PASSES:
            raise ValueError(f"unknown pass {name!r}; known passes are {', '.join(KNOWN_PASSES)}")
    return impl.run_passes(program, names)
