"""PrefetchPipeline: step t+1's per-layer selection and fetch on side CUDA streams.

Lookahead knows layer l's query for step t+1 as soon as layer l has run at step t. For each layer,
once the foreground stream is done with that layer's working set (attention, local-block promotion),
``launch`` records an event on the foreground; the *select* stream waits for it and scores the
summaries and plans the capped selection (residency tables updated in place); the *copy* stream waits
for the selection and runs the UVA gather; an event on the copy stream marks layer l ready.
``wait(l)`` makes the foreground stream wait for that event (on the GPU: the host never blocks)
before it touches layer l's working set again, at the next step's decode or prefill. So the copy of
layer l overlaps layers l+1.. of this step and layers ..l-1 of the next.

Memory discipline: tensors a stage reads that the foreground made, and the plan the copy stage reads,
stay referenced until ``wait(l)``; after it the foreground is ordered behind the stage, so the caching
allocator may hand that memory out again. Temporaries a stage creates belong to its stream's pool.

Without CUDA, or when not ``asynchronous``, a stage runs at once on the current stream: the same
operations in the same order. An exception raised while launching a stage propagates to the caller
(the engine finishes that step's requests with an error) after the foreground has been ordered behind
whatever the stage had already queued, so none of its inputs is reused under it.

Stall clock: with ``measure`` set, the foreground time spent waiting for stages (async) or running
them (inline / synchronous retrieval) is timed with CUDA events and read by ``stall_seconds``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch


class PrefetchPipeline:
    def __init__(self, num_layers: int, device: torch.device, asynchronous: bool):
        self.cuda = device.type == "cuda"
        self.asynchronous = asynchronous and self.cuda
        self.measure = False
        self.copy_delay_cycles = 0  # tests: hold the copy stream this many GPU cycles before each gather
        self._pending: list[Any] = [None] * num_layers
        self._marks: list = []
        self._stall_host: float | None = None
        self._last_selected: torch.cuda.Event | None = None
        self._launched = False  # side streams hold work not yet joined
        if self.asynchronous:
            self.select_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self._start = [torch.cuda.Event() for _ in range(num_layers)]
            self._selected = [torch.cuda.Event() for _ in range(num_layers)]
            self._ready = [torch.cuda.Event() for _ in range(num_layers)]

    def launch(self, layer: int, select: Callable[[], Any], copy: Callable[[Any], None], keep: tuple) -> None:
        """Run ``copy(select())`` for ``layer``: on the side streams (async) or here and now (inline).
        ``keep``: foreground tensors the stages read."""
        if not self.asynchronous:
            with self.stall():
                copy(select())
            return
        self._start[layer].record()
        self._launched = True
        self.select_stream.wait_event(self._start[layer])
        plan = None
        try:
            with torch.cuda.stream(self.select_stream):
                plan = select()
            self._selected[layer].record(self.select_stream)
            self._last_selected = self._selected[layer]
            self.copy_stream.wait_event(self._selected[layer])
            with torch.cuda.stream(self.copy_stream):
                if self.copy_delay_cycles:
                    torch.cuda._sleep(self.copy_delay_cycles)
                copy(plan)
        except BaseException:
            self.join()  # ``keep`` and ``plan`` are still referenced here
            raise
        self._ready[layer].record(self.copy_stream)
        self._pending[layer] = (keep, plan)

    def wait(self, layer: int) -> None:
        """Order the foreground stream after ``layer``'s pending stages (none: no-op)."""
        if self._pending[layer] is None:
            return
        with self.stall():
            torch.cuda.current_stream().wait_event(self._ready[layer])
        self._pending[layer] = None

    def join(self) -> None:
        """Order the current stream after everything on the side streams and forget what is pending
        (before a graph replay, and at the end of a capture: a graph cannot leave side work behind)."""
        if self._launched:  # (joining an idle side stream inside a capture would be an error)
            current = torch.cuda.current_stream()
            for side in (self.select_stream, self.copy_stream):
                tail = torch.cuda.Event()
                tail.record(side)
                current.wait_event(tail)
        self._pending = [None] * len(self._pending)
        self._last_selected, self._launched = None, False

    def wait_selections(self) -> None:
        """Order the foreground after every selection launched so far (before it reads their counters)."""
        if self._last_selected is not None:
            torch.cuda.current_stream().wait_event(self._last_selected)
            self._last_selected = None

    @contextlib.contextmanager
    def stall(self):
        """Time the foreground work inside (when ``measure``): CUDA events on the current stream."""
        if not self.measure or (self.cuda and torch.cuda.is_current_stream_capturing()):
            yield
            return
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self._stall_host = (self._stall_host or 0.0) + time.perf_counter() - t0
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._marks.append((begin, end))

    def stall_seconds(self) -> float | None:
        """Foreground stall time since the last call (waits for the timed events); None when nothing was
        timed (not measuring, or the steps were graph replays: events inside a graph are not timed)."""
        if not self._marks and self._stall_host is None:
            return None
        total, self._stall_host = self._stall_host or 0.0, None
        for begin, end in self._marks:
            end.synchronize()
            total += begin.elapsed_time(end) / 1e3
        self._marks.clear()
        return total
