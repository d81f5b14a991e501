"""RemoteFetch: a replayed decode step's remote-fetch stage, layer by layer while the replay runs.

With a decode-host cache (``kv/host_cache.py``) a block a lookahead selection admits may not be
resident: its bytes must be read from the remote tier (a prefill or memory worker) before the
step's tail copies it into HBM. The per-layer order is prediction -> selection -> remote fetch ->
local fetch. Inside a CUDA graph the selections are made on the device, so the host learns them
from the device: as the capture makes each layer's copy list it *publishes* the list's block ids
(``publish``: one small kernel on the select stream writes them into pinned host memory, then
raises the layer's flag, ``kernels/publish.py``). While the replay runs, the host (``advance``,
called once the step and its sampling are launched, before the wait for its tokens) takes the
layers in order as their flags rise and starts their reads at once (``HostCache.start_reads``):
the misses of every request at the layers whose flags are up, coalesced into one transfer per
source (one layer's when the host keeps up with the replay, several when a small model's layers
outrun the host's work per transfer). A layer's reads so overlap the layers after it, the sampling
and the host's work up to the tail; ``LookaheadRetrieval.finish`` then takes any layer not started
yet, waits ``stall_s`` at most for what is still in flight, defers the copies whose blocks are not
there yet and launches the tail. The blocks earlier layers of the step want are kept from
eviction; a block only a later layer wants may be evicted by an earlier one's reads and read
again: the price of starting before every layer's selection is known.

Order with the store: a read may land in a row that held another block, so no device copy out of
the store may still run when it starts. While a replay runs those are the copies on the copy
stream launched before it: the previous step's tail, or an eager step's copies (the replay copies
nothing out of the store itself: its copies are its own tail, launched after it, and deferred
copies run on the foreground before it), so ``advance`` waits for the copy stream
(``copies_done``) before its first read, instead of synchronizing the device (which would wait
for the replay). The row table reaches the device at ``finish``, behind the replay.

Flags: the host clears them (``arm``) before each replay, when no publish is in flight (the last
replay's tokens were read, and a captured step ends with its side streams joined).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from oasiskv.kernels.dispatch import kernel
from oasiskv.kv.host_cache import HostCache

_POLL_S = 50e-6  # between two looks at a flag that has not risen


class RemoteFetch:
    def __init__(self, num_layers: int, max_items: int, device: torch.device):
        """Room for ``max_items`` block ids per layer (a copy list's first row), pinned with a
        CUDA ``device``."""
        self.num_layers = num_layers
        pin = device.type == "cuda"
        self.ids = torch.full((num_layers, max_items), -1, dtype=torch.long, pin_memory=pin)
        self.flags = torch.zeros((num_layers, 1), dtype=torch.int32, pin_memory=pin)
        self._ids_np, self._flags_np = self.ids.numpy(), self.flags.numpy()[:, 0]
        self._publish = kernel("publish", device.type == "cuda")
        self._items = 0  # the replayed bucket's ids per layer
        self._next = num_layers  # the next layer to start (num_layers: none armed)
        #: block -> mask of the layers this step wants it at; the blocks themselves (``keep``)
        self.want: dict[int, int] = {}
        self._keep: set[int] = set()
        self.early_layers = 0  # layers started while their replay still ran, since start
        if device.type == "cuda":  # (compiled now, not first inside a capture)
            self._publish(torch.full((1,), -1, dtype=torch.long, device=device), self.ids[0],
                          self.flags[0])
            torch.cuda.synchronize(device)
            self._flags_np[:] = 0

    def publish(self, layer: int, ids: torch.Tensor) -> None:
        """Inside a capture, on the stream that wrote them: ``layer``'s copy-list block ids
        ``[M]`` to the host, then its flag."""
        self._publish(ids, self.ids[layer], self.flags[layer])

    def arm(self, items: int) -> None:
        """Before a replay whose copy lists hold ``items`` ids per layer."""
        self._flags_np[:] = 0
        self._items, self._next = items, 0
        self.want, self._keep = {}, set()

    @property
    def armed(self) -> bool:
        """A replay's layers are being (or were) taken: ``finish`` reads ``want`` and ``ids_of``."""
        return self._items > 0

    def ids_of(self, layer: int) -> np.ndarray:
        """``layer``'s published block ids (-1: none) of the armed replay."""
        return self._ids_np[layer, :self._items]

    def advance(self, host: HostCache, copies_done: Callable[[], None],
                replay_done: Callable[[], bool] | None) -> None:
        """Start the reads of the layers whose flags have risen, in layer order, those up at once
        together: until every layer is started, or (``replay_done`` given: while the replay runs)
        until the replay is done with a flag still down (its publish never ran: ``finish`` takes
        that layer). ``copies_done`` waits for the device copies out of the store, once, before
        the first read; a batch of layers started while the replay still runs is early."""
        waited = False
        while self._next < self.num_layers:
            first = ready = self._next
            while ready < self.num_layers and self._flags_np[ready]:
                ready += 1
            if ready == first:
                if replay_done is None:
                    raise RuntimeError(f"layer {first}'s selection was never published")
                if not replay_done():
                    time.sleep(_POLL_S)
                elif not self._flags_np[first]:  # (it would have risen before the replay ended)
                    return
                continue
            early = replay_done is not None and not replay_done()
            want: dict[int, int] = {}
            for layer in range(first, ready):
                ids = self.ids_of(layer)
                bit = 1 << layer
                for b in np.unique(ids[ids >= 0]).tolist():
                    want[b] = want.get(b, 0) | bit
            if want:
                if not waited:
                    copies_done()
                    waited = True
                for b, mask in want.items():
                    self.want[b] = self.want.get(b, 0) | mask
                self._keep.update(want)
                host.start_reads(want, self._keep, early)
            self.early_layers += (ready - first) * early
            self._next = ready

    def disarm(self) -> None:
        """The step's tail is launched: nothing is armed until the next ``arm``."""
        self._items, self._next = 0, self.num_layers
        self.want, self._keep = {}, set()
