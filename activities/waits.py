"""Waits that hold nothing. An activity that waits (pods leaving a node, a replacement joining,
inference coming home) runs as an async activity on the waits queue: between its short blocking
calls — each on a few threads shared by every wait of the worker — it sleeps on the event loop.
A thousand runs waiting on PodDisruptionBudgets or slow machines then cost a thousand coroutines,
not a thousand threads, and never the activity slots a new alert's steps need."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TypeVar

from temporalio import activity

T = TypeVar("T")

# Threads for the waits' blocking calls (an API read, an eviction): each is short, so a few serve
# every wait; the Kubernetes client's pool counts them.
WAIT_IO_THREADS = 4


# How often an activity whose call waits on those threads says it is alive: well inside the
# shortest heartbeat timeout of a wait that uses them (a drain's 10 s, workflows/runbook.py).
ALIVE_EVERY_S = 1.0

# This activity's last heartbeat details (a contextvar: each activity runs in a task of its own).
_last_details: ContextVar[tuple[Any, ...] | None] = ContextVar("fleetmedic_heartbeat_details", default=None)


def heartbeat(*details: Any) -> None:
    """`activity.heartbeat`, remembered: a call waiting on BlockingCalls' threads keeps the activity
    alive with these same details, so it never replaces them with nothing."""
    _last_details.set(details)
    activity.heartbeat(*details)


class BlockingCalls:
    """Runs a wait's short blocking calls on a small pool of its own, off the event loop."""

    def __init__(self, threads: int = WAIT_IO_THREADS, name: str = "waits-io") -> None:
        self.threads = threads
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the pool. Meanwhile the activity calling it heartbeats every ALIVE_EVERY_S
        (the SDK sends at most one per throttle interval), with its last details: in a storm the
        calls queue for the few threads. 1,000 runs drained together on the benchmark's dev
        server, each drain's first read (the node's pods) waiting its turn without a heartbeat; a
        drain's heartbeat timeout is 10 s, and one run's drain timed out five attempts in a row
        and was escalated to a person, its node with no pod to evict."""
        return await alive(asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args)))


async def alive(waited: Awaitable[T]) -> T:
    """`await waited`, the activity awaiting it heartbeating every ALIVE_EVERY_S with its last details
    meanwhile (a wait's call queued behind others: for a thread, for a list shared with others)."""
    if not activity.in_activity():
        return await waited
    call = asyncio.ensure_future(waited)
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=ALIVE_EVERY_S)
            if done:
                return call.result()
            details = _last_details.get()
            activity.heartbeat(*(details if details is not None else activity.info().heartbeat_details))
    finally:
        call.cancel()  # the activity was cancelled: what it waited for is nobody's now


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
