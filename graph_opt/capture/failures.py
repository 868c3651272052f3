"""What a capture failure says: the framework's error, the line of model code that issued the failing
operation, and where the cause is a known one, what to do about it.

A capture fails inside the framework (a CUDA call refused during capture), but the user's question is
which line of their model did it. The line is the innermost frame of the traceback outside graph_opt,
the frameworks and the standard library: the model's own code, or a library's model code (transformers,
PaddleFormers), which is where the fix goes.
"""
from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from typing import List, Optional, Tuple

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graph_opt/, whose code is not the model's

_HOST_DATA = re.compile(r"unless the CPU tensor is pinned|Cannot copy between CPU and CUDA|pageable", re.I)

# (pattern of the framework's message, remedy). First match wins.
_REMEDIES: List[Tuple[re.Pattern, str]] = [
    (_HOST_DATA,
     "a tensor made from host data inside the forward (torch.tensor(0.0, device=...), a CPU tensor moved "
     "to the device): make it once outside the forward (a buffer, or a module attribute on the device), "
     "pin it, or pass the Python number to the op itself (torch.where(mask, 0.0, x), torch.full)"),
    (re.compile(r"operation not permitted when stream is capturing|StreamCaptureUnsupported|"
                r"StreamCaptureInvalidated|capture.*(sync|invalidated)|synchroniz", re.I),
     "the forward waits for the device (.item(), .cpu(), .tolist(), a Python bool of a tensor, printing a "
     "tensor, or an op whose output shape depends on data, such as nonzero or masked_select): move it out "
     "of the forward, or, for inference, list the op in splitting_ops so it runs eagerly between graphs"),
    (re.compile(r"current_seed|get_rng_state|set_rng_state|generator", re.I),
     "the forward reads or sets a random generator's state: a graph replays the device generator's draws "
     "itself; seed outside the forward"),
    (re.compile(r"maybe_install_capturing_hooks|_hook_installation_lock"),
     "transformers installs its output-capturing hooks at the first call that asks for hidden states or "
     "attentions, and the tracer cannot enter its lock: make one such call before capture_model, on the Hugging "
     "Face model itself (model.lm(input_ids, output_hidden_states=True)); the hooks stay installed"),
    (re.compile(r"as_proxy|convert args/kwargs to proxy"),
     "a function the graph calls as one node (a splitting op) got an argument a graph cannot hold (a module, "
     "another object): at graph_opt_level>=1 a splitting op's arguments must be tensors, numbers, strings, "
     "None, or lists, tuples and dicts of them; pass the values it reads (module.scaling) instead"),
    # Paddle's strategy names the recursing function and its cause where it knows them (backends/paddle/sot_recursion.py)
    (re.compile(r"maximum recursion depth", re.I),
     "the translator recursed without end in a function the forward calls: keep that function out of the "
     "translation (torch: torch.compiler.disable(fn); Paddle: docs/paddle.md, paddle.jit.not_to_static(fn) "
     "reaching dy2static only), or use graph_opt_level=0"),
    (re.compile(r"out of memory", re.I),
     "the device ran out of memory while capturing: capture fewer or smaller batch sizes "
     "(cudagraph_capture_sizes), or free memory before capture"),
]


# Added to a remedy where the level in use does not already do it
_TRACING_HINTS = {id(_HOST_DATA): "; at graph_opt_level>=1 (autocudagraph(level=1) for training) a tensor made from "
                                  "Python numbers alone is made once when the forward is traced"}

_FRAME_TEXT = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]*([^\n]*)')
# CUDA's advice for kernel errors, which a refused capture is not
_BOILERPLATE = re.compile(r"^(CUDA kernel errors might be asynchronously reported|For debugging consider passing|"
                          r"Compile with `TORCH_USE_CUDA_DSA`).*\n?", re.M)
_FRAMES = re.compile(r'\s*(File "|\S+Error: )')  # a paragraph of traceback frames, or one error line
_APOLOGY = re.compile(r"^Sorry about what's happened\.\s*")  # SOT's preamble
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", re.M)


@dataclass(frozen=True)
class Origin:
    """The model line a failure came from."""

    filename: str
    lineno: int
    name: str
    line: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.name}: {self.line}" if self.line else \
            f"{self.filename}:{self.lineno} in {self.name}"


def made_from_host_data(exc: BaseException) -> bool:
    """Whether a capture failed on a copy from host memory the forward made (a tensor of Python numbers)."""
    return bool(_HOST_DATA.search(str(exc)))


