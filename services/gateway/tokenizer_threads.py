"""The gateway's tokenizer threads: template rendering, tokenizing and block-key hashing run here, never on the
event loop, so a long prompt never stalls the other requests. A few threads, so a burst of long prompts queues
instead of taking every core (tokenizers' encode_batch releases the GIL while it works).

Not a ThreadPoolExecutor behind `run_in_executor`: that hand-off builds a concurrent Future, chains it to a loop
future through callbacks on both sides and takes the pool's idle semaphore, about 40 us more per trip than a queue
put and one `call_soon_threadsafe` back (docs/benchmarks.md#where-the-overhead-goes), on every request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
NUM_THREADS = 4

Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class TokenizerThreads:
    """Runs blocking calls for event loops on `num_threads` threads, started at the first call. The threads only
    read the job queue; each result is handed to its caller's loop, which alone sets its future."""

    def __init__(self, num_threads: int = NUM_THREADS, name: str = "tokenize") -> None:
        self.num_threads = num_threads
        self.name = name
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the threads. A cancelled caller stops waiting; a running call ends on its own."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._threads:
            self._start()
        self._jobs.put((loop, future, fn, args))
        return await future

    def _start(self) -> None:
        with self._lock:
            for i in range(len(self._threads), self.num_threads):
                # daemon: a job is CPU work on a prompt, with nothing to finish or flush at exit
                thread = threading.Thread(target=self._serve, name=f"{self.name}-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _serve(self) -> None:
        while True:
            loop, future, fn, args = self._jobs.get()
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # the caller's to handle: it is raised where it awaits
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the caller's loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del future, fn, args, outcome  # no reference to the last job's prompt while the thread waits


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the caller's loop: the outcome, unless the caller stopped waiting (its future is cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
