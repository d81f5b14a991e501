"""The remote tier's transport (``kv/remote.py``) with real NIXL agents in separate processes on
loopback: a serving process holds a host store of known contents; this process reads units of it
(one layer of a block, whole blocks, bf16 and FP8 with their scales) into its own store with
one-sided READs and gets exactly those bytes, many units in one transfer (and a handoff's block
summaries from the peer's summary mirror into staging rows); a read from a dead peer
fails with an error instead of hanging. (Not tested here: a slow peer's timeout. Between
processes of one host UCX reads the peer's memory directly: a stopped peer still serves reads.)"""
import multiprocessing as mp
import os
import uuid

import pytest
import torch

nixl = pytest.importorskip("nixl_cu13", reason="the remote tier needs NIXL: pip install "
                           "'oasiskv[pd]' (x86-64 Linux wheels)")

from oasiskv.kernels.fp8 import FP8, INT8, as_bytes  # noqa: E402
from oasiskv.kv.host_store import HostStore  # noqa: E402
from oasiskv.kv.layout import TieredLayout  # noqa: E402
from oasiskv.kv.remote import RemoteReader, RemoteReadError  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 3, 2, 32, 16


def layout(kv: torch.dtype | None) -> TieredLayout:
    """bf16 storage, or ``kv`` (8-bit rows with scales)."""
    return TieredLayout(LAYERS, HEADS, DIM, BLOCK, 4, torch.bfloat16, kv)


def filled(kv: torch.dtype | None, num_blocks: int, seed: int) -> HostStore:
    """A host store whose every byte follows from ``seed``."""
    store = HostStore(layout(kv), num_blocks, pin=False)
    gen = torch.Generator().manual_seed(seed)
    for t in (store.k, store.v, *(store.scales or ())):
        raw = as_bytes(t).view(torch.uint8)
        raw.copy_(torch.randint(0, 0x70, raw.shape, generator=gen, dtype=torch.uint8))
    return store


def serve(kv: torch.dtype | None, num_blocks: int, seed: int, out: mp.Queue,
          stop: mp.Event) -> None:
    from oasiskv.kv.remote import RemoteStore
    store = RemoteStore(filled(kv, num_blocks, seed), f"memory-{os.getpid()}")
    out.put(store.descriptor())
    stop.wait(120)
    store.close()


@pytest.fixture
def peer(request):
    """A serving process (its storage dtype the parameter, ``layout``'s) -> (its descriptor, its
    expected store, the process)."""
    kv = request.param
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(kv, 40, 7, out, stop), daemon=True)
    proc.start()
    try:
        yield out.get(timeout=120), filled(kv, 40, 7), proc
    finally:
        if proc.is_alive():  # (a killed peer may have died holding the event's lock)
            stop.set()
            proc.join(30)
        if proc.is_alive():
            proc.kill()


def units(store: HostStore, blocks, layer=None):
    """The bytes of ``store``'s blocks (at ``layer`` or whole), every region, for comparing."""
    idx = torch.tensor(blocks)
    raw = [as_bytes(t).view(torch.uint8) for t in (store.k, store.v, *(store.scales or ()))]
    return [t[idx] if layer is None else t[idx, layer] for t in raw]


@pytest.mark.parametrize("peer", [None, FP8, INT8], ids=["bf16", "fp8", "int8"], indirect=True)
def test_reads_give_exactly_the_remote_bytes(peer):
    descriptor, remote, _ = peer
    kv = remote.k.dtype if remote.scales is not None else None
    local = HostStore(layout(kv), 12, pin=False)
    for t in (local.k, local.v, *(local.scales or ())):
        as_bytes(t).view(torch.uint8).fill_(0xFF)
    reader = RemoteReader(local, f"decode-{uuid.uuid4().hex[:8]}", timeout_s=30)
    name = reader.connect(descriptor)
    # one layer of 5 blocks from across the store, in one transfer, into scattered local blocks
    src, dst = [39, 3, 17, 0, 22], [11, 0, 5, 2, 7]
    reader.read(name, src, dst, layer=1).wait()
    for got, want in zip(units(local, dst, 1), units(remote, src, 1)):
        assert torch.equal(got, want)
    untouched = [b for b in range(12) if b not in dst]
    assert all((t[untouched] == 0xFF).all() for t in units(local, range(12), 0))
    # whole blocks (every layer)
    reader.read(name, [8, 9], [3, 4]).wait()
    for got, want in zip(units(local, [3, 4]), units(remote, [8, 9])):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="past the end"):
        reader.read(name, [40], [0])
    # a layer per unit, whole blocks (-1) among them, in one transfer
    src, dst, layers = [5, 6, 30, 31], [8, 9, 10, 1], [2, -1, 0, 2]
    reader.read(name, src, dst, layers).wait()
    for s, d, layer in zip(src, dst, layers):
        for got, want in zip(units(local, [d], None if layer < 0 else layer),
                             units(remote, [s], None if layer < 0 else layer)):
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="layer past"):
        reader.read(name, [1], [0], [LAYERS])
    # what it counted, against sizes computed by hand: a layer of a block is heads x block x dim
    # values of K and of V (+ one float32 scale per row of each in 8 bits)
    row = HEADS * BLOCK * (DIM * (1 if kv else 2) + (4 if kv else 0))
    s = reader.stats
    assert (s.transfers, s.units, s.failed) == (3, 11, 0)
    assert s.bytes == 2 * row * (5 + 2 * LAYERS + 3 + LAYERS) and len(s.latencies) == 3
    assert all(0 <= t < 30 for t in s.latencies)
    reader.close()


