"""PrefetchPipeline: step t+1's per-layer selection and fetch on side CUDA streams.

Lookahead knows layer l's query for step t+1 as soon as layer l has run at step t. For each layer,
once the foreground stream is done with that layer's working set (attention, local-block promotion),
``launch`` records an event on the foreground; the *select* stream waits for it and scores the
summaries and plans the capped selection (residency tables updated in place); the *copy* stream
waits for the selection and runs the UVA gather; an event on the copy stream marks layer l ready.
``wait(l)`` makes the foreground stream wait for that event (on the GPU: the host never blocks)
before it touches layer l's working set again, at the next step's decode or prefill. So the copy of
layer l overlaps layers l+1.. of this step and layers ..l-1 of the next.

CUDA graphs. A graph must end with its side streams joined, so a copy captured inside it would have
to finish before the step ends, and the host's time between two steps would go unused. So a captured
step keeps only the selections: ``launch`` records each layer's copy instead of running it, and
``take_captured`` captures those copies, in layer order, into a graph of their own on the copy
stream (the step's *tail*). After a replay has completed (the engine has read the step's tokens;
otherwise ``run_captured`` waits for it), ``run_captured`` launches the tail: one graph launch, so
the copies overlap the host's work between steps and the next replay. That replay waits for layer
l's copy with a device-side wait (``kernels/wait_ready.py``), not an event: every copy of layer l,
eager or in a tail, is counted on the host when launched (``issued[l]``, pinned memory the wait
reads through UVA) and on the copy stream after it (``copied[l]``, device); a captured ``wait(l)``
holds the foreground until ``copied[l] >= issued[l]``. The host only counts copies while no replay
is in flight, so a replay sees exactly the copies launched before it. That replay's selection of
layer l, which overwrites the copy's list, runs after the wait. Copy lists must live outside the
graphs' memory pool (another bucket's replay may reuse pool memory). A wait that polls too long
flags a timeout instead of hanging; the next ``run_captured`` raises it as the step's error.

Memory discipline: tensors a stage reads that the foreground made, and the plan the copy stage
reads, stay referenced until ``wait(l)``; after it the foreground is ordered behind the stage, so
the caching allocator may hand that memory out again. Temporaries a stage creates belong to its
stream's pool.

Without CUDA, or when not ``asynchronous``, a stage runs at once on the current stream: the same
operations in the same order. An exception raised while launching a stage propagates to the caller
(the engine finishes that step's requests with an error) after the foreground has been ordered
behind whatever the stage had already queued, so none of its inputs is reused under it.

Stall: the foreground work of waiting for stages (async) or running them (inline) runs inside
``stall()``, a context the caller supplies (a harness's stall clock, ``kv/probes.py``; it is entered
while graphs are captured too, so captured graphs keep what it recorded). ``before_copy``, when
given, runs on the copy stream before each copy (tests slow the copies with it).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager

import torch

from oasiskv.kernels.dispatch import kernel

#: polls a captured step's wait for a copy makes before it flags a timeout (seconds on an H200)
WAIT_POLLS = 1 << 24


@dataclasses.dataclass
class Tail:
    """A captured step's copies: their graph (replayed on the copy stream) and the layers it
    fills."""
    graph: torch.cuda.CUDAGraph
    layers: list[int]


class PrefetchPipeline:
    def __init__(self, num_layers: int, device: torch.device, asynchronous: bool,
                 stall: Callable[[int], ContextManager] = lambda layer: contextlib.nullcontext(),
                 before_copy: Callable[[], None] | None = None):
        self.cuda = device.type == "cuda"
        self.asynchronous = asynchronous and self.cuda
        self.stall, self.before_copy = stall, before_copy
        # (keep, plan, event marking the layer ready)
        self._pending: list[Any] = [None] * num_layers
        self._captured: list[tuple[int, Callable[[Any], None], Any]] = []
        self._last_selected: torch.cuda.Event | None = None
        self._busy: set = set()  # side streams holding work not yet joined
        if self.asynchronous:
            self.select_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)
            self._start = [torch.cuda.Event() for _ in range(num_layers)]
            self._selected = [torch.cuda.Event() for _ in range(num_layers)]
            self._ready = [torch.cuda.Event() for _ in range(num_layers)]
            self._replayed, self._tail_done = torch.cuda.Event(), torch.cuda.Event()
            # host: copies launched
            self._issued = torch.zeros(num_layers, dtype=torch.long).pin_memory()
            self._issued_np = self._issued.numpy()
            self._copied = torch.zeros(num_layers, dtype=torch.long, device=device)  # copies done
            self._timed_out = torch.zeros(1, dtype=torch.int32).pin_memory()
            self._wait_ready = kernel("wait_ready", True)
            # compile it now, not first inside a capture
            self._wait_ready(self._copied[0], self._issued[0], self._timed_out, WAIT_POLLS)

    def launch(self, layer: int, select: Callable[[], Any], copy: Callable[[Any], None],
               keep: tuple) -> None:
        """Run ``copy(select())`` for ``layer``: on the side streams (async; inside a capture only
        the selection, the copy goes to the tail) or here and now (inline). ``keep``: foreground
        tensors the stages read."""
        if not self.asynchronous:
            with self.stall(layer):
                copy(select())
            return
        capturing = torch.cuda.is_current_stream_capturing()
        self._start[layer].record()
        self._busy.add(self.select_stream)
        self.select_stream.wait_event(self._start[layer])
        plan = None
        try:
            with torch.cuda.stream(self.select_stream):
                plan = select()
            self._selected[layer].record(self.select_stream)
            self._last_selected = self._selected[layer]
            if capturing:
                # (``keep`` stays referenced to the capture's end: the graph's allocations must
                # not reuse it under the selection)
                self._captured.append((layer, copy, plan))
            else:
                self._busy.add(self.copy_stream)
                self.copy_stream.wait_event(self._selected[layer])
                with torch.cuda.stream(self.copy_stream):
                    self._copy(layer, copy, plan)
                    self._ready[layer].record()
                self._issued_np[layer] += 1
        except BaseException:
            self.join()  # ``keep`` and ``plan`` are still referenced here
            raise
        self._pending[layer] = (keep, plan, self._ready[layer])

    def _copy(self, layer: int, copy: Callable[[Any], None], plan: Any) -> None:
        """``copy(plan)`` on the current (copy) stream, then count it done on the device."""
        if self.before_copy is not None:
            self.before_copy()
        copy(plan)
        self._copied[layer].add_(1)

    def take_captured(self) -> Tail | None:
        """After a capture: its deferred copies, captured as a ``Tail`` (None: there were none).
        Hand it to ``run_captured`` after each replay of that capture."""
        captured, self._captured = self._captured, []
        if not captured:
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.copy_stream):
            for layer, copy, plan in captured:
                self._copy(layer, copy, plan)
        return Tail(graph, [layer for layer, _, _ in captured])

    def run_captured(self, tail: Tail) -> None:
        """Launch a replayed graph's tail on the copy stream behind everything on the current stream
        (call once the replay has completed; see the module docstring). Raises when the replay timed
        out waiting for the previous tail (its results are wrong: the caller fails the step's
        requests)."""
        if self._timed_out[0]:
            self._timed_out.zero_()
            raise RuntimeError(f"a decode step waited more than {WAIT_POLLS} polls for a "
                               f"lookahead copy")
        self._replayed.record()
        if not self._replayed.query():  # the replay's outputs were not read yet: wait for it (rare)
            self._replayed.synchronize()
        self._busy.add(self.copy_stream)
        self.copy_stream.wait_event(self._replayed)
        with torch.cuda.stream(self.copy_stream):
            tail.graph.replay()
            self._tail_done.record()
        self._issued_np[tail.layers] += 1
        for layer in tail.layers:
            self._pending[layer] = (None, None, self._tail_done)

    def wait(self, layer: int) -> None:
        """Order the foreground stream after ``layer``'s pending stages (none: no-op). Inside a
        capture, always: the replay waits for the copy the previous replay left for this layer."""
        if self.asynchronous and torch.cuda.is_current_stream_capturing():
            with self.stall(layer):
                self._wait_ready(self._copied[layer], self._issued[layer], self._timed_out,
                                 WAIT_POLLS)
            return
        if self._pending[layer] is None:
            return
        with self.stall(layer):
            torch.cuda.current_stream().wait_event(self._pending[layer][2])
        self._pending[layer] = None

    def join(self) -> None:
        """Order the current stream after everything on the side streams and forget what is pending
        (at the end of a capture a graph cannot leave side work behind; inside one only the streams
        it used are joined)."""
        current = torch.cuda.current_stream() if self._busy else None
        for side in self._busy:
            tail = torch.cuda.Event()
            tail.record(side)
            current.wait_event(tail)
        self._pending = [None] * len(self._pending)
        self._last_selected, self._busy = None, set()

    def wait_copies(self) -> None:
        """Hold the host until every copy launched so far (tails and eager copies) has run."""
        if self.asynchronous:
            self.copy_stream.synchronize()

    def wait_selections(self) -> None:
        """Order the foreground after every selection launched so far (before it reads their
        counters)."""
        if self._last_selected is not None:
            torch.cuda.current_stream().wait_event(self._last_selected)
            self._last_selected = None
