"""Ending background tasks for sure.

On Python 3.11, `asyncio.wait_for` returns its result instead of raising when a cancel lands as the awaited item
arrives (fixed in 3.12). nats-py calls it under every timed operation (KeyWatcher.updates, publish acks, pull
fetches), so one `task.cancel()` of a `while True` loop over such a call can be lost, and the loop then waits on
a subscription that is gone: a `kvmesh bench admission` worker hung so at exit. `cancel_until_done` cancels again
until the task has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.logging import get_logger

log = get_logger(__name__)
RECANCEL_S = 0.1  # how long a cancel gets before the next


async def cancel_until_done(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` and wait for its end, cancelling again every RECANCEL_S while it runs on. An error it ended
    with is logged, not raised: the caller is stopping."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and task.exception() is not None:
        log.warning("a background task ended with an error", error=str(task.exception())[:200])
