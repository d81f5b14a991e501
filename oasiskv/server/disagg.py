"""Disaggregated prefill and decode: ``oasiskv serve --role prefill``, ``--role decode`` and
``--role memory``.

Every role runs the tiered KV path (``--kv-mode oasis``) with the same model and KV flags; the
prompt KV moves between their host stores over NIXL (UCX, one-sided READs of registered host memory,
``kv/remote.py``), the control messages over HTTP. Transfer mode ``full`` (``--pd-transfer full``):
the decode worker copies every complete prompt block it does not already hold before it admits the
request. Transfer mode ``partial`` (a decode worker with ``--f-host`` < 1): the prefill worker hands
the prompt off (``engine/handoff.py``): it runs the whole prompt and holds every block of it; the
decode worker reads only the last token's block and the summaries of the complete blocks it lacks
(NIXL: a prefill worker keeps them in a ``SummaryMirror`` registered with its agent), takes the
last token's final hidden state and per-layer queries (in the HTTP answer), locates the other
blocks on the prefill worker and admits the request without a forward: each
layer's working set is seeded from the queries (the selected (block, layer) units read in one NIXL
transfer), the first token sampled from the hidden state; later selections read what they want.

A **prefill worker** registers its host store with a NIXL agent and serves, under ``/v1`` (behind
the API key when one is set):

- ``GET /v1/kv/descriptor``: what a reader needs to connect (NIXL metadata, region addresses, the
  store's layout), base64.
- ``POST /v1/kv/prefill`` ``{"prompt_token_ids": [...]}``: prefills the prompt (as a one-token
  greedy request, whose token is dropped), then holds the host blocks of its complete prefix for
  ``lease_s`` seconds and answers ``{"lease": id, "blocks": [host block ids, in chain order]}``.
  With ``"summaries_from": i`` it hands the prompt off: ``blocks`` are every block of the prompt
  (the last token's last), the summaries of its complete blocks from ``i`` on wait in those
  blocks' rows of its summary mirror (the descriptor names its regions), and ``"handoff"`` holds
  ``hidden`` and ``queries``, each ``{"dtype", "shape", "data": base64}``, and
  ``summaries_from``.
- ``POST /v1/kv/release`` ``{"lease": id}``: lets them go (an expired lease goes by itself);
  ``POST /v1/kv/renew`` ``{"lease": id}`` holds them ``lease_s`` seconds more (the answer to a
  prefill names ``lease_s``).

At most ``--max-waiting`` leases are held at once (503 beyond). It serves the OpenAI routes too.

Between leases the blocks stay in its host store as cached prefix blocks (LRU), so a later prompt
with the same prefix prefills only the rest there too.

With ``--memory-url URL`` (repeatable) a prefill worker whose host store runs short (fewer than
``--offload-below-blocks`` free blocks once a prompt's blocks are held; default: one prompt of the
longest length) **offloads** them: it asks the memory worker with the fewest requests in flight to
take them, lets its own go, and answers ``{"lease", "blocks", "worker": the memory worker's URL}``;
if no memory worker takes them all it keeps them and answers as before. A memory worker that
fails is skipped for ``PROBE_S`` seconds, here and by decode workers (which then prefill the
prompts whose KV it holds themselves).

A **memory worker** holds prompt KV for decode workers as a prefill worker does (the same
``descriptor`` and ``release``), but never prefills: ``POST /v1/kv/offload`` ``{"descriptor",
"blocks", "prompt_token_ids"}`` reads those blocks from the offloading worker's store (one NIXL
transfer, with a deadline) into its own, names them by their hashes and holds them under a lease
(400 for a bad descriptor or block ids, 503 when full, 502 when the read fails). Released blocks
stay cached, so a prompt that shares a prefix with one offloaded before reads only the rest. ``POST
/v1/kv/lookup`` ``{"prompt_token_ids"}`` holds the longest leading run of a prompt's complete
blocks it has under a lease (``{"lease": null, "blocks": []}`` when none): before prefilling a
prompt, a prefill worker with memory workers asks them, and reads the prefix from the first that
holds more of it than its own prefix cache, so it prefills only the rest (a failure there costs
only that prefill). It runs no model (``create_memory_app``): the model's ``config.json`` gives
the layout, no weights are read, no device memory is taken, no summaries are kept (whoever imports
its blocks writes their own) and no completions are served (404); every block of its store may be
held under leases.

A **decode worker** (``--prefill-url URL``, repeatable) is the OpenAI front end. For each prompt,
after tokenizing and checking it and before the engine sees it, it counts the prompt's complete
blocks its own prefix cache does not hold: at most ``--local-prefill-blocks`` (default 0: none),
and the engine prefills the prompt here (a repeated prompt, or the next turn of a chat whose
earlier turns this worker decoded: their blocks are cached here, not on any prefill worker). Else
it asks the prefill worker with the fewest prompts in flight to prefill it, holds a host block per
offered block (the one it already has under the same block hash, a prefix it has seen, or a fresh
one), reads the missing blocks from the worker that holds them (that prefill worker, or the memory
worker it offloaded them to) in one NIXL transfer with a deadline, writes their summaries, names
them in its prefix cache and releases the lease; the request then prefills only the last partial
block. A prefill worker that cannot be reached (or whose read fails or times out) is marked down
and the prompt goes to the next one (a memory worker's failure marks nobody down: the engine
prefills that prompt here); a down worker is probed on ``/health`` every
``PROBE_S`` seconds and used again once it answers. With no worker left the request gets HTTP 503.
With ``--f-host F`` < 1 the decode worker's host store is a **decode-host cache**
(``kv/host_cache.py``): it answers for ``1 / F`` times as many host blocks as it has rows, keeps
each imported block's location (the worker URL, its block id there, the lease) and keeps the lease
instead of releasing it (renewed with ``POST /v1/kv/renew`` every ``RENEW_S`` seconds). Every
``LRU_PERIOD`` decode steps an LRU pass brings each running request down to ``F * P + F_gen``
resident blocks (prompt blocks only, never one a working set holds); a block a selection wants
that is not resident is read again, only at the layers selections want it (one NIXL transfer
per worker, on the engine thread, before the step's copies into HBM; a step waits
``--remote-stall-ms`` at most, then the requests still waiting for their blocks sit out steps until
they land). A lease is released once no
block names it (its requests ended, or ``IMPORT_GRACE_S`` seconds after the import when its
request never took the blocks: failed first, or still queued). A failed read ends the requests
whose blocks it was reading, with an error; the others go on. A lease a worker no longer knows
(a refused renewal, renewals failing until less than ``--remote-timeout`` of it might be left, or
the worker restarted: its NIXL agent changed) is *lost*:
the blocks it kept are not read from there again, and requests that need one of them end with an
error.
Every wait has a deadline: an HTTP connection or control message and a NIXL read
``--remote-timeout``, a prefill answer ``--prefill-timeout``; a prompt waiting for its KV never
holds up the engine, which keeps stepping the others. Requests already admitted never depend on a
prefill worker again (their KV is local), so its failure ends no running request. With
``--emulated-read-latency-ms`` (tests, benchmarks) a decode worker sees none of its NIXL reads
complete sooner than that after its start, as over a slower link than one host's shared memory
(where a read is mostly complete by its first poll), so that its decode-host cache's reads take
longer than a step waits for them (a shorter ``--remote-stall-ms``).

A decode worker keeps every byte it reads over NIXL (admission reads of either transfer mode and
the decode-host cache's reads; completed transfers, as the byte counters below count them) on a
bandwidth timeline (``kv/timeline.py``: 10 ms bins, the last hour), each transfer's bytes spread
over the time from its start to when its completion was seen; ``GET
/v1/kv/timeline?start=S&end=E`` (under ``/v1``) answers the bins between two times of its
monotonic clock (``now`` in every answer: ask once without ``start`` to learn it), from which a
benchmark takes the link's mean and 99th-percentile rate over its load.

/metrics (decode worker, each labelled ``worker`` = the URL of the worker read from, or for the
prefill histogram asked):
``oasiskv_pd_admission_bytes`` (bytes moved at admission; ``oasiskv_pd_handoff_bytes`` those of
them a handoff's HTTP answer carried), ``oasiskv_pd_blocks_imported`` /
``oasiskv_pd_blocks_reused`` (read, or already held), ``oasiskv_pd_remote_reads`` /
``oasiskv_pd_remote_read_failures`` (NIXL transfers), ``oasiskv_pd_remote_read_seconds`` and
``oasiskv_pd_remote_prefill_seconds`` (histograms: a read, a prefill worker's answer), and
``oasiskv_pd_prefill_worker_up{url}``; unlabelled, ``oasiskv_pd_local_prefills`` (prompts
prefilled here); (prefill and memory worker) ``oasiskv_pd_leases`` and
``oasiskv_pd_blocks_exported``; (prefill worker) ``oasiskv_pd_blocks_offloaded{worker}`` and
``oasiskv_pd_prefix_blocks_fetched{worker}``; (memory worker) ``oasiskv_pd_blocks_stored`` /
``oasiskv_pd_blocks_kept`` (read from an offloading worker, or already held) and
``oasiskv_pd_store_blocks_total`` / ``_free`` / ``_cached``; (decode worker with
``--f-host`` < 1) ``oasiskv_pd_cache_hits`` / ``_misses`` / ``_evictions`` (blocks),
``oasiskv_pd_cache_deferred_reads`` and
``oasiskv_pd_cache_rows_in_use`` / ``_rows``, and per worker ``oasiskv_pd_cache_reads``,
``_read_bytes``, ``_read_failures`` and the ``oasiskv_pd_cache_read_seconds`` histogram.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field

import httpx
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.engine.handoff import Handoff
from oasiskv.engine.model_runner import resolve_device, resolve_dtype
from oasiskv.kv.exchange import Import, KVExchange, NoRoom
from oasiskv.kv.host_cache import HostCache
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.remote import RemoteReader, RemoteReadError, RemoteStore, Transfer
from oasiskv.kv.summaries import SummaryMirror
from oasiskv.kv.timeline import ByteTimeline
from oasiskv.kv.tiered import configured_host_blocks
from oasiskv.models.loader import resolve_model_path
from oasiskv.sampling_params import SamplingParams
from oasiskv.server.async_engine import AsyncEngine
from oasiskv.server.errors import APIError

logger = logging.getLogger(__name__)
#: seconds, the buckets of remote-read latency histograms: about 1.5x apart from 0.2 ms to 0.25 s,
#: so that a p99 read off a bucket bound tells reads of a few milliseconds apart
_READ_BUCKETS = (0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

#: seconds between two /health probes of a prefill worker marked down
PROBE_S = 2.0
#: seconds between two renewals of a lease the decode-host cache keeps (at most a quarter of the
#: lease's length, which the worker's answer names)
RENEW_S = 10.0
#: seconds an imported block may wait for the request it was imported for (queued, or failed
#: before the engine took it) before the decode-host cache lets its location and lease go
IMPORT_GRACE_S = 60.0
_POLL_S = 0.0005  # between two polls of a NIXL transfer in flight

#: the tensor dtypes a handoff's answer may carry (model dtypes, 8-bit summaries, their scales)
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                               torch.int8)}


def _pack(t: torch.Tensor) -> dict:
    """A CPU tensor as JSON data (``_unpack`` reads it back)."""
    t = t.contiguous()
    return {"dtype": str(t.dtype), "shape": list(t.shape),
            "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode()}


def _unpack(d: dict) -> torch.Tensor:
    """``_pack``'s tensor; ``ValueError`` for anything else."""
    try:
        dtype, shape = _DTYPES[d["dtype"]], [int(s) for s in d["shape"]]
        data = bytearray(base64.b64decode(d["data"], validate=True))
        if not data:  # (frombuffer refuses an empty buffer)
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"not a packed tensor: {type(exc).__name__}: {exc}") from None


