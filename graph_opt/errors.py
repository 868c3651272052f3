"""Exceptions raised by graph_opt."""


class GraphOptError(Exception):
    """Base class of graph_opt errors."""


class GraphOptConfigError(GraphOptError, ValueError):
    """A config key, value or environment variable is invalid; the message names it."""


class CaptureError(GraphOptError, RuntimeError):
    """Capturing a graph failed; the model keeps running without graphs."""


class TraceLimitReached(CaptureError):
    """A traced level (autocudagraph(level=1 | 2)) could not trace a key: the compiler's limit of traces
    per forward is spent. The block catches it and captures that key from the eager forward instead."""


class ReplayDivergence(GraphOptError, RuntimeError):
    """A replay reached code that was not recorded at capture; the call runs without graphs."""


class GuardFailed(ReplayDivergence):
    """A guard of the framework's translation failed during a replay: Python state the forward read
    changed since capture. The call runs without graphs, with one warning per guard."""

    def __init__(self, guard: str):
        super().__init__(guard)
        self.guard = guard


class GraphOptInputError(GraphOptError, ValueError):
    """Inputs that do not fit the model: what make_inputs returned to capture_model, or a call's tensors
    against what was captured. The message names the argument and what it accepts; nothing was captured
    or replayed with them, and the model answers a correct call as before."""
