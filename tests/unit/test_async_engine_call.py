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


@pytest.fixture(scope="module")
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