async def _completed(transfer: Transfer) -> None:
    """Poll a transfer from the event loop until it completes; raises as ``Transfer.wait``."""
    while not transfer.done():
        transfer.check_deadline()
        await asyncio.sleep(_POLL_S)


async def _settled(transfer: Transfer, within_s: float) -> bool:
    """Wait until a failed transfer can write no more into its destination (cancelled with
    NIXL's consent, or ended); False when it has not ``within_s`` seconds later."""
    deadline = time.monotonic() + within_s
    while not transfer.settled:
        try:
            transfer.done()
        except RemoteReadError:
            pass
        if not transfer.settled and not transfer.cancel():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
    return True


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _exchange(bridge: AsyncEngine) -> KVExchange:
    engine = bridge.engine
    if engine.config.tensor_parallel_size > 1:
        raise ValueError("--role prefill / decode run one rank "
                         "(--tensor-parallel-size 1)")
    return KVExchange(engine.runner.backend)


def _agent_name(role: str) -> str:
    return f"oasiskv-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def _connect(client: httpx.AsyncClient, reader: RemoteReader, worker: _Worker) -> str:
    """``worker.peer``, else connect ``reader`` to the worker's KV store (its
    ``/v1/kv/descriptor``, kept in ``worker.descriptor``) and set it. Raises ``httpx.HTTPError``
    or ``ValueError``."""
    if worker.peer is None:
        resp = await client.get(worker.url + "/v1/kv/descriptor")
        resp.raise_for_status()
        try:
            descriptor = base64.b64decode(resp.json()["descriptor"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{worker.url} sent no KV store descriptor") from exc
        worker.peer, worker.descriptor = reader.connect(descriptor), descriptor
    return worker.peer


async def _release(client: httpx.AsyncClient, url: str, lease: str) -> None:
    """Let go of a lease on the worker at ``url`` (a failure only logs: it expires there)."""
    try:
        await client.post(url + "/v1/kv/release", json={"lease": lease})
    except httpx.HTTPError as exc:
        logger.warning("releasing a lease on %s failed: %s: %s", url, type(exc).__name__, exc)


class _Tasks:
    """Background coroutines a service starts and must see end before it closes."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, timeout_s: float) -> None:
        for task in list(self._tasks):
            await asyncio.wait([task], timeout=timeout_s)


class _Puller:
    """Imports blocks from a peer (``pull``: the one import sequence of every role) and reads the
    missing blocks of an import (``read``) in one NIXL transfer, polled from the event loop until
    the reader's deadline. On any failure the import is given up, once nothing more can land in
    its blocks, and the error raised."""

    def __init__(self, bridge: AsyncEngine, exchange: KVExchange, reader: RemoteReader,
                 timeout_s: float):
        self.bridge, self.exchange, self.reader = bridge, exchange, reader
        self.timeout_s = timeout_s
        self.tasks = _Tasks()

    async def pull(self, peer: str, hashes: list[int], offered: list[int], keep: bool = False,
                   read=None, then=None) -> Import:
        """Import blocks ``offered`` of ``peer`` (its ids of the blocks named ``hashes``): hold a
        block here for each (``begin_import``: ``NoRoom`` when there is no room, nothing held),
        read the missing ones (``read(peer, imp, src)``, default ``self.read``: its errors
        propagate, the import given up), then name them (``finish_import``, which passes the holds
        on with ``keep``) and, in the same engine-thread call, run ``then(imp)``."""
        imp = await self.bridge.call(lambda: self.exchange.begin_import(hashes),
                                     undo=self.exchange.abort_import)
        if imp.missing:
            await (read or self.read)(peer, imp, [offered[i] for i in imp.missing])

        def finish() -> list[int]:
            blocks = self.exchange.finish_import(imp, keep)
            if then is not None:
                then(imp)
            return blocks
        await self.bridge.call(finish, undo=self.exchange.release if keep else None)
        return imp

    async def read(self, peer: str, imp: Import, src: list[int]) -> None:
        """Blocks ``src`` of ``peer`` into the import's missing blocks."""
        try:
            rows = self.exchange.kv.host.rows_of([imp.blocks[i] for i in imp.missing])
            transfer = self.reader.read(peer, src, rows)
        except BaseException:
            await self.bridge.call(lambda: self.exchange.abort_import(imp))
            raise
        try:
            await _completed(transfer)
        except BaseException:
            self.tasks.spawn(self._give_up(transfer, imp))
            raise

    async def _give_up(self, transfer, imp) -> None:
        """Abort an import whose transfer failed or ran late, once the transfer is settled (a
        transfer NIXL could not cancel may still write into the import's blocks); one that never
        settles keeps them held, rather than let them be written after reuse."""
        if not await _settled(transfer, 10 * self.timeout_s):
            logger.error("a failed KV read never settled: %d host blocks stay held",
                         len(imp.blocks))
            return
        try:
            await self.bridge.call(lambda: self.exchange.abort_import(imp))
        except APIError:  # shutting down
            pass

    async def close(self) -> None:
        await self.tasks.wait(self.timeout_s)
        self.reader.close()


class _KVHolder:
    """A worker that serves prompt blocks to readers (a prefill or memory worker): its host store
    registered with a NIXL agent (``descriptor``), each prompt's blocks held under a lease until
    ``release`` (or ``lease_s`` later); at most ``--max-waiting`` leases and prompts on their way
    to one at once (held blocks are host memory)."""

    def __init__(self, bridge: AsyncEngine | StoreBridge, exchange: KVExchange,
                 registry: CollectorRegistry, role: str, lease_s: float = 60.0,
                 summaries: SummaryMirror | None = None):
        self.bridge, self.exchange, self.lease_s = bridge, exchange, lease_s
        self.store = RemoteStore(self.exchange.kv.host, _agent_name(role), summaries)
        self.leases: dict[str, tuple[list[int], float]] = {}  # id -> (held blocks, expiry)
        self._pending = 0  # prompts in flight, each to become a lease
        self._leases = Gauge("oasiskv_pd_leases", "Prompt KV leases held for readers (decode "
                             "workers; prefill workers' prefix lookups)", registry=registry)
        self._exported = Counter("oasiskv_pd_blocks_exported",
                                 "Host blocks offered to readers under leases", registry=registry)
        self._expiry: asyncio.Task | None = None

    def start(self) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self.store.close()

    def descriptor(self) -> dict:
        return {"descriptor": base64.b64encode(self.store.descriptor()).decode()}

    def _check_room(self) -> None:
        held = len(self.leases) + self._pending
        if held >= self.bridge.max_waiting:
            raise APIError(503, f"{held} prompt KV leases are held or on their way (limit "
                                f"{self.bridge.max_waiting}, --max-waiting); retry later",
                           code="overloaded", headers={"Retry-After": "1"})

    def _lease(self, blocks: list[int]) -> dict:
        lease = uuid.uuid4().hex
        self.leases[lease] = (blocks, time.monotonic() + self.lease_s)
        self._leases.set(len(self.leases))
        self._exported.inc(len(blocks))
        # (readers address the registered store by row: a block id is its row except in an
        # emulated store, whose ids share rows)
        return {"lease": lease, "blocks": self.exchange.kv.host.rows_of(blocks),
                "lease_s": self.lease_s}

    def renew(self, lease: str) -> dict:
        """Hold a lease's blocks ``lease_s`` seconds from now (a decode worker whose cache reads
        them again keeps its leases while its requests run)."""
        held = self.leases.get(lease)
        if held is not None:
            self.leases[lease] = (held[0], time.monotonic() + self.lease_s)
        return {"renewed": held is not None}

    async def release(self, lease: str) -> dict:
        held = self.leases.pop(lease, None)
        self._leases.set(len(self.leases))
        if held is not None:
            await self.bridge.call(lambda: self.exchange.release(held[0]))
        return {"released": held is not None}

    async def _sweep(self) -> None:
        """Run every second with the expiry of leases (a role's own letting go)."""

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._sweep()
            except APIError:  # shutting down
                return
            except Exception:  # noqa: BLE001 (the loop must go on)
                logger.exception("a worker's periodic letting go failed")
            now = time.monotonic()
            for lease in [k for k, (_, expiry) in self.leases.items() if expiry < now]:
                logger.warning("prompt KV lease %s expired unreleased", lease)
                try:
                    await self.release(lease)
                except APIError:  # shutting down
                    return
                except Exception:  # noqa: BLE001 (the loop must go on)
                    logger.exception("releasing an expired lease failed")


class PrefillService(_KVHolder):
    """The prefill worker's side: prefill (after reading a prefix a memory worker holds), hold (or
    offload to a memory worker), release."""

    def __init__(self, bridge: AsyncEngine, registry: CollectorRegistry,
                 memory_urls: tuple[str, ...] = (), offload_below_blocks: int | None = None,
                 api_key: str | None = None, timeout_s: float = 10.0, lease_s: float = 60.0):
        """``memory_urls``: memory workers to offload prompt blocks to when fewer than
        ``offload_below_blocks`` host blocks would stay free here (default: one prompt of the
        longest length), and to read a prompt's prefix from when they hold more of it than this
        worker's prefix cache."""
        exchange = _exchange(bridge)
        exchange.reserved = bridge.engine.pending_handoff_blocks  # (exports leave them room)
        #: the summaries of the blocks handed off, for decode workers to read (2 rows per block
        #: against the host store's 2 * B)
        self.summaries = SummaryMirror(exchange.kv.layout, exchange.kv.host.k.shape[0])
        super().__init__(bridge, exchange, registry, "prefill", lease_s, self.summaries)
        self.memory = [_Worker(url.rstrip("/")) for url in memory_urls]
        self.puller = None
        if self.memory:
            reader = RemoteReader(self.exchange.kv.host, _agent_name("prefill-reader"), timeout_s)
            self.puller = _Puller(bridge, self.exchange, reader, timeout_s)
        self._tasks = _Tasks()
        block = self.exchange.kv.layout.block_size
        self.offload_below = (offload_below_blocks if offload_below_blocks is not None
                              else -(-bridge.engine.max_model_len // block))
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._offloaded = Counter("oasiskv_pd_blocks_offloaded",
                                  "Host blocks handed to memory workers", ["worker"],
                                  registry=registry)
        self._fetched = Counter("oasiskv_pd_prefix_blocks_fetched",
                                "Prompt prefix blocks read from memory workers instead of "
                                "prefilled", ["worker"], registry=registry)
        for w in self.memory:
            self._offloaded.labels(w.url)
            self._fetched.labels(w.url)

    def start(self) -> None:
        super().start()
        if self.memory:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)

    async def close(self) -> None:
        await self._tasks.wait(self.timeout_s)
        if self._client is not None:
            await self._client.aclose()
        if self.puller is not None:
            await self.puller.close()
        await super().close()

    async def _sweep(self) -> None:  # (handoffs made here that no answer took: their holds go)
        await self.bridge.call(self.bridge.engine.expire_handoffs)

    async def prefill(self, prompt_token_ids: list[int], summaries_from: int | None = None) -> dict:
        """Prefill a prompt and hold its blocks under a lease; with ``summaries_from`` hand it
        off (``_hand_off``)."""
        ids = list(prompt_token_ids)
        self.bridge.check_prompts([ids], 1)
        self._check_room()
        self._pending += 1
        try:
            if self.memory:
                await self._fetch_prefix(ids)
            # a handoff holds every block of its prompt from the end of its prefill on: one is
            # made when the store has room for those and for the handoffs still prefilling (the
            # exchange's ``reserved``), asked as the request is added (else: a full export,
            # bounded the same way)
            need = -(-len(ids) // self.exchange.kv.layout.block_size)
            handle = await self.bridge.submit(
                [ids], [SamplingParams(max_tokens=1, temperature=0.0)], 1,
                hand_off=summaries_from is not None and (
                    lambda: self.exchange.has_room(need)))
            try:
                async for _ in handle.outputs():
                    pass
            finally:
                handle.abort()  # (a no-op once finished)
            if handle.hand_off:
                return await self._hand_off(handle.request_ids[0], len(ids), summaries_from)
            blocks, full = await self.bridge.call(
                lambda: (self.exchange.export(ids),
                         self.exchange.allocator.num_free_blocks < self.offload_below),
                undo=lambda held: self.exchange.release(held[0]))
            if full and blocks and self.memory:
                try:
                    moved = await self._offload(ids, blocks)
                except BaseException:  # (cancelled: the blocks must not stay held)
                    self._tasks.spawn(self._let_go(blocks))
                    raise
                if moved is not None:
                    self._tasks.spawn(self._let_go(blocks))
                    return moved
        finally:
            self._pending -= 1
        return self._lease(blocks)

    async def _hand_off(self, request_id: str, num_tokens: int, first: int) -> dict:
        """The lease on every block of a handed-off prompt, with its handoff: the last token's
        hidden state and queries; the summaries of its complete blocks from ``first`` on wait in
        the summary mirror, in those blocks' rows."""
        complete = num_tokens // self.exchange.kv.layout.block_size
        first = min(first, complete)

        def take():
            handoff = self.bridge.engine.take_handoff(request_id)
            if handoff is None:
                raise APIError(500, "the prompt's prefill ended without its handoff (the request "
                                    "failed)")
            try:
                blocks = handoff.blocks[first:complete]
                if blocks:
                    self.summaries.put(self.exchange.kv.host.rows_of(blocks),
                                       self.exchange.kv.summaries.read(blocks))
            except BaseException:
                self.exchange.release(handoff.blocks)
                raise
            return handoff
        handoff = await self.bridge.call(take,
                                         undo=lambda taken: self.exchange.release(taken.blocks))
        answer = self._lease(handoff.blocks)
        answer["handoff"] = {"hidden": _pack(handoff.hidden), "queries": _pack(handoff.queries),
                             "summaries_from": first}
        return answer

    async def _let_go(self, blocks: list[int]) -> None:
        try:
            await self.bridge.call(lambda: self.exchange.release(blocks))
        except APIError:  # shutting down
            pass

    def _memory_workers(self) -> list[_Worker]:
        """The memory workers to ask, the fewest requests in flight first; one that failed is
        skipped for ``PROBE_S`` seconds (a hung one must not slow every prompt)."""
        return sorted((w for w in self.memory if w.usable()), key=lambda w: w.inflight)

    @staticmethod
    def _failed(worker: _Worker, what: str, exc: BaseException) -> None:
        logger.warning("%s memory worker %s failed (%s: %s); skipped for %.0f s", what,
                       worker.url, type(exc).__name__, exc, PROBE_S)
        worker.mark_down()

    async def _fetch_prefix(self, ids: list[int]) -> None:
        """Read the prompt's leading complete blocks from the first memory worker that holds more
        of them than this worker's prefix cache (a prefix offloaded before), so that the engine
        prefills only the rest. A failure costs only the prefill of those blocks."""
        hashes = self.exchange.prompt_hashes(ids)
        here = len(hashes) - await self.bridge.call(lambda: self.exchange.uncached(hashes))
        if here == len(hashes):
            return
        for worker in self._memory_workers():
            worker.inflight += 1
            lease = None
            try:
                resp = await self._client.post(worker.url + "/v1/kv/lookup",
                                               json={"prompt_token_ids": ids})
                resp.raise_for_status()
                answer = resp.json()
                lease, offered = answer["lease"], [int(b) for b in answer["blocks"]]
                worker.up = True
                if len(offered) <= here:
                    continue
                peer = await _connect(self._client, self.puller.reader, worker)
                try:
                    imp = await self.puller.pull(peer, hashes[:len(offered)], offered)
                except NoRoom as exc:  # no room here for now: prefill them
                    logger.warning("no host blocks to read a prompt's prefix into (%s)", exc)
                    return
                self._fetched.labels(worker.url).inc(len(imp.missing))
                return
            except (httpx.HTTPError, RemoteReadError, TimeoutError, ValueError, KeyError,
                    TypeError) as exc:
                self._failed(worker, "reading a prompt's prefix from", exc)
            finally:
                worker.inflight -= 1
                if lease is not None:
                    self._tasks.spawn(_release(self._client, worker.url, lease))

    async def _offload(self, ids: list[int], blocks: list[int]) -> dict | None:
        """Hand a prompt's held blocks to a memory worker (``_memory_workers`` order): it reads
        them and holds its copy of every one under its own lease. Its answer, with ``worker`` (its
        URL: where the decode worker reads them and releases the lease); None when no memory
        worker took them all (this worker keeps them)."""
        body = {"descriptor": self.descriptor()["descriptor"],
                "blocks": self.exchange.kv.host.rows_of(blocks),
                "prompt_token_ids": ids}
        for worker in self._memory_workers():
            worker.inflight += 1
            try:
                resp = await self._client.post(
                    worker.url + "/v1/kv/offload", json=body,
                    timeout=httpx.Timeout(2 * self.timeout_s, connect=self.timeout_s))
                resp.raise_for_status()
                answer = resp.json()
                held = {"lease": str(answer["lease"]), "blocks": [int(b) for b in answer["blocks"]],
                        "worker": worker.url}
                if len(held["blocks"]) != len(blocks):
                    self._tasks.spawn(_release(self._client, worker.url, held["lease"]))
                    raise ValueError(f"it holds {len(held['blocks'])} of {len(blocks)} blocks")
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                self._failed(worker, "offloading a prompt's KV to", exc)
                continue
            finally:
                worker.inflight -= 1
            worker.up = True
            self._offloaded.labels(worker.url).inc(len(blocks))
            return held
        return None


class StoreBridge:
    """A memory worker's stand-in for the engine thread: nothing but its services touches its
    store's bookkeeping, all of them on the event loop, so ``call`` runs ``fn`` there at once
    (no ``undo``: nothing can cancel it half way)."""

    def __init__(self, max_waiting: int):
        self.max_waiting, self.healthy = max_waiting, True

    async def call(self, fn, undo=None):
        return fn()

    def begin_shutdown(self) -> None:
        self.healthy = False


def memory_store(config: EngineConfig) -> KVExchange:
    """A memory worker's host store and its bookkeeping, with no model or device: the layout
    the other roles store with the same flags (``TieredLayout.of``; the model's ``config.json``
    gives its shape, and ``--dtype`` auto resolves as an engine on this machine would), sized by
    ``--host-kv-gib``."""
    if config.kv_mode != "oasis":
        raise ValueError("--role memory stores the tiered KV's host blocks: --kv-mode oasis")
    cfg = ModelConfig.from_file(resolve_model_path(config.model) / "config.json")
    dtype = resolve_dtype(config.dtype, cfg, resolve_device(config.device))
    layout = TieredLayout.of(config, cfg, dtype)
    host = HostStore(layout, configured_host_blocks(config.tier, layout), pin=False)
    return KVExchange.store_only(layout, host)


class MemoryService(_KVHolder):
    """The memory worker's side: takes the blocks of prompts that prefill workers offload (reads
    them from the prefill worker's store over NIXL into its own) and serves them to decode
    workers under leases, as a prefill worker does. Released blocks stay cached by their hashes
    (LRU), so a prompt that shares a prefix with one offloaded before reads only the rest."""

    def __init__(self, bridge: StoreBridge, exchange: KVExchange, registry: CollectorRegistry,
                 timeout_s: float = 10.0, lease_s: float = 60.0):
        super().__init__(bridge, exchange, registry, "memory", lease_s)
        reader = RemoteReader(self.exchange.kv.host, _agent_name("memory-reader"), timeout_s)
        self.puller = _Puller(bridge, self.exchange, reader, timeout_s)
        self._stored = Counter("oasiskv_pd_blocks_stored",
                               "Host blocks read from prefill workers that offloaded them",
                               registry=registry)
        self._kept = Counter("oasiskv_pd_blocks_kept",
                             "Offloaded host blocks this worker already held (same prefix)",
                             registry=registry)
        blocks = self.exchange.allocator
        Gauge("oasiskv_pd_store_blocks_total", "Host blocks of this worker's store",
              registry=registry).set_function(lambda: blocks.num_total_blocks)
        Gauge("oasiskv_pd_store_blocks_free", "Host blocks no lease or read holds (those "
              "caching a prefix too: handed out again oldest first)",
              registry=registry).set_function(lambda: blocks.num_free_blocks)
        Gauge("oasiskv_pd_store_blocks_cached", "Host blocks named by a prompt prefix hash, "
              "held or not", registry=registry).set_function(lambda: len(blocks.hash_to_block))

    async def close(self) -> None:
        await self.puller.close()
        await super().close()

    async def lookup(self, prompt_token_ids: list[int]) -> dict:
        """Hold the longest leading run of the prompt's complete blocks this worker has under a
        lease: ``{"lease", "blocks"}`` (``{"lease": None, "blocks": []}`` when it has none)."""
        ids = list(prompt_token_ids)
        self._check_room()
        self._pending += 1
        try:
            blocks = await self.bridge.call(lambda: self.exchange.export(ids),
                                            undo=self.exchange.release)
        finally:
            self._pending -= 1
        return self._lease(blocks) if blocks else {"lease": None, "blocks": []}

    async def offload(self, descriptor: str, blocks: list[int],
                      prompt_token_ids: list[int]) -> dict:
        """Read ``blocks`` (the first complete blocks of ``prompt_token_ids``) from the store
        ``descriptor`` names and hold every one under a lease. APIError: 400 for a bad descriptor,
        more blocks than the prompt has or a block id outside that store, 503 when full, 502 when
        the read fails."""
        ids = list(prompt_token_ids)
        hashes = self.exchange.prompt_hashes(ids)
        if len(blocks) > len(hashes):
            raise APIError(400, f"{len(blocks)} blocks offered for a prompt of {len(hashes)} "
                                "complete blocks", param="blocks")
        try:
            peer = self.puller.reader.connect(base64.b64decode(descriptor))
        except ValueError as exc:
            raise APIError(400, f"bad descriptor: {exc}", param="descriptor") from None
        size = self.puller.reader.peers[peer].num_blocks
        if not all(0 <= b < size for b in blocks):
            raise APIError(400, f"a block id outside the offering store's {size} blocks",
                           param="blocks")
        self._check_room()
        self._pending += 1
        try:
            imp = await self.puller.pull(peer, hashes[:len(blocks)], blocks, keep=True)
        except NoRoom as exc:
            raise APIError(503, f"no room for the prompt's KV: {exc}", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        except (RemoteReadError, TimeoutError, ValueError) as exc:
            raise APIError(502, f"reading the offloaded KV failed: {exc}",
                           code="remote_read_failed") from None
        finally:
            self._pending -= 1
        self._stored.inc(len(imp.missing))
        self._kept.inc(len(imp.blocks) - len(imp.missing))
        return self._lease(imp.blocks)


class _Busy(Exception):
    """A prefill worker answered 503 / 429: full for now, not down."""


@dataclass
class _Worker:
    """Another worker this one talks to: whether it is in use, its requests in flight, its NIXL
    peer once connected, and when it was last marked down or probed."""
    url: str
    up: bool = True
    inflight: int = 0
    peer: str | None = None
    descriptor: bytes | None = None  #: its KV store's, once connected
    last_probe: float = field(default=0.0)

    def mark_down(self) -> None:
        """Out of use from now; connect afresh next time (a restarted worker has a new agent;
        the old peer stays known to the reader: other prompts may still be reading from it)."""
        self.up, self.last_probe, self.peer = False, time.monotonic(), None

    def usable(self) -> bool:
        """Up, or down for at least ``PROBE_S`` seconds (then tried again)."""
        return self.up or time.monotonic() - self.last_probe >= PROBE_S


class _Leases:
    """The leases a decode-host cache keeps, by (worker URL, lease id): when each is renewed next
    (every ``RENEW_S`` seconds, at most a quarter of its length), and when it last was, counted
    from when that renewal (or the prefill request) was sent, so that the worker's clock never
    runs ahead of ours. A lease whose renewals keep failing is lost once less than a read's
    deadline (``timeout_s``) of it might be left; one the worker refuses to renew, at once."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.held: dict[tuple[str, str], tuple[float, float, float]] = {}  # next, renewed, length

    def add(self, key: tuple[str, str], sent: float, length: float) -> None:
        self.held[key] = (sent + min(RENEW_S, length / 4), sent, length)

    def drop(self, key: tuple[str, str]) -> None:
        self.held.pop(key, None)

    def due(self, now: float) -> list[tuple[str, str]]:
        return [key for key, (at, _, _) in self.held.items() if at <= now]

    def answered(self, key: tuple[str, str], sent: float, renewed: bool | None,
                 now: float) -> bool:
        """A renewal sent at ``sent`` was answered (``renewed``: the worker's answer, None: no
        answer); whether the lease is lost now (then it is dropped)."""
        held = self.held.get(key)
        if held is None:  # let go meanwhile
            return False
        _, renewed_at, length = held
        if renewed:
            self.add(key, sent, length)
        elif renewed is None and now - renewed_at < length - self.timeout_s:
            self.held[key] = (now + 1.0, renewed_at, length)  # (tried again in a second)
        else:
            del self.held[key]
            return True
        return False


class _CacheRead:
    """One ``_CacheReader`` transfer (``kv.host_cache.PendingRead``), counted when it ends."""

    def __init__(self, owner: "_CacheReader", url: str, transfer: Transfer, start: float,
                 nbytes: int):
        self.owner, self.url, self.transfer, self.start, self.nbytes = (owner, url, transfer,
                                                                        start, nbytes)

    def done(self) -> bool:
        try:
            if not self.transfer.done():
                self.transfer.check_deadline()
                return False
        except BaseException as exc:
            self.owner.failed(self.url, exc, self.transfer)
            raise
        self.owner.landed(self.url, self.start, self.nbytes)
        return True


class _CacheReader:
    """The decode-host cache's remote tier (``kv.host_cache.RemoteTier``): (block, layer) units
    read on the engine thread, in one transfer per worker (``source``: its URL) polled until the
    deadline, with a NIXL agent of its own (the admission reader belongs to the event loop's
    thread); each read counted per worker on /metrics. A worker whose read failed is not tried
    again for ``PROBE_S`` seconds (its reads fail at once: a dead worker must not cost every step
    a deadline)."""

    def __init__(self, host: HostCache, descriptor_of, timeout_s: float,
                 registry: CollectorRegistry, timeline: ByteTimeline, latency_s: float = 0.0):
        self.reader = RemoteReader(host, _agent_name("decode-cache"), timeout_s,
                                   latency_s=latency_s)
        self.descriptor_of, self.timeline = descriptor_of, timeline
        self._failed_at: dict[str, float] = {}  # worker URL -> its last failed read
        by_worker = ["worker"]
        self._reads = Counter("oasiskv_pd_cache_reads", "NIXL transfers of the decode-host "
                              "cache: evicted prompt blocks read again", by_worker,
                              registry=registry)
        self._bytes = Counter("oasiskv_pd_cache_read_bytes", "Bytes the decode-host cache read "
                              "again", by_worker, registry=registry)
        self._failures = Counter("oasiskv_pd_cache_read_failures", "Decode-host cache reads "
                                 "that failed or timed out", by_worker, registry=registry)
        self._latency = Histogram("oasiskv_pd_cache_read_seconds", "A decode-host cache read, "
                                  "from its start to its completion",
                                  by_worker, buckets=_READ_BUCKETS, registry=registry)

    def start(self, source: tuple[str, str], remote_blocks: list[int], rows: list[int],
              layers: list[int]) -> "_CacheRead":
        """``source``: (the worker's URL, its NIXL agent when the blocks were imported: a worker
        that restarted since has none of them)."""
        url, agent = source
        start, moved = time.monotonic(), self.reader.stats.bytes
        self._reads.labels(url).inc()
        self._failures.labels(url)  # (the series shows from the first read on)
        try:
            since = start - self._failed_at.get(url, -PROBE_S)
            if since < PROBE_S:
                raise RemoteReadError(f"a read from {url} failed {since:.1f} s ago")
            if agent not in self.reader.peers:
                descriptor = self.descriptor_of(url)
                if descriptor is None or self.reader.connect(descriptor) != agent:
                    raise RemoteReadError(f"{url} restarted: the KV it held is gone")
            transfer = self.reader.read(agent, remote_blocks, rows, layers)
        except BaseException as exc:
            self.failed(url, exc, None)
            raise
        # (the transport counts a transfer's bytes when it starts)
        return _CacheRead(self, url, transfer, start, self.reader.stats.bytes - moved)

    def failed(self, url: str, exc: BaseException, transfer: Transfer | None) -> None:
        """A read from ``url`` failed: counted, the worker not tried for ``PROBE_S`` seconds,
        ``exc.unsettled`` set (the transfer may still write)."""
        self._failures.labels(url).inc()
        self._failed_at[url] = time.monotonic()
        exc.unsettled = transfer is not None and not transfer.settled

    def landed(self, url: str, start: float, nbytes: int) -> None:
        end = time.monotonic()
        self._latency.labels(url).observe(end - start)
        self._bytes.labels(url).inc(nbytes)
        self.timeline.add(start, end, nbytes)

    def close(self) -> None:
        self.reader.close()


class _CacheCollector:
    """/metrics of the decode-host cache, read from its counts when scraped."""

    def __init__(self, cache: HostCache):
        self.cache = cache

    def collect(self):
        s = self.cache.stats
        for name, doc, value in (
                ("hits", "Prompt blocks the decode-host cache held when they were read", s.hits),
                ("misses", "Prompt blocks it read again from the remote tier", s.misses),
                ("evictions", "Host rows it took back (LRU)", s.evictions),
                ("overlapped_reads", "Reads started layer by layer while a decode step's graph "
                 "replayed (the remote-fetch stage)", s.early_reads),
                ("deferred_reads", "Reads still running when a step stopped waiting for them "
                 "(--remote-stall-ms): their requests sat out steps", s.deferred)):
            yield CounterMetricFamily(f"oasiskv_pd_cache_{name}", doc, value=value)
        yield GaugeMetricFamily("oasiskv_pd_cache_rows_in_use", "Host rows holding a block",
                                value=self.cache.rows_in_use)
        yield GaugeMetricFamily("oasiskv_pd_cache_rows", "Host rows of the decode-host cache",
                                value=self.cache.num_physical)


class DecodeRouter:
    """The decode worker's side: sends each prompt to a prefill worker and imports its KV."""

    def __init__(self, bridge: AsyncEngine, urls: list[str], registry: CollectorRegistry,
                 api_key: str | None = None, timeout_s: float = 10.0,
                 prefill_timeout_s: float = 300.0, local_prefill_blocks: int = 0,
                 transfer: str = "full", read_latency_s: float = 0.0):
        """``timeout_s``: deadline of a NIXL read and of an HTTP connection or control message;
        ``prefill_timeout_s``: of a prefill worker's answer (it prefills the prompt first); a
        prompt with at most ``local_prefill_blocks`` complete blocks this worker does not hold is
        prefilled here. ``urls``: at least one (``server.api.Disaggregation`` checks the
        flags). ``transfer``: ``full`` or ``partial`` (handoffs: needs a decode-host cache).
        ``read_latency_s``: no NIXL read is seen complete sooner than that after its start (an
        emulated slower link)."""
        self.bridge, self.timeout_s, self.prefill_timeout_s = bridge, timeout_s, prefill_timeout_s
        self.local_prefill_blocks, self.transfer = local_prefill_blocks, transfer
        self.exchange = _exchange(bridge)
        kv = self.exchange.kv
        #: (partial transfer) where a handoff's summaries land, one prompt at a time
        self.staging = (SummaryMirror(kv.layout, -(-bridge.engine.max_model_len
                                                  // kv.layout.block_size))
                        if transfer == "partial" else None)
        self._staging_lock = asyncio.Lock()
        self._staging_broken = False  # a failed read may still write into it: never used again
        reader = RemoteReader(kv.host, _agent_name("decode"), timeout_s, self.staging,
                              read_latency_s)
        self.puller = _Puller(bridge, self.exchange, reader, timeout_s)
        self.workers = [_Worker(url.rstrip("/")) for url in urls]
        self.holders: dict[str, _Worker] = {}  # the memory workers prefill workers named
        host = self.exchange.kv.host
        #: the decode-host cache (``--f-host`` < 1): it reads evicted blocks again from the
        #: worker that holds them, under the lease kept (and renewed) while any block names it
        self.cache = host if isinstance(host, HostCache) else None
        self.leases = _Leases(timeout_s)
        #: every byte read over NIXL (admission, the decode-host cache's reads), per time bin
        self.timeline = ByteTimeline()
        if self.cache is not None:
            self.cache.reader = _CacheReader(self.cache, self._descriptor_of, timeout_s, registry,
                                             self.timeline, read_latency_s)
            registry.register(_CacheCollector(self.cache))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._probe: asyncio.Task | None = None
        self._renewal: asyncio.Task | None = None
        self._tasks = _Tasks()
        by_worker = ["worker"]  # every counter per prefill worker (its URL)
        if transfer == "partial" and self.cache is None:
            raise ValueError("--pd-transfer partial needs a decode-host cache (--f-host < 1)")
        if transfer == "partial" and bridge.engine.driver is not None:
            raise ValueError("--pd-transfer partial takes no tensor-parallel decode worker")
        self._bytes = Counter("oasiskv_pd_admission_bytes",
                              "Bytes moved from prefill or memory workers at admission: prompt KV "
                              "read (full transfer), or a handoff's last block and summaries "
                              "read and its hidden state and queries (partial)",
                              by_worker, registry=registry)
        self._handoff_bytes = Counter("oasiskv_pd_handoff_bytes",
                                      "Of the admission bytes, those of handoffs' HTTP answers "
                                      "(hidden states and queries; partial transfer)",
                                      by_worker, registry=registry)
        self._imported = Counter("oasiskv_pd_blocks_imported",
                                 "Host blocks read from prefill or memory workers", by_worker,
                                 registry=registry)
        self._reused = Counter("oasiskv_pd_blocks_reused",
                               "Offered host blocks this decode host already held (same prefix)",
                               by_worker, registry=registry)
        self._reads = Counter("oasiskv_pd_remote_reads",
                              "NIXL transfers from prefill or memory workers", by_worker,
                              registry=registry)
        self._failures = Counter("oasiskv_pd_remote_read_failures",
                                 "NIXL transfers that failed or timed out", by_worker,
                                 registry=registry)
        self._latency = Histogram("oasiskv_pd_remote_read_seconds",
                                  "A NIXL transfer from its start to its completion", by_worker,
                                  buckets=_READ_BUCKETS, registry=registry)
        self._prefill = Histogram("oasiskv_pd_remote_prefill_seconds",
                                  "A prefill worker's answer: its queue and the prompt's prefill",
                                  by_worker, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                                      5.0, 10.0, 30.0, 60.0), registry=registry)
        self._up = Gauge("oasiskv_pd_prefill_worker_up", "1 while a prefill worker is in use",
                         ["url"], registry=registry)
        self._local = Counter("oasiskv_pd_local_prefills",
                              "Prompts prefilled on this decode worker: at most "
                              "--local-prefill-blocks of their complete blocks were not held here",
                              registry=registry)
        for w in self.workers:  # every series present from the start, at 0
            self._up.labels(w.url).set(1)
            for family in (self._bytes, self._handoff_bytes, self._imported, self._reused,
                           self._reads, self._failures, self._latency, self._prefill):
                family.labels(w.url)

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)
        loop = asyncio.get_running_loop()
        self._probe = loop.create_task(self._probe_loop())
        if self.cache is not None:
            self.cache.on_lease_idle = lambda key: loop.call_soon_threadsafe(self._let_go, key)
            self._renewal = loop.create_task(self._renew_loop())

    async def close(self) -> None:
        for task in (self._probe, self._renewal):
            if task is not None:
                task.cancel()
        await self._tasks.wait(self.timeout_s)
        if self._client is not None:
            await self._client.aclose()
        await self.puller.close()
        if self.cache is not None:
            self.cache.reader.close()

    def timeline_window(self, start: float | None = None, end: float | None = None) -> dict:
        """``GET /v1/kv/timeline``: ``now`` (this server's monotonic clock, which ``start`` and
        ``end`` are in), ``bin_s``, ``kept_s`` and ``bytes_total`` (every byte read over NIXL so
        far); with ``start``, the bins from ``start`` to ``end`` (default: now): ``start`` (the
        first bin's), ``bins`` (bytes each) and ``bytes`` (their sum). ``APIError(400)`` for an
        interval that is not one up to now, or no longer kept."""
        now, t = time.monotonic(), self.timeline
        answer = {"now": now, "bin_s": t.bin_s, "kept_s": t.kept_s, "bytes_total": t.total}
        if start is None:
            return answer
        end = now if end is None else end
        try:
            if not (math.isfinite(start) and math.isfinite(end)):
                raise ValueError("start and end must be finite")
            first, bins = t.window(start, end, now)
        except ValueError as exc:
            raise APIError(400, str(exc), param="start") from None
        return answer | {"start": first, "bins": bins.tolist(), "bytes": float(bins.sum())}

    def _descriptor_of(self, url: str) -> bytes | None:
        """The KV store descriptor of the worker at ``url`` (read from the engine thread)."""
        worker = next((w for w in self.workers if w.url == url), None) or self.holders.get(url)
        return None if worker is None else worker.descriptor

    def _let_go(self, key: tuple[str, str]) -> None:
        """No block of the decode-host cache names lease ``key`` any more: release it."""
        self.leases.drop(key)
        self._tasks.spawn(_release(self._client, *key))

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:  # (blocks no request took: their leases are not renewed for nothing)
                if self.leases.held:  # (else no lease is renewed: nothing to let go of)
                    await self.bridge.call(lambda: self.cache.drop_unused(IMPORT_GRACE_S))
                await self.bridge.call(self.bridge.engine.expire_handoffs)
            except APIError:  # shutting down
                return
            except Exception:  # noqa: BLE001 (the loop must go on)
                logger.exception("letting go of imported blocks no request took failed")
            due = self.leases.due(time.monotonic())
            for key, result in zip(due, await asyncio.gather(
                    *(self._renew(key) for key in due), return_exceptions=True)):
                if isinstance(result, Exception):  # (the loop must go on)
                    logger.error("renewing lease %s failed: %r", key, result)

    async def _renew(self, key: tuple[str, str]) -> None:
        """Renew lease ``key`` (``_Leases.answered`` says what then); a lost one is lost to the
        cache."""
        url, lease = key
        sent = time.monotonic()
        try:
            resp = await self._client.post(url + "/v1/kv/renew", json={"lease": lease})
            resp.raise_for_status()
            renewed = bool(resp.json()["renewed"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("renewing a lease on %s failed: %s", url, exc)
            renewed = None
        if self.leases.answered(key, sent, renewed, time.monotonic()):
            logger.error("lease %s on %s is lost: the decode-host cache reads nothing more under "
                         "it", lease, url)
            try:
                await self.bridge.call(lambda: self.cache.lease_lost(key))
            except APIError:  # shutting down
                pass

    async def admit(self, prompts: list[list[int]]) -> None:
        """Bring in each prompt's complete prefix KV. Raises ``APIError``: 503 when this server
        is already full (before any prefill worker does work for it) or no prefill worker can
        take a prompt, 400 for a prompt a worker refuses, 502 when a worker refuses this server
        (e.g. a wrong API key)."""
        if self.bridge.num_unfinished + len(prompts) > self.bridge.max_waiting:
            raise APIError(503, f"the server is overloaded: {self.bridge.num_unfinished} requests "
                                f"are queued or running (limit {self.bridge.max_waiting}); retry "
                                "later", code="overloaded", headers={"Retry-After": "1"})
        for ids in prompts:
            hashes = self.exchange.prompt_hashes(ids)  # (here: not on the engine thread)
            if not hashes:
                continue  # no complete block to move
            missing = await self.bridge.call(lambda h=hashes: self.exchange.uncached(h))
            if missing <= self.local_prefill_blocks:
                self._local.inc()
                continue
            await self._admit(ids, hashes)

    async def _admit(self, ids: list[int], hashes: list[int]) -> None:
        tried, busy = [], []
        while True:
            worker = min((w for w in self.workers if w.up and w.url not in tried),
                         key=lambda w: w.inflight, default=None)
            if worker is None and busy:
                raise APIError(503, f"every prefill worker is busy ({', '.join(busy)}); retry "
                                    "later", code="overloaded", headers={"Retry-After": "1"})
            if worker is None:
                raise APIError(503, "no prefill worker could take the prompt"
                                    + (f" (tried {', '.join(tried)})" if tried else
                                       " (every one is down)"),
                               code="prefill_unavailable", headers={"Retry-After": "1"})
            tried.append(worker.url)
            worker.inflight += 1
            try:
                await self._admit_from(worker, ids, hashes)
                return
            except _Busy:
                busy.append(worker.url)
            except (httpx.HTTPError, RemoteReadError, TimeoutError, ValueError) as exc:
                self._mark_down(worker, exc)
            finally:
                worker.inflight -= 1

    async def _checked(self, worker: _Worker, resp: httpx.Response) -> dict:
        """A prefill worker's answer as JSON: its 503 / 429 are ``_Busy`` (try another, it is
        not down), its 400 the prompt's fault, another 4xx this server's (``APIError(502)``);
        a 5xx raises ``httpx.HTTPStatusError`` (marked down)."""
        if resp.status_code in (429, 503):
            raise _Busy(worker.url)
        if 400 <= resp.status_code < 500:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:200]
            if resp.status_code == 400:  # the prompt itself (it passed this server's checks)
                raise APIError(400, message, param="prompt")
            logger.error("prefill worker %s refused this server: HTTP %d: %s", worker.url,
                         resp.status_code, message)
            raise APIError(502, f"prefill worker {worker.url} refused this server (HTTP "
                                f"{resp.status_code}: {message})", code="prefill_refused")
        resp.raise_for_status()
        return resp.json()

    async def _admit_from(self, worker: _Worker, ids: list[int], hashes: list[int]) -> None:
        if worker.peer is None:
            d = await self._checked(worker, await self._client.get(worker.url
                                                                   + "/v1/kv/descriptor"))
            worker.descriptor = base64.b64decode(d["descriptor"])
            worker.peer = self.puller.reader.connect(worker.descriptor)
        peer = worker.peer  # (a failure elsewhere may reset the worker's meanwhile)
        start = time.monotonic()
        body = {"prompt_token_ids": ids}
        if self.transfer == "partial":  # summaries of the blocks after those cached here
            body["summaries_from"] = len(hashes) - await self.bridge.call(
                lambda: self.exchange.uncached(hashes))
        answer = await self._checked(worker, await self._client.post(
            worker.url + "/v1/kv/prefill", json=body,
            timeout=httpx.Timeout(self.prefill_timeout_s, connect=self.timeout_s)))
        self._prefill.labels(worker.url).observe(time.monotonic() - start)
        if "handoff" in answer:
            await self._take_handoff(worker, peer, ids, hashes, answer, start)
            return
        lease, offered = answer["lease"], answer["blocks"]
        # the blocks sit on a memory worker when the prefill worker offloaded them; that worker's
        # failure is not the prefill worker's: the engine then prefills the prompt here
        holder = answer.get("worker") or worker.url
        located = False

        def locate(imp: Import) -> None:  # (engine thread) the cache reads them again from there
            nonlocal located
            self.cache.locate(imp.blocks, offered[:len(imp.blocks)], (holder, peer),
                              (holder, lease))
            located = True
        try:
            if holder != worker.url:
                memory = self.holders.setdefault(holder, _Worker(holder))
                if not memory.usable():
                    return  # it failed just now: the engine prefills the prompt
                try:
                    peer = await _connect(self._client, self.puller.reader, memory)
                except (httpx.HTTPError, ValueError) as exc:
                    self._holder_down(memory, exc)
                    return
            try:
                imp = await self.puller.pull(
                    peer, hashes[:len(offered)], offered,
                    read=lambda *args: self._read(holder, *args),
                    then=locate if self.cache is not None else None)
            except NoRoom as exc:  # no room here: the engine prefills the prompt itself
                logger.warning("no host blocks to import a prompt's KV into (%s)", exc)
                return
            except (RemoteReadError, TimeoutError, ValueError) as exc:
                if holder == worker.url:
                    raise
                self._holder_down(self.holders[holder], exc)
                return
            except Exception:  # noqa: BLE001 (naming the blocks failed; APIError: shutting down)
                logger.exception("importing a prompt's KV failed; the engine prefills it")
                return
            self._imported.labels(holder).inc(len(imp.missing))
            self._reused.labels(holder).inc(len(imp.blocks) - len(imp.missing))
        finally:
            if located:  # kept while the cache's blocks name it (``_let_go``)
                # (its clock started after ``start``)
                self.leases.add((holder, lease), start, float(answer.get("lease_s", 60.0)))
            else:
                self._tasks.spawn(_release(self._client, holder, lease))

    async def _take_handoff(self, worker: _Worker, peer: str, ids: list[int], hashes: list[int],
                            answer: dict, start: float) -> None:
        """Partial admission of ``ids`` from ``worker``'s answer: read the last token's block,
        write the summaries, locate the other blocks there (keeping the lease while they name
        it) and give the engine the handoff. A prompt this store has no room for, or whose
        handoff cannot be used, is prefilled here (logged); a failed read raises (the worker is
        marked down)."""
        lease, offered, url = answer["lease"], answer["blocks"], worker.url
        located = False
        try:
            h = answer["handoff"]
            hidden, queries = _unpack(h["hidden"]), _unpack(h["queries"])
            first = int(h["summaries_from"])
            complete = len(ids) // self.exchange.kv.layout.block_size
            if len(offered) != len(hashes) + 1:
                raise ValueError(f"a handoff of {len(ids)} tokens names {len(offered)} blocks")
            try:
                imp = await self.bridge.call(lambda: self.exchange.begin_handoff(hashes),
                                             undo=self.exchange.abort_import)
            except NoRoom as exc:
                logger.warning("no host blocks to take a prompt's handoff into (%s)", exc)
                return
            tail = Import(imp.hashes, imp.blocks, imp.missing[-1:])  # (read only that block)
            await self._read(url, peer, tail, offered[-1:])  # (a failure lets the import go)
            try:
                async with self._staging_lock:
                    if self._staging_broken:
                        raise NoRoom("the summary staging area is out of use")
                    if complete > first:
                        await self._read_summaries(url, peer, offered[first:complete])
                    summaries = self.staging.take(complete - first)
            except BaseException as exc:
                self._tasks.spawn(self._abort(imp))
                if isinstance(exc, NoRoom):
                    logger.warning("a prompt's handoff cannot be used here (%s); the engine "
                                   "prefills it", exc)
                    return
                raise

            def finish() -> Handoff:
                nonlocal located
                blocks = self.exchange.finish_handoff(imp, len(ids), first, summaries)
                handoff = Handoff(hidden, queries, blocks)
                try:
                    self.cache.locate(blocks[:-1], offered[:-1], (url, peer), (url, lease))
                    self.bridge.engine.add_handoff(ids, handoff)
                except BaseException:
                    self.exchange.release(blocks)
                    raise
                located = True
                return handoff
            try:  # (cancelled meanwhile: the handoff goes again, unless taken by then)
                await self.bridge.call(finish, undo=lambda handoff: (
                    self.bridge.engine.scheduler.handoffs.drop(tuple(ids), handoff)))
            except NoRoom as exc:
                logger.warning("a prompt's handoff cannot be used here (%s); the engine "
                               "prefills it", exc)
                return
            carried = _nbytes([hidden, queries])
            self._bytes.labels(url).inc(carried)
            self._handoff_bytes.labels(url).inc(carried)
            self._imported.labels(url).inc(1)
            self._reused.labels(url).inc(len(hashes) + 1 - len(imp.missing))
        finally:
            if located:
                self.leases.add((url, lease), start, float(answer.get("lease_s", 60.0)))
            else:
                self._tasks.spawn(_release(self._client, url, lease))

    @staticmethod
    def _holder_down(memory: _Worker, exc: BaseException) -> None:
        """A memory worker failed: prompts whose KV it holds are prefilled here, for ``PROBE_S``
        seconds without trying it (a hung one must not make every such prompt wait)."""
        logger.warning("memory worker %s failed (%s: %s); the engine prefills the prompts whose "
                       "KV it holds", memory.url, type(exc).__name__, exc)
        memory.mark_down()

    async def _counted(self, url: str, nbytes: int, read: Awaitable[None]) -> None:
        """Await ``read``, one transfer of ``nbytes`` from the worker at ``url``, counted here
        (per worker: the reader's own totals mix the reads other prompts have in flight)."""
        start = time.monotonic()
        self._reads.labels(url).inc()
        try:
            await read
        except BaseException:
            self._failures.labels(url).inc()
            raise
        end = time.monotonic()
        self._latency.labels(url).observe(end - start)
        self._bytes.labels(url).inc(nbytes)
        self.timeline.add(start, end, nbytes)

    async def _read(self, url: str, peer: str, imp: Import, src: list[int]) -> None:
        """Blocks ``src`` of the worker at ``url`` into the import's missing blocks, one
        transfer."""
        await self._counted(url, len(src) * self.exchange.block_bytes,
                            self.puller.read(peer, imp, src))

    async def _read_summaries(self, url: str, peer: str, src: list[int]) -> None:
        """The summaries of blocks ``src`` of the worker at ``url`` (its summary mirror) into
        staging rows ``0 ..`` (the caller holds them), one transfer. A failed read NIXL would not
        cancel may still write them: the staging area is then out of use, and later prompts are
        admitted with full transfer."""
        transfer = None

        async def read() -> None:
            nonlocal transfer
            transfer = self.puller.reader.read_summaries(peer, src, list(range(len(src))))
            await _completed(transfer)
        try:
            await self._counted(url, len(src) * self.exchange.kv.layout.summary_bytes_per_block,
                                read())
        except BaseException:
            if transfer is not None and not transfer.cancel():
                logger.error("a failed summary read could not be cancelled: prompts are admitted "
                             "with full transfer from now on")
                self._staging_broken, self.transfer = True, "full"
            raise

    async def _abort(self, imp: Import) -> None:
        try:
            await self.bridge.call(lambda: self.exchange.abort_import(imp))
        except APIError:  # shutting down
            pass

    def _mark_down(self, worker: _Worker, exc: BaseException) -> None:
        logger.warning("prefill worker %s marked down: %s: %s", worker.url,
                       type(exc).__name__, exc)
        worker.mark_down()
        self._up.labels(worker.url).set(0)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S / 4)
            for w in self.workers:
                if w.up or not w.usable():
                    continue
                w.last_probe = time.monotonic()
                try:
                    if (await self._client.get(w.url + "/health")).status_code == 200:
                        w.up = True
                        self._up.labels(w.url).set(1)
                        logger.info("prefill worker %s is up again", w.url)
                except httpx.HTTPError:
                    pass
                except Exception:  # noqa: BLE001 (the loop must go on)
                    logger.exception("probing prefill worker %s failed", w.url)
