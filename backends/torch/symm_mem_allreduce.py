"""A custom all-reduce with the vLLM / FastDeploy capture protocol, for tensor-parallel torch models.

    comm = SymmMemAllReduce(max_bytes=8 << 20, dtype=torch.bfloat16)  # every rank, after init_process_group
    graph_opt.register_custom_allreduce(comm)                         # graph_opt enters comm.capture()
    y = comm.all_reduce(x)                                            # in the model's forward

Two paths, chosen in Python where the forward calls all_reduce:
- registered, while graphs are captured (inside comm.capture(), which graph_opt enters for every
  registered communicator around the warmups and the capture of each size): the input is copied into
  a buffer allocated once, before any capture, and reduced there. SymmMemAllReduce's buffer is
  symmetric memory (torch.distributed._symmetric_memory), reduced by
  torch.ops.symm_mem.one_shot_all_reduce, which reads the peers' buffers directly (CUDA, P2P);
  BufferAllReduce's buffer is an ordinary tensor reduced by torch.distributed.all_reduce, on any
  process group (gloo on CPU): the same branch and counters, without the fast kernel, so that they
  can be tested without GPUs. An input larger than the buffer, or of another dtype or device, takes
  the fallback path even here.
- fallback, otherwise: torch.distributed.all_reduce on the group (NCCL on GPUs).

A graph replays the branch it was captured on: Dynamo bakes it into the traced forward (level >= 1)
and a CUDA graph records its kernels (level 0). That is why graph_opt traces inside the capture
phase (seed 001): traced before, the graphs would replay the fallback path.

registered_calls / fallback_calls count each path when it runs on the host: eager calls, warmups,
captures, and replays of graph_opt's simulated graphs. A real CUDA graph replay runs no Python and
counts nothing; there, a replay's use of the registered path shows in the buffer it writes.

Both kernels are torch.library custom ops (graph_opt::registered_all_reduce and
graph_opt::fallback_all_reduce): Dynamo and Inductor see one opaque node each, and the counters
stay out of the traced code (an attribute written there would be guarded, then recompiled).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ...errors import GraphOptError
from ...guards import is_capturing

_COMMS: Dict[int, "BufferAllReduce"] = {}  # handle -> communicator: how the custom ops find theirs
_handles = itertools.count(1)


@torch.library.custom_op("graph_opt::registered_all_reduce", mutates_args=())
def _registered_all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _COMMS[handle]._registered(x)


@_registered_all_reduce.register_fake
def _(x, handle):
    return x.new_empty(x.shape)


@torch.library.custom_op("graph_opt::fallback_all_reduce", mutates_args=())
def _fallback_all_reduce(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _COMMS[handle]._fallback(x)


@_fallback_all_reduce.register_fake
def _(x, handle):
    return x.new_empty(x.shape)


class BufferAllReduce:
    """Sum over `group` (default: the world); while captured, through a buffer allocated once.

    max_bytes sizes the buffer; dtype and device are those of the tensors it reduces (device: the
    current CUDA device where CUDA is available, else the CPU).
    """

    def __init__(self, group=None, max_bytes: int = 8 << 20, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise GraphOptError(f"{type(self).__name__} needs torch.distributed initialized "
                                "(torch.distributed.init_process_group) before it is created")
        self.group = group if group is not None else dist.group.WORLD
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else _default_device()
        itemsize = torch.empty((), dtype=dtype).element_size()
        if max_bytes < itemsize:
            raise GraphOptError(f"{type(self).__name__}(max_bytes={max_bytes}): the buffer must hold at least one "
                                f"{dtype} element ({itemsize} bytes)")
        self.registered_calls = 0
        self.fallback_calls = 0
        self._took_part = False  # entered capture() once: graph_opt registered it
        self.buffer = self._allocate(max_bytes // itemsize)
        self.handle = next(_handles)
        _COMMS[self.handle] = self

    # -- the capture protocol ----------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self):
        """Entered by graph_opt around the warmups and capture of each size (register_custom_allreduce)."""
        self._took_part = True
        yield

    @property
    def in_capture(self) -> bool:
        """True where the registered path is taken: graph_opt's capture phase, whose capture() this
        communicator took part in. Read from graph_opt.is_capturing() alone, not from a flag of its
        own: a level >= 1 replay checks Dynamo's guards with graph_opt's capture flags as at capture,
        and a guard on a flag of the communicator's own would fail after capture (and the simulated
        level-0 replay sets is_capturing() without entering capture())."""
        return self._took_part and is_capturing()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, as a new tensor (x is not changed)."""
        if self.in_capture:
            return torch.ops.graph_opt.registered_all_reduce(x, self.handle)
        return torch.ops.graph_opt.fallback_all_reduce(x, self.handle)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.device == self.device and x.numel() <= self.buffer.numel()

    def reset_counters(self) -> None:
        self.registered_calls = 0
        self.fallback_calls = 0

    def close(self) -> None:
        """Forget this communicator; graphs that still call it then fail."""
        _COMMS.pop(self.handle, None)

    # -- the two paths (run inside the custom ops) --------------------------------------------------
    def _registered(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            return self._fallback(x)
        self.registered_calls += 1
        return self._reduce_in_buffer(x)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        self.fallback_calls += 1
        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _allocate(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def _reduce_in_buffer(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        dist.all_reduce(staged, group=self.group)
        return staged.view(x.shape).clone()


class SymmMemAllReduce(BufferAllReduce):
    """BufferAllReduce whose buffer is CUDA symmetric memory, reduced by one_shot_all_reduce.

    Creating one is a collective (the buffer's rendezvous): every rank of the group creates its
    communicator at the same point. Needs CUDA, torch.distributed and torch's symmetric memory
    (torch >= 2.6); the error says which is missing.
    """

    def __init__(self, group=None, max_bytes: int = 8 << 20, dtype: torch.dtype = torch.bfloat16,
                 device: Optional[torch.device] = None):
        self._symm_mem = _symmetric_memory()
        super().__init__(group, max_bytes, dtype, device)

    def _allocate(self, numel: int) -> torch.Tensor:
        if self.device.type != "cuda":
            raise GraphOptError(f"SymmMemAllReduce needs a CUDA device, got {self.device}; "
                                "BufferAllReduce runs the same protocol on any device")
        self.group_name = self.group.group_name
        buffer = self._symm_mem.empty(numel, dtype=self.dtype, device=self.device)
        try:
            self._symm_handle = self._symm_mem.rendezvous(buffer, self.group_name)
        except RuntimeError:
            # torch before 2.8 needs the group enabled first (later versions deprecate the call)
            enable = getattr(self._symm_mem, "enable_symm_mem_for_group", None)
            if enable is None:
                raise
            enable(self.group_name)
            self._symm_handle = self._symm_mem.rendezvous(buffer, self.group_name)
        return buffer

    def fits(self, x: torch.Tensor) -> bool:
        # one_shot_all_reduce checks that the input's size is 4-byte aligned (an odd count of bf16 is not)
        return super().fits(x) and x.numel() * x.element_size() % 4 == 0

    def _reduce_in_buffer(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        # The kernel ends with a barrier over the group: no rank rewrites its buffer (the next
        # all-reduce) while a peer still reads it.
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(x.shape)


def _symmetric_memory():
    """torch.distributed._symmetric_memory, or GraphOptError naming what is missing."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA device (this torch {torch.__version__} sees none)")
    if not dist.is_available():
        missing.append("torch.distributed (this build has none)")
    module = None
    try:
        import torch.distributed._symmetric_memory as module
    except ImportError as exc:
        missing.append(f"torch.distributed._symmetric_memory (import failed: {exc})")
    if module is not None:
        for name in ("empty", "rendezvous"):
            if not hasattr(module, name):
                missing.append(f"torch.distributed._symmetric_memory.{name}")
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        missing.append("torch.ops.symm_mem.one_shot_all_reduce")
    if missing:
        raise GraphOptError("SymmMemAllReduce needs " + "; ".join(missing) +
                            ". BufferAllReduce runs the same protocol with torch.distributed.all_reduce on any device")
    return module


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
