"""The math mode torch's CUDA kernels run in: TF32 for float32 matmuls and convolutions, reduced-precision
reductions in half-precision matmuls, deterministic algorithms, cuDNN on or off, and which attention
kernels scaled_dot_product_attention may pick. A graph replays the
kernels its capture chose, so a replay must run in the mode of its capture (graph_opt.watch.replay_guards).

Reading every flag costs about 0.5 us, too much for every replay. Every Python way of setting one goes
through a torch._C setter looked up at call time (torch.backends.cuda.matmul, set_float32_matmul_precision,
use_deterministic_algorithms, torch.backends.cudnn.flags()) or a descriptor of torch.backends.cudnn
that holds one: both are wrapped to bump a counter, and a replay reads the flags again only after
a bump. Not seen: a C++ extension setting them through ATen directly. cudnn.benchmark is not part of it:
it picks among algorithms of one precision; nor is the attention backends' priority order, which torch
itself reorders (seen on an H200 between two steps of a test, the model using no attention).
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch

from .. import patches

_SETTERS = ("_set_cublas_allow_tf32", "_set_cudnn_allow_tf32", "_set_float32_matmul_precision",
            "_set_fp32_precision_setter", "_set_cublas_allow_fp16_reduced_precision_reduction",
            "_set_cublas_allow_bf16_reduced_precision_reduction", "_set_cublas_allow_fp16_accumulation",
            "_set_deterministic_algorithms", "_set_cudnn_enabled", "_set_cudnn_deterministic",
            # which attention kernel scaled_dot_product_attention picks (enable_flash_sdp, sdpa_kernel)
            "_set_sdp_use_flash", "_set_sdp_use_mem_efficient", "_set_sdp_use_math", "_set_sdp_use_cudnn",
            "_set_sdp_use_fa3", "_set_sdp_use_overrideable", "_set_math_sdp_allow_fp16_bf16_reduction")
_PROPS = {"cudnn": ("enabled", "deterministic", "allow_tf32", "fp32_precision")}

# One byte per bump, its length the count: appending to a bytearray is an operation Dynamo does not trace
# (code torch.compile compiles may set a flag), so the append runs as Python, never as a value baked into
# compiled code with a guard on it (which a list's `[0] += 1` became: counts that went back to values a
# replay had accepted, and recompiles of the user's code at every other count).
_log = bytearray()
_reads: List[Tuple[str, Callable]] = []


def counter() -> bytearray:
    """What every setter of a math-mode flag appends to, process-wide: its len() is the count."""
    patches.once("torch.math_mode", _install)
    return _log


def now() -> Tuple:
    """The flags as they are: one value per read (an unreadable one, such as a legacy getter after the new
    API was used, reads as its error's type)."""
    patches.once("torch.math_mode", _install)
    values = []
    for _, read in _reads:
        try:
            value = read()
            values.append(tuple(value) if isinstance(value, list) else value)
        except Exception as exc:  # torch refuses some getters after a mix of its two TF32 APIs
            values.append(type(exc).__name__)
    return tuple(values)


def describe(was: Tuple, is_: Tuple) -> str:
    changed = [f"{label} {new!r} (captured under {old!r})" for (label, _), old, new in zip(_reads, was, is_) if old != new]
    return ", ".join(changed) or "unknown"


def _precision(op: str) -> str:
    """The fp32 precision CUDA's `op`s run at, in the newer API: an unset level inherits the one above it
    (op, then the backend, then generic)."""
    precision = torch._C._get_fp32_precision_getter
    for backend, level in (("cuda", op), ("cuda", "all"), ("generic", "all")):
        value = precision(backend, level)
        if value != "none":
            return value
    return "none"


def _tf32(legacy: str, op: str, default: bool) -> bool:
    """Whether TF32 is on for CUDA's float32 `op`s, as a boolean whichever API set it: torch's legacy getter
    raises once the newer fp32_precision API was used, which then answers (_precision)."""
    try:
        return getattr(torch._C, legacy)()
    except RuntimeError:
        value = _precision(op)
        return default if value == "none" else value == "tf32"


def _counted(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        # Before and after: a replay in another thread that read the flags between the two sees the second.
        _log.append(1)
        try:
            return fn(*args, **kwargs)
        finally:
            _log.append(1)

    counted.__graph_opt_counted__ = True
    return counted


_WHY = "a replay reads the math-mode flags again only after one of torch's setters ran"


def _install() -> None:
    C = torch._C
    for name in _SETTERS:
        fn = getattr(C, name, None)
        if fn is not None and not getattr(fn, "__graph_opt_counted__", False):
            patches.replace(C, name, _counted(fn), _WHY)
    for module_name, names in _PROPS.items():
        module = getattr(torch.backends, module_name, None)
        for name in names:
            prop = type(module).__dict__.get(name) if module is not None else None
            setter: Optional[Callable] = getattr(prop, "setter", None)
            if setter is not None and not getattr(setter, "__graph_opt_counted__", False):
                patches.replace(prop, "setter", _counted(setter), _WHY,
                                where=f"torch.backends.{module_name}.{name} (its setter)")
    if _reads:
        return  # installed again after patches.remove_all(): the reads stand
    _reads.append(("TF32 in cuBLAS matmuls", functools.partial(_tf32, "_get_cublas_allow_tf32", "matmul", False)))
    _reads.append(("TF32 in cuDNN convolutions", functools.partial(_tf32, "_get_cudnn_allow_tf32", "conv", True)))
    if hasattr(C, "_get_fp32_precision_getter"):  # RNNs have their own, in the newer API only
        _reads.append(("fp32 precision of cuDNN RNNs", functools.partial(_precision, "rnn")))
    for label, name in (("fp16 reduced-precision reduction", "_get_cublas_allow_fp16_reduced_precision_reduction"),
                        ("bf16 reduced-precision reduction", "_get_cublas_allow_bf16_reduced_precision_reduction"),
                        ("fp16 accumulation", "_get_cublas_allow_fp16_accumulation"),
                        ("deterministic algorithms", "_get_deterministic_algorithms"),
                        ("cuDNN enabled", "_get_cudnn_enabled"), ("cuDNN deterministic", "_get_cudnn_deterministic"),
                        ("flash attention", "_get_flash_sdp_enabled"),
                        ("memory-efficient attention", "_get_mem_efficient_sdp_enabled"),
                        ("math attention", "_get_math_sdp_enabled"), ("cuDNN attention", "_get_cudnn_sdp_enabled"),
                        ("FA3 attention", "_get_fa3_sdp_enabled"),
                        ("math attention fp16/bf16 reduction", "_get_math_sdp_allow_fp16_bf16_reduction")):
        read = getattr(C, name, None)
        if read is not None:
            _reads.append((label, read))
