"""mesh.tasks.cancel_until_done ends a loop whose cancel asyncio.wait_for swallowed (Python < 3.12)."""

from __future__ import annotations

import asyncio
import sys

from mesh.tasks import cancel_until_done


async def _follow(queue: asyncio.Queue[int], seen: list[int]) -> None:
    """What Limiter._follow does over nats-py's KeyWatcher.updates: wait_for on a queue, forever."""
    while True:
        seen.append(await asyncio.wait_for(queue.get(), timeout=3600))


async def _race(queue: asyncio.Queue[int], task: asyncio.Task[None]) -> None:
    """An item arrives and the cancel lands in the same turn of the loop."""
    queue.put_nowait(1)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_cancel_lost_to_wait_for_is_sent_again() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    seen: list[int] = []
    task = asyncio.ensure_future(_follow(queue, seen))
    await asyncio.sleep(0)
    await _race(queue, task)
    assert seen == [1]  # wait_for returned the item
    if sys.version_info < (3, 12):  # ... and dropped the cancel: a single cancel() leaves the loop waiting
        assert not task.done()
    await asyncio.wait_for(cancel_until_done(task), timeout=5)
    assert task.cancelled()


async def test_a_task_that_failed_is_logged_not_raised() -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    task = asyncio.ensure_future(fail())
    await asyncio.sleep(0)
    await cancel_until_done(task)
    await cancel_until_done(None)
    assert isinstance(task.exception(), RuntimeError)
