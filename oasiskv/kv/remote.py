"""The remote memory tier's transport: one-sided NIXL reads of KV blocks from another process's
host store.

A worker that keeps prompt KV (a prefill or memory worker) serves its ``HostStore`` with a
``RemoteStore``: its K and V (and 8-bit row scales) tensors are registered with a NIXL agent (UCX),
and ``descriptor()`` is what a reader needs to reach them (the agent's metadata, each region's
address and size, the layout). A decode worker's ``RemoteReader`` connects to such descriptors and
copies units of KV into a host store of its own (its decode-host cache) with one-sided READs: the
serving process's CPU does no work per read. A unit is one block at one layer (all kv heads: the
``[Hk, B, D]`` slice, contiguous in the ``[blocks, L, Hk, B, D]`` layout) or a whole block (every
layer); ``read`` turns any number of units into one NIXL transfer (K, V and scales descriptors
side by side), so the misses of a layer across requests cost one transfer. Every transfer has a
deadline: ``Transfer.wait`` raises ``TimeoutError`` past it (a stopped or slow peer) and
``RemoteReadError`` when the transfer fails (a dead peer, NIXL's own errors), and cancels it
either way; until NIXL agrees to the cancel (``Transfer.settled``) its destination may still be
written. A reader given an emulated latency (``latency_s``) sees no transfer complete sooner than
that after its start: a slower link on one host, where UCX reads a peer's memory directly and a
read is mostly complete by its first poll. A descriptor is JSON (data only). A reader
counts what it moves (``ReadStats``: transfers, bytes, units, failures and each completed
transfer's latency) for /metrics.

NIXL is an optional dependency (``pip install 'oasiskv[pd]'``, the ``nixl-cu13`` wheel): this
module imports it only when a store or reader is built. ``UCX_MODULES=^ib`` is set unless already
set: where system InfiniBand providers exist but no device, UCX's ib module crashes at exit.
"""
from __future__ import annotations

import base64
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from oasiskv.kv.host_store import HostStore


class RemoteReadError(RuntimeError):
    """A remote read failed (its peer died or refused it)."""


#: completed transfers whose latency ``ReadStats`` keeps
LATENCIES_KEPT = 4096


@dataclass
class ReadStats:
    """What a ``RemoteReader`` has moved: transfers started, bytes and units they read (all
    regions: K, V and 8-bit row scales), transfers that failed or timed out, and the seconds each
    of the latest ``LATENCIES_KEPT`` completed transfers took from its start (a reader lives as
    long as its server: the list must not grow with every transfer)."""
    transfers: int = 0
    bytes: int = 0
    units: int = 0
    failed: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))


def _nixl():
    os.environ.setdefault("UCX_MODULES", "^ib")
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ImportError("the remote KV tier needs NIXL: pip install 'oasiskv[pd]' "
                          f"(the nixl-cu13 wheel): {exc}") from None
    return nixl_agent, nixl_agent_config


def _unit_bytes(t: torch.Tensor, whole: bool) -> int:
    """Bytes of one unit of region ``t`` ``[blocks, L, ...]``: one block at one layer, or a whole
    block."""
    per_layer = t[0, 0].numel() * t.element_size()
    return per_layer * (t.shape[1] if whole else 1)


@dataclass(frozen=True)
class _Peer:
    addrs: tuple[int, ...]  # base address of each region
    num_blocks: int
    summary_addrs: tuple[int, ...] = ()  # of its summary mirror's regions (none: no mirror)
    summary_blocks: int = 0


def _units(src_blocks, dst_rows, src_end: int, dst_end: int,
           where: str) -> tuple[np.ndarray, np.ndarray]:
    """A read's source blocks and destination rows as uint64 arrays, checked: equal-length,
    non-empty, each in ``[0, src_end)`` / ``[0, dst_end)`` (``ValueError`` naming ``where``)."""
    if min(src_blocks, default=0) < 0 or min(dst_rows, default=0) < 0:
        raise ValueError("negative block id")
    src = np.asarray(src_blocks, dtype=np.uint64)
    dst = np.asarray(dst_rows, dtype=np.uint64)
    if src.shape != dst.shape or src.ndim != 1 or src.size == 0:
        raise ValueError("source blocks and destination rows must be equal-length, non-empty "
                         "lists")
    if int(src.max()) >= src_end or int(dst.max()) >= dst_end:
        raise ValueError(f"block id past the end of {where}")
    return src, dst


def _regions(tensors: list[torch.Tensor]) -> dict:
    return {"addrs": [t.data_ptr() for t in tensors], "shape": list(tensors[0].shape),
            "dtype": str(tensors[0].dtype)}


