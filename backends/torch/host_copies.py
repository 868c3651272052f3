"""Device-to-host copies the host does not wait for (graph_opt.replay.host_outputs): the contract's HostCopies
group of the torch adapter. A copy stream after the producing stream's work; pinned rings a captured
kernel writes through, where the device can address pinned memory."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("graph_opt")


class TorchHostCopies:
    """contracts.HostCopies for torch tensors (TorchAdapter is one)."""

    def __init__(self):
        self._copy_stream = None  # device-to-host copies (to_host_async), created on first use
        self._pinned_seen = {}  # device -> whether its kernels can write pinned host memory

    # -- graph_opt.to_host_async --------------------------------------------------------------------
    def pinned_like(self, t):
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)

    def copy_to_host_async(self, buffers, sources):
        """Copy on the copy stream after the producing stream's work so far; the producing stream then
        waits for the copy, so later work there cannot overwrite a source first. None: done at once."""
        if not sources or not sources[0].is_cuda:
            for dst, src in zip(buffers, sources):
                dst.copy_(src)
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        producer = torch.cuda.current_stream()
        stream = self._copy_stream
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            for dst, src in zip(buffers, sources):
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # the allocator must not hand src's memory out before the copy
            done = torch.cuda.Event()
            done.record(stream)
        producer.wait_event(done)
        return done

    # -- host_outputs copied inside the replayed graph (graph_opt.replay.host_outputs.GraphCopies) ----------
    def pinned_like_ring(self, t, depth: int):
        return torch.zeros((depth, *t.shape), dtype=t.dtype, pin_memory=t.is_cuda)

    def host_slots(self, pinned, like):
        """The pinned ring as a tensor on like's device, so a captured kernel writes host memory; None
        where the device cannot address it."""
        if not like.is_cuda:
            return pinned
        if not self._device_sees_pinned(like.device):
            return None
        return device_alias(pinned, like.device)

    def _device_sees_pinned(self, device) -> bool:
        # With unified addressing a pinned buffer has the same address on host and device; a kernel
        # that writes through it once says so for certain.
        seen = self._pinned_seen.get(device)
        if seen is None:
            try:
                probe = torch.full((4,), 3, dtype=torch.int32, pin_memory=True)
                device_alias(probe, device).add_(4)
                torch.cuda.synchronize(device)
                seen = probe.tolist() == [7, 7, 7, 7]
            except RuntimeError as exc:
                logger.info("graph_opt: the device cannot write pinned host memory (%s); host_outputs are "
                            "copied after each replay instead", exc)
                seen = False
            self._pinned_seen[device] = seen
        return seen

    def select(self, t, index: int):
        return t[index]

    def slot_counter(self, like):
        return torch.zeros(1, dtype=torch.int64, device=like.device)

    def copy_into_slot(self, ring, counter, src) -> None:
        ring.index_copy_(0, counter, src.unsqueeze(0))

    def advance_slot(self, counter, depth: int) -> None:
        counter.add_(1).remainder_(depth)

    def set_slot(self, counter, slot: int) -> None:
        counter.fill_(slot)

    def new_event(self, like):
        return torch.cuda.Event() if like.is_cuda else None

    def record_event(self, event) -> None:
        event.record()

    def event_done(self, event) -> bool:
        return event.query()

    def event_wait(self, event) -> None:
        if not event.query():  # a finished copy: the query alone is cheaper than a synchronize
            event.synchronize()

    def host_numpy(self, t):
        return t.numpy().copy()

    def host_view(self, t):
        """A numpy array over the pinned buffer's memory, made once per buffer."""
        return t.numpy()


def device_alias(t, device):
    """A tensor on `device` over t's memory that does not own it: a graph-pool tensor seen weakly, or a
    pinned host tensor seen from the device (one address for both with unified addressing)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=device).set_(alias, t.storage_offset(), t.shape, t.stride())
