"""One signal to a fleet guard for every lease request (or release) this worker has for it at the
moment, instead of one each.

Every signal to a workflow takes that workflow's lock on the server and writes its history. A guard
is one workflow for a whole cluster: with 3,000 runbooks asking at once on the production server
(bench/guard_throughput.py --storm), their 3,000 `request` signals queued on the guard's lock, some
were refused ("Workflow is busy"), and the guard's own answers waited behind them. Here an activity
hands its item to its guard's batch and waits until the signal carrying it is taken: while one
signal is on its way, the items that arrive meanwhile gather for the next. Alone, an item goes at
once (no timer, nothing added to an uncontended lease); under a storm a few signals carry it all.

The guard says which batch signals it takes in its memo (workflows/fleet_guard.py `publish`, read
by activities/breaker.py's GuardViews): a guard run that an older release's code may still run
never advertises them, so a batch never reaches code that has no handler for it
(docs/upgrading.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from temporalio.exceptions import ApplicationError

from activities.errors import fail
from fleetmedic.errors import ErrorKind

T = TypeVar("T")

# The most items one signal carries: a lease request is ~200 bytes as JSON, so ~100 KB, well under
# the server's 2 MB limit on a payload (and its 512 KB warning).
MOST = 500


class Batch(Generic[T]):
    """The items waiting for one guard's next signal, and the signal on its way. `send` delivers a
    list (one signal) or raises with the line the callers fail with."""

    def __init__(self, send: Callable[[list[T]], Awaitable[None]], most: int = MOST) -> None:
        self.send, self.most = send, most
        self.waiting: list[tuple[T, asyncio.Future[None]]] = []
        self.sender: asyncio.Task[None] | None = None
        self.signals = 0  # signals taken (the tests read it)

    async def add(self, item: T, timeout_s: float, what: str) -> None:
        """Until the signal carrying `item` was taken, or `timeout_s`: then the attempt fails, retryable,
        with `what` on one line (the signal may still be taken: the guard's handlers are idempotent)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A caller that gave up no longer looks at its future: its failure is not left unretrieved.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.waiting.append((item, future))
        if self.sender is None or self.sender.done():
            self.sender = asyncio.get_running_loop().create_task(self._send_all())
        try:
            await asyncio.wait_for(future, timeout_s)  # its own future: the signal goes on for the others
        except TimeoutError:
            raise fail(ErrorKind.UNAVAILABLE, f"{what} (no answer within {timeout_s:.0f} s)") from None

    async def _send_all(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting[:self.most], self.waiting[self.most:]
            try:
                await self.send([item for item, _ in batch])
                self.signals += 1
            except Exception as exc:  # `send` says what failed on one line; anything else is retried
                error = exc if isinstance(exc, ApplicationError) else fail(ErrorKind.UNAVAILABLE, str(exc))
                for _, future in batch:  # each caller raises an error of its own, with the same line
                    if not future.done():
                        future.set_exception(ApplicationError(error.message, type=error.type,
                                                              non_retryable=error.non_retryable))
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