class RemoteStore:
    """Serves ``store`` to remote readers under the NIXL agent ``name`` (unique among the peers),
    and ``summaries`` (a ``SummaryMirror``: the summaries of blocks it hands off) when given."""

    def __init__(self, store: HostStore, name: str, summaries=None):
        nixl_agent, nixl_agent_config = _nixl()
        self.store, self.name, self.summaries = store, name, summaries
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._registered = self.agent.register_memory(
            store.tensors() + (summaries.tensors() if summaries is not None else []))

    def descriptor(self) -> bytes:
        """What a ``RemoteReader.connect`` needs: JSON bytes (data only, safe to take from any
        channel), the agent's metadata base64."""
        d = {"metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
             "name": self.name, **_regions(self.store.tensors())}
        if self.summaries is not None:
            d["summaries"] = _regions(self.summaries.tensors())
        return json.dumps(d).encode()

    def close(self) -> None:
        self.agent.deregister_memory(self._registered)


class Transfer:
    """One NIXL transfer in flight (``RemoteReader.read``).

    Its destination blocks may still be written until it is ``settled``: completed, failed, or
    cancelled with NIXL's consent. A caller that gives up on it (a deadline) must keep them out of
    use until then (``cancel`` again, or poll ``done``)."""

    def __init__(self, agent, handle, peer: str, deadline: float, stats: ReadStats,
                 latency_s: float = 0.0):
        """``latency_s``: it is not seen complete sooner than that after now (an emulated
        latency: its bytes may land sooner)."""
        self._agent, self._handle, self.peer, self.deadline = agent, handle, peer, deadline
        self._stats, self._start = stats, time.monotonic()
        self.ready_at = self._start + latency_s  #: (monotonic s) not seen complete before
        self._failed = False

    @property
    def settled(self) -> bool:
        """Nothing more will be written into the destination."""
        return self._handle is None

    def done(self) -> bool:
        """Whether it completed (and ``ready_at`` passed); raises ``RemoteReadError`` if it failed
        (NIXL's own errors too, e.g. its peer removed)."""
        if self._handle is None:
            if self._failed:
                raise RemoteReadError(f"a read from {self.peer} failed")
            return True
        try:
            state = self._agent.check_xfer_state(self._handle)
        except Exception as exc:  # noqa: BLE001 (NIXL's error types)
            state, why = "ERR", f": {type(exc).__name__}: {exc}"
        else:
            why = ""
        if state == "ERR":
            self._fail()
            raise RemoteReadError(f"a read from {self.peer} failed{why}")
        if state == "DONE" and time.monotonic() >= self.ready_at:
            self.cancel()  # (releases the finished handle)
            self._stats.latencies.append(time.monotonic() - self._start)
            return True
        return False

    def cancel(self) -> bool:
        """Release the transfer (aborting it if still running); whether it is ``settled`` now
        (NIXL may refuse to abort a transfer in flight: then it keeps running)."""
        if self._handle is not None:
            try:
                self._agent.release_xfer_handle(self._handle)
            except Exception:  # noqa: BLE001 (NIXL refuses: still in flight)
                return False
            self._handle = None
        return True

    def check_deadline(self) -> None:
        """Past its deadline: cancel it, count it failed, raise ``TimeoutError``; for callers
        that poll ``done`` themselves (e.g. from an event loop)."""
        if self._handle is not None and time.monotonic() > self.deadline:
            self._fail()
            raise TimeoutError(f"a read from {self.peer} did not complete in time")

    def wait(self) -> None:
        """Until it completes; ``TimeoutError`` past its deadline, ``RemoteReadError`` on
        failure."""
        while not self.done():
            self.check_deadline()
            time.sleep(0)

    def _fail(self) -> None:
        if not self._failed:
            self._failed = True
            self._stats.failed += 1
        self.cancel()


