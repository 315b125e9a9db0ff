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
from typing import Any, TypeVar

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
