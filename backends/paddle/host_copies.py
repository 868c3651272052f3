"""Device-to-host copies the host does not wait for (graph_opt.replay.host_outputs): the contract's HostCopies
group of the Paddle adapter. The CUDA path is written against Paddle 3.2+ and is not run here (no
Paddle GPU build); on CPU the copies are made at once."""
from __future__ import annotations

import paddle


class PaddleHostCopies:
    """contracts.HostCopies for Paddle tensors (PaddleAdapter is one)."""

    def __init__(self):
        self._copy_stream = None
        self._in_flight = []  # (event, sources) of device-to-host copies not yet known done

    # -- graph_opt.to_host_async ------------------------------------------------------------------
    def pinned_like(self, t):
        if t.place.is_gpu_place():
            return paddle.empty(t.shape, dtype=t.dtype).pin_memory()
        return paddle.empty(t.shape, dtype=t.dtype)

    def copy_to_host_async(self, buffers, sources):
        """As torch's: a copy stream after the producing stream's work; the producer waits for the copy."""
        if not sources or not sources[0].place.is_gpu_place():
            for dst, src in zip(buffers, sources):
                dst.copy_(src, True)
            return None
        cuda = paddle.device.cuda
        self._in_flight = [(e, s) for e, s in self._in_flight if not e.query()]
        if self._copy_stream is None:
            self._copy_stream = cuda.Stream()
        producer = cuda.current_stream()
        ready = cuda.Event()
        ready.record(producer)
        stream = self._copy_stream
        stream.wait_event(ready)
        with cuda.stream_guard(stream):
            for dst, src in zip(buffers, sources):
                dst.copy_(src, False)
            done = cuda.Event()
            done.record(stream)
        producer.wait_event(done)
        self._in_flight.append((done, list(sources)))  # Paddle has no record_stream: keep the sources
        return done

    # -- host_outputs copied inside the replayed graph: simulated only. Paddle gives no device view of
    # pinned memory, so on a GPU host_slots() says no and the copies go the stream way after a replay.
    def pinned_like_ring(self, t, depth: int):
        ring = paddle.zeros([depth, *t.shape], dtype=t.dtype)
        return ring.pin_memory() if t.place.is_gpu_place() else ring

    def host_slots(self, pinned, like):
        return None if like.place.is_gpu_place() else pinned

    def select(self, t, index: int):
        return t[index]

    def slot_counter(self, like):
        return paddle.zeros([1], dtype="int64")

    def copy_into_slot(self, ring, counter, src) -> None:
        ring[int(counter.item())].copy_(src, False)

    def advance_slot(self, counter, depth: int) -> None:
        counter.copy_((counter + 1) % depth, False)

    def set_slot(self, counter, slot: int) -> None:
        counter.fill_(slot)

    def new_event(self, like):
        return paddle.device.cuda.Event() if like.place.is_gpu_place() else None

    def record_event(self, event) -> None:
        event.record()

    def event_done(self, event) -> bool:
        if not event.query():
            return False
        self._in_flight = [(e, s) for e, s in self._in_flight if e is not event]
        return True

    def event_wait(self, event) -> None:
        event.synchronize()
        self._in_flight = [(e, s) for e, s in self._in_flight if e is not event]

    def host_numpy(self, t):
        return t.numpy().copy()

    def host_view(self, t):
        return None  # Paddle's numpy() copies: there is no lasting view of a tensor's memory
