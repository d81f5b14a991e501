"""``AsyncEngine.call``: a function run on the engine thread between steps, its result or its
exception returned to the event loop; when the caller stops waiting first, ``undo`` gets the
result on the engine thread (so that what the function took, e.g. held KV blocks, is given
back)."""
import asyncio
import threading
import time

import pytest

from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.server.async_engine import AsyncEngine


@pytest.fixture
def engine():
    return LLMEngine(device="cpu")


def test_call_returns_raises_and_undoes_when_the_caller_left(engine):
    undone: list = []
    threads: list = []

    async def main():
        bridge = AsyncEngine(engine, max_waiting=4)
        bridge.start()
        try:
            assert await bridge.call(lambda: threads.append(threading.current_thread().name)
                                     or 42) == 42
            assert threads == ["oasiskv-engine"]
            with pytest.raises(ValueError, match="nope"):
                await bridge.call(lambda: (_ for _ in ()).throw(ValueError("nope")))

            def slow():  # takes something, while its caller gives up
                time.sleep(0.3)
                return "held"

            waiting = asyncio.ensure_future(
                bridge.call(slow, undo=lambda r: undone.append((r, threading.current_thread()
                                                                 .name))))
            await asyncio.sleep(0.05)
            waiting.cancel()
            await asyncio.sleep(0.6)
            assert await bridge.call(lambda: 1) == 1  # (the undo ran before this)
        finally:
            await bridge.close()

    asyncio.run(main())
    assert undone == [("held", "oasiskv-engine")]


def test_the_engine_thread_waits_while_nothing_can_run(engine):
    """A request that cannot be scheduled (every free block held elsewhere) makes steps that run
    nothing: the engine thread waits between them instead of spinning, and the request runs once
    the blocks are given back."""
    from oasiskv.sampling_params import SamplingParams
    steps = [0]
    step = engine.step

    def counted(*a, **k):
        steps[0] += 1
        return step(*a, **k)

    async def main():
        bridge = AsyncEngine(engine, max_waiting=4)
        bridge.start()
        try:
            alloc = engine.allocator
            held = await bridge.call(lambda: alloc.hold_new(alloc.num_free_blocks))
            engine.step = counted
            handle = await bridge.submit([[5, 6, 7]], [SamplingParams(temperature=0)], 4)
            await asyncio.sleep(0.3)
            idle_steps = steps[0]
            await bridge.call(lambda: alloc.release(held))
            outs = [out async for _, out in handle.outputs()]
            return idle_steps, outs[-1]
        finally:
            engine.step = step
            await bridge.close()

    idle_steps, last = asyncio.run(main())
    assert 5 <= idle_steps <= 0.3 / 0.005 + 5, idle_steps  # one per IDLE_WAIT_S, not thousands
    assert last.finished and len(last.token_ids) == 4
