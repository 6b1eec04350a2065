"""The gateway's tokenizer threads (services/gateway/tokenizer_threads.py): results and errors come back to the
awaiting caller, the work runs off the event loop on at most NUM_THREADS threads at once, and a caller that stops
waiting leaves nothing behind on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.gateway.tokenizer_threads import NUM_THREADS, TokenizerThreads

pytestmark = pytest.mark.asyncio


async def test_a_call_returns_its_result_from_another_thread() -> None:
    threads = TokenizerThreads(name="t-result")
    name = await threads.run(lambda: threading.current_thread().name)
    assert name in {f"t-result-{i}" for i in range(NUM_THREADS)}  # not the loop's thread
    assert await threads.run(divmod, 17, 5) == (3, 2)


async def test_an_error_is_raised_where_the_caller_awaits() -> None:
    threads = TokenizerThreads(name="t-error")
    with pytest.raises(ZeroDivisionError):
        await threads.run(divmod, 1, 0)
    assert await threads.run(divmod, 9, 3) == (3, 0)  # the thread goes on serving


async def test_at_most_num_threads_calls_run_at_once() -> None:
    threads = TokenizerThreads(name="t-bound")
    assert threads.num_threads == NUM_THREADS == 4
    running, release = threading.Semaphore(0), threading.Event()

    def blocked() -> str:
        running.release()
        release.wait(10)
        return threading.current_thread().name

    calls = [asyncio.ensure_future(threads.run(blocked)) for _ in range(NUM_THREADS + 2)]
    for _ in range(NUM_THREADS):
        assert await asyncio.to_thread(running.acquire, True, 5)
    assert not await asyncio.to_thread(running.acquire, True, 0.2)  # the fifth waits in the queue
    release.set()
    names = await asyncio.gather(*calls)
    assert set(names) == {f"t-bound-{i}" for i in range(NUM_THREADS)}


async def test_a_caller_that_stops_waiting_leaves_no_error_on_the_loop() -> None:
    threads = TokenizerThreads(num_threads=1, name="t-cancel")  # one thread: the jobs settle in order
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    started, release = threading.Event(), threading.Event()

    def slow() -> int:
        started.set()
        release.wait(10)
        return 1

    call = asyncio.ensure_future(threads.run(slow))
    assert await asyncio.to_thread(started.wait, 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    release.set()
    assert await threads.run(int, "7") == 7  # settled after the cancelled call's outcome reached the loop
    assert errors == []
    loop.set_exception_handler(None)