def describe(exc: BaseException, traced: bool = False) -> str:
    """`<Type>: <message>`, then `; raised at <file>:<line> in <function>: <source line>` where the
    traceback reaches model code, then `; fix: <remedy>` where the cause is a known one. A message of
    several paragraphs (Dynamo's) keeps its first. traced: the failing forward was traced (level >= 1),
    so the remedy does not advise tracing it."""
    message = _BOILERPLATE.sub("", str(exc)).strip()
    first = message.split("\n\n", 1)[0]
    if first.endswith(":"):  # a header whose substance follows (SOT's "In simulate execution:")
        errors = _ERROR_LINE.findall(message)
        if errors:
            first = f"{first} {errors[-1][0]}: {errors[-1][1].strip()}"
        if first.endswith(":"):  # that error a header too ("ValueError: In transformed code:"): the text after
            prose = [p.strip() for p in message.split("\n\n")[1:] if not _FRAMES.match(p)]
            if prose:
                first = f"{first} {_APOLOGY.sub('', prose[-1])}"
    text = f"{type(exc).__name__}: {first if len(first) <= 800 else first[:800] + ' ...'}"
    origin = origin_of(exc)
    if origin is not None:
        text += f"; raised at {origin}"
    remedy = remedy_for(str(exc), traced)
    if remedy is not None:
        text += f"; fix: {remedy}"
    return text


def origin_of(exc: BaseException) -> Optional[Origin]:
    """The innermost frame of the traceback in model code (see the module docstring), following the
    exceptions it was raised from."""
    places = _Places.now()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = traceback.extract_tb(exc.__traceback__)
        # Only frames graph_opt called into: the caller of capture_model is not where it failed
        ours = [i for i, f in enumerate(frames) if places.is_ours(f.filename)]
        inner = frames[ours[-1] + 1:] if ours else frames
        model = [f for f in inner if places.is_model_code(f.filename)]
        # Dynamo fails while tracing, with the model's frames on its symbolic stack, not Python's
        model = model or [f for f in (getattr(exc, "real_stack", None) or []) if places.is_model_code(f.filename)]
        if model:
            f = model[-1]
            return Origin(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
        # SOT's errors carry the model's stack as text
        quoted = [m for m in _FRAME_TEXT.finditer(str(exc)) if places.is_model_code(m.group(1))]
        if quoted:
            m = quoted[-1]
            return Origin(m.group(1), int(m.group(2)), m.group(3), m.group(4).strip())
        exc = exc.__cause__ or exc.__context__
    return None


def remedy_for(message: str, traced: bool = False) -> Optional[str]:
    for pattern, remedy in _REMEDIES:
        if pattern.search(message):
            return remedy if traced else remedy + _TRACING_HINTS.get(id(pattern), "")
    return None


@dataclass(frozen=True)
class _Places:
    """Where code lives: graph_opt's own (its backends included), the frameworks loaded now, the
    standard library. Found anew per failure: a framework imported after the first one must not pass
    for model code."""

    ours: Tuple[str, ...]
    libraries: Tuple[str, ...]
    stdlib: str

    @classmethod
    def now(cls) -> "_Places":
        ours = (_HERE, os.path.join(os.path.dirname(_HERE), "backends"))
        libraries = []
        for name in ("torch", "paddle", "numpy", "pytest", "_pytest", "pluggy"):
            path = getattr(sys.modules.get(name), "__file__", None)
            if path:
                libraries.append(os.path.dirname(os.path.abspath(path)))
        stdlib = sysconfig.get_paths().get("stdlib")
        return cls(_folders(ours), _folders(ours + tuple(libraries)), _folders((stdlib,))[0] if stdlib else "")

    def is_ours(self, filename: str) -> bool:
        return os.path.abspath(filename).startswith(self.ours)

    def is_model_code(self, filename: str) -> bool:
        if not filename or filename.startswith("<"):
            return False
        path = os.path.abspath(filename)
        if path.startswith(self.libraries):
            return False
        return not (self.stdlib and path.startswith(self.stdlib) and "-packages" + os.sep not in path)


def model_code():
    """A test of a file name: whether it is model code (not graph_opt's, a framework's or the standard
    library's), with the frameworks loaded now."""
    return _Places.now().is_model_code


def _folders(paths) -> Tuple[str, ...]:
    return tuple(os.path.abspath(p).rstrip(os.sep) + os.sep for p in paths)


# What the capture phase says when the captured run sets or binds what a replay would not.
def advances_message(advanced: List[str]) -> str:
    return (f"forward sets Python state as it runs ({', '.join(advanced[:3])}), as `self.t += 1` or a "
            "list appended to do; a replay of the graphs would neither set it nor compute with the new value. "
            "Keep such a value in a tensor the forward updates in place (a buffer: self.t.add_(1)), or set it "
            "outside the forward (torch: graph_opt_level 1, whose translated code makes the store)")


def per_size_message(changed: List[str], padded: int) -> str:
    return (f"forward sets Python state to a value that depends on the call ({', '.join(changed[:3])}, at size "
            f"{padded}), as `self.rows = x.shape[0]` does; a replay would leave the value of another call. Keep "
            "such a value in a tensor the forward updates in place, or compute it outside the forward")


def rebinds_message(rebound: List[str]) -> str:
    return (f"forward binds new tensors where its state was ({', '.join(rebound[:3])}), as "
            "`self.cache = torch.zeros(...)` made at the first call or `st.steps = st.steps + 1` do; a replay "
            "cannot, so it would not leave that state as eager does. Write the state in place (copy_, add_, "
            "index_copy_), make it before the first call, or capture_model() once it exists")
