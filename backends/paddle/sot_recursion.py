"""Why a translation at level >= 1 recursed without end, named from the RecursionError's stack.

Two causes in Paddle 3.3.1's translators, both about `super()`, meet PaddleFormers 1.2.0's models:

- SOT resumes a call `super().forward(x)` that breaks the graph as `self.forward(x)`: SuperVariable.getattr
  binds the parent's function with the tracker `GetAttrTracker(self, "forward")`, and the code SOT
  generates after the break loads that attribute (`LOAD_FAST self; LOAD_ATTR forward`). On an instance of
  the subclass it is the subclass's own method, which runs its translated code again, without end.
  Gemma3's final norm, `Gemma3RMSNormPipe.forward` -> `super().forward(x)` -> `Gemma3RMSNorm.forward`, whose
  `with paddle.amp.auto_cast(False)` SOT cannot simulate (BEFORE_WITH), is one.
  `paddle.jit.not_to_static` does not help: it marks a function for dy2static (AST) only.
- dy2static (the AST translation SOT uses for a layer marked `@paddle.jit.marker.unified`) rewrites
  `super()` as `super(self.__class__, self)`, which from a subclass instance is the same method again:
  PaddleFormers' `PretrainedConfig.__getattribute__`, reached from `PretrainedConfig.get` in RMSNorm.

The frame that repeats is found on the stack (the frames of every exception in the chain, and those SOT
quotes in its messages), its function in the loaded modules by file and line.
"""
from __future__ import annotations

import collections
import inspect
import linecache
import os
import re
import sys
import traceback
from typing import List, Optional, Tuple

from ...capture.failures import model_code

_QUOTED = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_TRANSLATED = re.compile(r"^[#$]")  # SOT names the code it generates #forward_1a2b3, $resume_2@forward_4c5d6
_REPEATS = 10  # a model frame this many times on the stack is the recursion
_SUPER = re.compile(r"\bsuper\(\)\s*\.\s*(\w+)")

Entry = Tuple[str, int, str]  # file, line, function name


def explain(exc: BaseException) -> Optional[str]:
    """What recursed and why, and the fix, where `exc` (or an exception it was raised from) is a RecursionError
    in model code; else None."""
    chain = _chain(exc)
    if not any(isinstance(e, RecursionError) or "RecursionError" in str(e) for e in chain):
        return None
    is_model = model_code()
    entries = [e for e in _entries(chain) if is_model(e[0])]
    counts = collections.Counter(entries)
    if not counts:
        return None
    (filename, lineno, name), repeats = counts.most_common(1)[0]
    if repeats < _REPEATS:
        return None
    found = _function_at(filename, lineno)
    where = f"{os.path.join(*filename.split(os.sep)[-2:])}:{lineno}"
    if found is None:
        return (f"the translation recursed without end in {name} ({where}, {repeats} times on the stack): keep "
                "that function out of the translation, or use graph_opt_level=0")
    owner, attr, fn = found
    qualname = f"{owner.__name__}.{attr}"
    source = _source(fn)
    called = _SUPER.findall(source)
    if called and _TRANSLATED.match(name):
        parent = next((k for k in owner.__mro__[1:] if called[0] in vars(k)), None)
        by_name = f"{parent.__name__}.{called[0]}(self, ...)" if parent is not None else "the parent's method by name"
        return (f"SOT recursed without end in {qualname} ({where}): its call super().{called[0]}(...) breaks the "
                f"graph, and SOT's code after the break calls self.{called[0]}(...), which on a {owner.__name__} is "
                f"{qualname} itself (Paddle 3.3.1); fix: call {by_name} in it instead of super(), as "
                "docs/paddle.md shows for Gemma3 (paddle.jit.not_to_static does not reach SOT), or use "
                "graph_opt_level=0")
    if called:
        caller = _caller(entries, filename, name)
        text = (f"dy2static recursed without end in {qualname} ({where}): it rewrites super() as "
                "super(self.__class__, self), which on an instance of a subclass is the same method again")
        if caller is None:
            return text + "; fix: keep its caller out of dy2static (paddle.jit.not_to_static), or use graph_opt_level=0"
        caller_name = f"{caller[0].__name__}.{caller[1]}"
        if not _converted_by_dy2static(caller[2]):  # marked already: that is not where it enters
            return (text + f" (its caller {caller_name} is kept out of dy2static already); fix: keep the function "
                    "that converts it out of dy2static, or use graph_opt_level=0")
        return (text + f", entered from {caller_name}; fix: paddle.jit.not_to_static({caller_name}) before the "
                "capture (docs/paddle.md), or use graph_opt_level=0")
    return (f"the translation recursed without end in {qualname} ({where}, {repeats} times on the stack): keep "
            "that function out of the translation, or use graph_opt_level=0")


def _chain(exc: Optional[BaseException]) -> List[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _entries(chain) -> List[Entry]:
    """The stack as (file, line, name), outermost first per exception: its frames, then those its message quotes."""
    entries: List[Entry] = []
    for exc in chain:
        entries += [(os.path.abspath(f.filename), f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
        entries += [(os.path.abspath(m.group(1)), int(m.group(2)), m.group(3)) for m in _QUOTED.finditer(str(exc))]
    return entries


def _caller(entries: List[Entry], filename: str, name: str):
    """The function of the model frame that entered the recursion: the one before the first frame of the
    recursing function."""
    for i, (f, _, n) in enumerate(entries):
        if f == filename and n == name:
            for before in reversed(entries[:i]):
                if (before[0], before[2]) != (filename, name):
                    return _function_at(before[0], before[1])
            return None
    return None


def _function_at(filename: str, lineno: int):
    """(class, attribute name, function) of a method defined at that file and line in a loaded module."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or os.path.abspath(path) != filename:
            continue
        for owner in list(vars(module).values()):
            if not inspect.isclass(owner) or owner.__module__ != module.__name__:
                continue
            for attr, value in vars(owner).items():
                fn = getattr(value, "__func__", value)
                code = getattr(fn, "__code__", None)
                if code is None or os.path.abspath(code.co_filename) != filename:
                    continue
                last = max((line for _, _, line in code.co_lines() if line), default=code.co_firstlineno)
                if code.co_firstlineno <= lineno <= last:
                    return owner, attr, fn
    return None


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = fn.__code__
        return linecache.getline(code.co_filename, code.co_firstlineno)


def _converted_by_dy2static(fn) -> bool:
    from paddle.jit.dy2static.utils import TransformOptions
    return TransformOptions.check_fn_need_transform(fn, TransformOptions.ToStaticMode.AST)