@pytest.mark.parametrize("peer", [None], ids=["bf16"], indirect=True)
def test_a_dead_peer_fails_a_read_instead_of_hanging(peer):
    descriptor, remote, proc = peer
    local = HostStore(layout(None), 4, pin=False)
    reader = RemoteReader(local, f"decode-{uuid.uuid4().hex[:8]}", timeout_s=10)
    name = reader.connect(descriptor)
    reader.read(name, [1], [0]).wait()  # the connection is up
    proc.kill()
    proc.join(30)
    with pytest.raises(RemoteReadError, match="failed"):
        reader.read(name, [2], [1]).wait()
    assert reader.stats.failed == 1
    reader.close()


def test_connecting_a_peer_of_another_layout_is_refused(tmp_path):
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(FP8, 8, 1, out, stop), daemon=True)
    proc.start()
    try:
        descriptor = out.get(timeout=120)
        reader = RemoteReader(HostStore(layout(None), 4, pin=False),
                              f"decode-{uuid.uuid4().hex[:8]}")
        with pytest.raises(ValueError, match="stores torch.float8_e4m3fn"):
            reader.connect(descriptor)
        reader.close()
    finally:
        stop.set()
        proc.join(30)


def summary_layout() -> TieredLayout:
    """FP8 KV and FP8 summaries (values and their scales: two regions)."""
    return TieredLayout(LAYERS, HEADS, DIM, BLOCK, 4, torch.bfloat16, FP8, FP8)


def filled_mirror(rows: int, seed: int):
    from oasiskv.kv.summaries import SummaryMirror
    mirror = SummaryMirror(summary_layout(), rows)
    gen = torch.Generator().manual_seed(seed)
    for t in mirror.tensors():
        raw = as_bytes(t).view(torch.uint8)
        raw.copy_(torch.randint(0, 0x70, raw.shape, generator=gen, dtype=torch.uint8))
    return mirror


def serve_summaries(out: mp.Queue, stop: mp.Event) -> None:
    from oasiskv.kv.remote import RemoteStore
    store = RemoteStore(HostStore(summary_layout(), 4, pin=False), f"prefill-{os.getpid()}",
                        filled_mirror(20, 5))
    out.put(store.descriptor())
    stop.wait(120)
    store.close()


def test_summaries_read_from_a_peers_mirror_are_exactly_its_bytes():
    """A handoff's summaries: rows of the serving process's summary mirror (its host block ids)
    into the reader's staging rows, values and FP8 scales, in one transfer; a reader without a
    mirror connects to the same peer but reads no summaries."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve_summaries, args=(out, stop), daemon=True)
    proc.start()
    try:
        descriptor = out.get(timeout=120)
        from oasiskv.kv.summaries import SummaryMirror
        staging = SummaryMirror(summary_layout(), 6)
        for t in staging.tensors():
            as_bytes(t).view(torch.uint8).fill_(0xFF)
        reader = RemoteReader(HostStore(summary_layout(), 4, pin=False),
                              f"decode-{uuid.uuid4().hex[:8]}", timeout_s=30, summaries=staging)
        name = reader.connect(descriptor)
        reader.read_summaries(name, [9, 2, 17], [0, 1, 2]).wait()
        want = filled_mirror(20, 5)
        for got, expect in zip(staging.tensors(), want.tensors()):
            assert torch.equal(as_bytes(got)[:3], as_bytes(expect)[[9, 2, 17]])
            assert (as_bytes(got)[3:].view(torch.uint8) == 0xFF).all()
        with pytest.raises(ValueError, match="past the end"):
            reader.read_summaries(name, [20], [0])
        reader.close()
        plain = RemoteReader(HostStore(summary_layout(), 4, pin=False),
                             f"decode-{uuid.uuid4().hex[:8]}")
        with pytest.raises(ValueError, match="no summaries"):
            plain.read_summaries(plain.connect(descriptor), [1], [0])
        plain.close()
    finally:
        stop.set()
        proc.join(30)
