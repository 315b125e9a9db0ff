"""Waits that hold nothing. An activity that waits (pods leaving a node, a replacement joining,
inference coming home) runs as an async activity on the waits queue: between its short blocking
calls — each on a few threads shared by every wait of the worker — it sleeps on the event loop.
A thousand runs waiting on PodDisruptionBudgets or slow machines then cost a thousand coroutines,
not a thousand threads, and never the activity slots a new alert's steps need."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

from temporalio import activity

T = TypeVar("T")

# Threads for the waits' blocking calls (an API read, an eviction): each is short, so a few serve
# every wait; the Kubernetes client's pool counts them.
WAIT_IO_THREADS = 4


class BlockingCalls:
    """Runs a wait's short blocking calls on a small pool of its own, off the event loop."""

    def __init__(self, threads: int = WAIT_IO_THREADS, name: str = "waits-io") -> None:
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))


def window_left(timeout_s: float) -> float:
    """How long this attempt of a wait may wait: its whole window the first time; on a retry (the
    worker running it died, and its heartbeat timed out), what is left of the window counted from
    when the run first asked. A wait spans the run's deadline, so a retry that waited its window
    again would let the run's deadline slip by as long as the first attempt had waited."""
    info = activity.info()
    if info.attempt <= 1:
        return timeout_s
    waited = (datetime.now(UTC) - info.scheduled_time).total_seconds()
    return max(timeout_s - waited, 1.0)