class RemoteReader:
    """Reads units of KV from ``RemoteStore`` peers into ``local`` (same layout, its own block
    ids), as NIXL agent ``name``; with ``summaries`` (a ``SummaryMirror``, its staging rows) also
    the summaries a peer's mirror holds (``read_summaries``). ``latency_s``: no transfer is seen
    complete sooner than that after its start (an emulated slower link, for tests and benchmarks);
    below ``timeout_s``."""

    def __init__(self, local: HostStore, name: str, timeout_s: float = 5.0, summaries=None,
                 latency_s: float = 0.0):
        nixl_agent, nixl_agent_config = _nixl()
        self.local, self.name, self.timeout_s, self.latency_s = local, name, timeout_s, latency_s
        self.summaries = summaries
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._registered = self.agent.register_memory(
            local.tensors() + (summaries.tensors() if summaries is not None else []))
        self.peers: dict[str, _Peer] = {}
        self.stats = ReadStats()

    def connect(self, descriptor: bytes) -> str:
        """Add a peer from its ``RemoteStore.descriptor()`` (once: a known peer's name comes back
        as it is); returns its name. Its layout must be the local store's but for the number of
        blocks."""
        try:
            d = json.loads(descriptor)
            metadata = base64.b64decode(d["metadata"])
            addrs, shape = [int(a) for a in d["addrs"]], [int(s) for s in d["shape"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a KV store descriptor: {type(exc).__name__}: {exc}") from None
        if tuple(shape[1:]) != tuple(self.local.k.shape[1:]) or (
                d["dtype"] != str(self.local.k.dtype)):
            raise ValueError(f"peer {d['name']} stores {d['dtype']} {tuple(d['shape'])}, this "
                             f"reader {self.local.k.dtype} {tuple(self.local.k.shape)}")
        if len(addrs) != len(self.local.tensors()):
            raise ValueError(f"peer {d.get('name')} has {len(addrs)} regions, this reader "
                             f"{len(self.local.tensors())} (8-bit row scales on one side only?)")
        summary_addrs, summary_blocks = (), 0
        if self.summaries is not None and "summaries" in d:
            s, mine = d["summaries"], self.summaries.tensors()
            try:
                summary_addrs = tuple(int(a) for a in s["addrs"])
                summary_shape = [int(n) for n in s["shape"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"not a summary descriptor: {type(exc).__name__}: {exc}") \
                    from None
            if (len(summary_addrs) != len(mine) or s.get("dtype") != str(mine[0].dtype)
                    or list(summary_shape[1:]) != list(mine[0].shape[1:])):
                raise ValueError(f"peer {d['name']} keeps summaries as {s.get('dtype')} "
                                 f"{summary_shape}, this reader {mine[0].dtype} "
                                 f"{tuple(mine[0].shape)}")
            summary_blocks = summary_shape[0]
        if d.get("name") in self.peers:
            return d["name"]
        name = self.agent.add_remote_agent(metadata)
        self.peers[name] = _Peer(tuple(addrs), shape[0], summary_addrs, summary_blocks)
        return name

    def disconnect(self, peer: str) -> None:
        self.agent.remove_remote_agent(peer)
        del self.peers[peer]

    def read(self, peer: str, src_blocks, dst_blocks, layer=None) -> Transfer:
        """Start copying blocks ``src_blocks`` of ``peer`` into rows ``dst_blocks`` of the local
        store (``HostStore.rows_of`` of its block ids; equal-length sequences), as one transfer:
        whole (``layer=None``), at one ``layer``, or at a layer per unit (a sequence; -1: that
        unit's whole block)."""
        info = self.peers[peer]
        src, dst = _units(src_blocks, dst_blocks, info.num_blocks, self.local.k.shape[0],
                          "a store")
        layers = np.broadcast_to(np.asarray(-1 if layer is None else layer, dtype=np.int64),
                                 src.shape)
        if int(layers.max()) >= self.local.k.shape[1]:
            raise ValueError("layer past the last")
        return self._start(peer, self.local.tensors(), info.addrs, src, dst, layers)

    def read_summaries(self, peer: str, src_blocks, dst_rows) -> Transfer:
        """Start copying the summaries of blocks ``src_blocks`` of ``peer``'s summary mirror into
        rows ``dst_rows`` of this reader's ``summaries`` (whole blocks: every layer), as one
        transfer."""
        info = self.peers[peer]
        if self.summaries is None or not info.summary_addrs:
            raise ValueError(f"no summaries to read from {peer} (a peer or this reader without "
                             "a summary mirror)")
        src, dst = _units(src_blocks, dst_rows, info.summary_blocks, self.summaries.num_rows,
                          "a summary mirror")
        return self._start(peer, self.summaries.tensors(), info.summary_addrs, src, dst,
                           np.full(src.shape, -1, dtype=np.int64))

    def _start(self, peer: str, tensors: list[torch.Tensor], addrs: tuple[int, ...],
               src: np.ndarray, dst: np.ndarray, layers: np.ndarray) -> Transfer:
        """One transfer of units (block ``src[i]`` -> row ``dst[i]``, at layer ``layers[i]``, -1:
        the whole block) of every region ``tensors`` (here) / ``addrs`` (there)."""
        whole = layers < 0
        local, remote, nbytes = [], [], 0
        for t, base in zip(tensors, addrs):
            block, per_layer = _unit_bytes(t, True), _unit_bytes(t, False)
            size = np.where(whole, block, per_layer).astype(np.uint64)
            offset = np.where(whole, 0, layers * per_layer).astype(np.uint64)
            nbytes += int(size.sum())
            for blocks, start, out in ((src, base, remote), (dst, t.data_ptr(), local)):
                rows = np.empty((blocks.size, 3), dtype=np.uint64)
                rows[:, 0] = start + blocks * block + offset
                rows[:, 1], rows[:, 2] = size, 0
                out.append(rows)
        handle = None
        try:
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(np.concatenate(local), "DRAM"),
                self.agent.get_xfer_descs(np.concatenate(remote), "DRAM"), peer)
            state = self.agent.transfer(handle)
        except Exception as exc:  # NIXL's own errors (a disconnected peer, ...)
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            self.stats.failed += 1
            raise RemoteReadError(f"a read from {peer} failed: {type(exc).__name__}: {exc}") \
                from None
        self.stats.transfers += 1
        self.stats.bytes += nbytes
        self.stats.units += int(src.size)
        transfer = Transfer(self.agent, handle, peer, time.monotonic() + self.timeout_s,
                            self.stats, self.latency_s)
        if state == "ERR":
            transfer.done()
        return transfer

    def close(self) -> None:
        for peer in list(self.peers):
            self.disconnect(peer)
        self.agent.deregister_memory(self._registered)
