"""Why a call ran without graphs: one Reason per cause, the keys of stats().fallback_reasons, and the
record a check hands the runner. docs/fallbacks.md gives each reason's cause and fix (a test keeps
the two lists equal)."""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional


class Reason(str, enum.Enum):
    """A str, so stats().fallback_reasons["grad"] finds Reason.GRAD; printed as its value."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    # inference (capture_model / a decorated model's call)
    GRAD = "grad"  # autograd on
    NO_BATCH = "no_batch"  # no tensor with a batch dimension
    ABOVE_MAX = "above_max"  # more rows than the largest capture size
    MISMATCH = "mismatch"  # a non-batch shape (or address) other than captured
    HOST_ARGUMENT = "host_argument"  # a host tensor's value other than baked in; or too large to key (training)
    ALIASED = "aliased"  # an argument written in place shares memory with another
    MOVED = "moved"  # another tensor where a mark_static_address one is read in place
    OUTPUTS = "outputs"  # padded calls would answer otherwise than eager
    DIVERGENCE = "divergence"  # a splitting op took another path than at capture
    GUARD = "guard"  # the translator's guard of the forward fails
    AMBIENT = "ambient"  # autocast, default dtype, math mode other than at capture
    HOOKS = "hooks"  # a module hook registered or removed since capture
    ATTRIBUTE = "attribute"  # a plain attribute the forward reads changed since capture
    TRAINING = "training"  # a training flag other than at capture
    CONVERTED = "converted"  # parameters converted in place (to(), half())
    REPLACED = "replaced"  # a parameter, buffer or submodule replaced
    OBJECT_ARGUMENT = "object_argument"  # an argument object holding tensors graph_opt cannot see into
    NEW_SIGNATURE = "new_signature"  # a structure or non-tensor value not captured, when no more may be
    SIGNATURE_LIMIT = "signature_limit"  # more signatures than max_signatures
    PEER = "peer"  # another rank cannot replay this call
    LAZY_STATE = "lazy_state"  # a size not captured, and the model's state too large to capture one at a call
    DISABLED = "disabled"  # after a failed capture or replay: stats().disabled_reason
    # training (autocudagraph)
    SAVED_TENSOR_HOOKS = "saved_tensor_hooks"  # checkpointing, offloading
    LAZY_PARAMETERS = "lazy_parameters"  # LazyLinear before its first call
    MAX_GRAPHS = "max_graphs"  # more keys than max_graphs
    BACKWARD_PENDING = "backward_pending"  # a second call before the first one's backward
    CAPTURE_FAILED = "capture_failed"  # this key's capture failed
    NO_GRAPHS = "no_graphs"  # no CUDA device
    FORWARD_STATE = "forward_state"  # an attribute the forward writes holds another value than at capture


# What to change, per reason, in a line (docs/fallbacks.md has each at length): graph_opt.explain() says it.
FIXES = {
    Reason.GRAD: "call the model under no_grad / inference_mode (paddle.no_grad); for training, graph_opt.autocudagraph",
    Reason.NO_BATCH: "pass the batched input as a tensor; name its batch dimension in dynamic_arg_dims if it is not 0",
    Reason.ABOVE_MAX: "raise max_capture_size or add the size to cudagraph_capture_sizes, or split the batch",
    Reason.MISMATCH: "pad the other dimensions to the captured shape, or capture with inputs of this shape",
    Reason.HOST_ARGUMENT: "pass the value as a device tensor, or use graph_opt_level: 1",
    Reason.ALIASED: "pass separate tensors (.clone() a fed-back output), or mark the argument with mark_static_address",
    Reason.MOVED: "pass the marked tensor at every call (write new values into it, do not rebind it)",
    Reason.OUTPUTS: "capture the sizes you call with (cudagraph_capture_sizes), or give padding rows pad_values",
    Reason.DIVERGENCE: "keep the splitting op's control flow independent of per-call values, or capture it whole",
    Reason.GUARD: "set the value the guard names back, or clear_graphs() and capture_model()",
    Reason.AMBIENT: "call in the autocast / default dtype / math mode of the capture, or clear_graphs() and capture again",
    Reason.HOOKS: "restore the hooks of the capture, or clear_graphs() and capture_model() with them",
    Reason.ATTRIBUTE: "set the attribute back, pass the value as an argument, or clear_graphs() and capture_model()",
    Reason.TRAINING: "call model.eval() (or train()) as at capture, or clear_graphs() and capture_model() in this mode",
    Reason.CONVERTED: "clear_graphs() and capture_model() after converting the parameters (to(), half())",
    Reason.REPLACED: "write new values into the captured tensors (copy_), or clear_graphs() and capture_model()",
    Reason.OBJECT_ARGUMENT: "pass the object's tensors as arguments, or capture with it in capture_model()",
    Reason.NEW_SIGNATURE: "capture_model() with inputs of this structure or value, or pass the value as a tensor",
    Reason.SIGNATURE_LIMIT: "pass a value that changes from call to call as a tensor, or raise cudagraph_max_signatures",
    Reason.PEER: "the warning names the rank and its reason: fix that one",
    Reason.LAZY_STATE: "capture the sizes with capture_model(), and reset the model's state after it",
    Reason.DISABLED: "read stats().disabled_reason; fix it, then clear_graphs() and capture_model()",
    Reason.SAVED_TENSOR_HOOKS: "none needed (eager's results); graph the blocks that are not checkpointed",
    Reason.LAZY_PARAMETERS: "none needed: the calls after the first are graphed",
    Reason.MAX_GRAPHS: "raise max_graphs, or bucket shapes (pad to a few lengths)",
    Reason.BACKWARD_PENDING: "run a backward (or drop the outputs) before the third call, or graph two blocks",
    Reason.CAPTURE_FAILED: "the warning says why this key's capture failed: fix it, then clear_graphs()",
    Reason.NO_GRAPHS: "run on a CUDA device, or simulate_cuda_graphs() / GRAPH_OPT_SIMULATE_CUDAGRAPH=1",
    Reason.FORWARD_STATE: "keep per-step state out of the block, or in tensors the forward updates in place",
}

# Reasons whose calls run the plain eager forward, not the translated one without graphs: the
# translated code would read what changed as it was at capture (Paddle's SOT runs its programs on the
# parameters it traced with, and neither translator guards every hook).
EAGER = frozenset({Reason.REPLACED, Reason.CONVERTED, Reason.HOOKS, Reason.ALIASED})


class Fallback(NamedTuple):
    """Why one call runs without graphs: the reason it counts under, the warning's text, and what the
    warning is said once per (default: reason and message)."""

    reason: Reason
    message: str
    warn_key: Optional[Any] = None

    @property
    def eager(self) -> bool:
        return self.reason in EAGER


def reason_counts(counts) -> dict:
    """stats()'s fallback_reasons: each reason's value (a plain str) and its count; an unknown reason
    is a bug here, not something a user can look up in docs/fallbacks.md."""
    return {Reason(k).value: n for k, n in counts.items()}
