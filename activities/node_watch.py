"""One watch on the cluster's nodes per worker, feeding every run that waits for a node.

A run waiting for its node to come back (after a replacement, a reboot) used to hold an activity
thread and an API connection for each 5-minute watch of its own: past ~64 such runs, every other
activity — a new alert's included — queued behind them. Here one list-and-watch (an informer, as
controllers keep) holds the latest state of every node, and a wait is an asyncio event on it: a
thousand waits cost a thousand small objects, no thread, no connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kubernetes import client, watch

from activities.errors import fail
from activities.out_of_service import OutOfService
from fleetmedic.errors import ErrorKind
from fleetmedic.models import NodeInfo

log = logging.getLogger(__name__)

# How long one watch request stays open before it is renewed (from the last resourceVersion).
WATCH_S = 300
# How often a wait wakes up by itself (to heartbeat, and to re-check its deadline) when its
# activity has no heartbeat timeout; with one, a quarter of it (`tick_for`).
TICK_S = 5.0


def tick_for(heartbeat_timeout: timedelta | None) -> float:
    """How often a wait heartbeats: a quarter of its heartbeat timeout. The SDK sends a heartbeat
    once per 0.8 of that timeout (96 s at the policy's 2 minutes), the latest call's; every call is
    encoded and handed to its core all the same. A wait that woke every 5 s made 19 calls of 20 for
    nothing: 1,000 waiting runs were 200 calls and wake-ups a second on the worker's event loop,
    with no run doing anything. A quarter leaves each throttle window a call to send."""
    if heartbeat_timeout is None or heartbeat_timeout <= timedelta(0):
        return TICK_S
    return max(1.0, heartbeat_timeout.total_seconds() / 4)


class NodeWatch:
    """The latest state of every node, from one list and watch; `wait` for a node to match."""

    def __init__(self, core: Callable[[], client.CoreV1Api], json_to_info: Callable[[dict[str, Any]], NodeInfo],
                 timeout_s: float, out: OutOfService) -> None:
        self._core, self._json_to_info, self.timeout_s = core, json_to_info, timeout_s
        self._nodes: dict[str, NodeInfo] = {}
        # When each node out of service (cordoned or NotReady) went out, as this watch saw it happen
        # (activities/out_of_service.py: what the cordon breaker counts).
        self.out = out
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()
        self.last_error = ""
        self._stopped = threading.Event()

    def stop(self) -> None:
        """No list or watch after this: a worker stopped inside a process that goes on (the embedded
        dev stack, a test session) must not keep renewing its watch against the API for ever. The
        watch open now ends at its next event or its window, whichever comes first."""
        self._stopped.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetmedic-node-watch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                core = self._core()
                version = self._list(core)
                while not self._stopped.is_set():
                    # Events as plain JSON: every kubelet heartbeat of the fleet arrives here.
                    stream = watch.Watch().stream(core.list_node, resource_version=version, timeout_seconds=WATCH_S,
                                                  _request_timeout=WATCH_S + self.timeout_s, deserialize=False)
                    for event in stream:
                        if self._stopped.is_set():
                            break  # closes the watch's connection
                        node = event["object"]
                        if event["type"] == "ERROR":  # 410 Gone: list again
                            raise RuntimeError(f"watch error: {node.get('message', node)}")
                        version = node["metadata"]["resourceVersion"]
                        if event["type"] == "BOOKMARK":
                            continue
                        name = node["metadata"]["name"]
                        with self._lock:
                            if event["type"] == "DELETED":
                                self._nodes.pop(name, None)
                                self.out.gone(name)
                            else:
                                self._seen(self._json_to_info(node))
                        self._notify([name])
            except Exception as exc:  # 410 Gone, a broken connection, the API down: list again
                self.last_error = str(exc)[:300]
                log.debug("node watch: %s; listing again", exc)
                self._stopped.wait(1)

    def _list(self, core: client.CoreV1Api) -> str:
        """Every node's state, from one list; the resourceVersion to watch from. Read as the API's
        JSON, as the watch's events are, not as the client's model objects: a 5,000-node fleet's
        are built on the worker's one interpreter at its start, while the first protective steps
        wait for this list (the cordon breaker counts from it). The list goes once read."""
        listed = json.loads(core.list_node(_request_timeout=self.timeout_s, _preload_content=False).data)
        with self._lock:
            self._nodes = {info.name: info for info in (self._json_to_info(n) for n in listed["items"])}
            # A list again after a broken watch: what changed meanwhile is seen now.
            self.out.listed(self._nodes.values(), time.monotonic(), first=not self.synced.is_set())
            everyone = list(self._waiters)
        self.synced.set()
        self._notify(everyone)
        return str(listed["metadata"]["resourceVersion"])

    def _seen(self, info: NodeInfo) -> None:
        """A node's new state (under the lock): note when it goes out of service."""
        self.out.seen(info, time.monotonic())
        self._nodes[info.name] = info

    def out_of_service(self, wait_s: float = 0.0) -> OutOfService | None:
        """The nodes out of service, once the first list is in (waited for up to `wait_s`); None
        before (the watch starts on the first call)."""
        self._start()
        return self.out if self.synced.wait(wait_s) else None

    def _notify(self, names: list[str]) -> None:
        with self._lock:
            waiting = [w for name in names for w in self._waiters.get(name, ())]
        for loop, event in waiting:
            loop.call_soon_threadsafe(event.set)

    async def wait(self, name: str, match: Callable[[NodeInfo | None], NodeInfo | None], timeout_s: float,
                   tick: Callable[[], None], tick_s: float = TICK_S) -> NodeInfo | None:
        """The node as `match` returns it once it matches, or None after `timeout_s`. `tick` runs
        every `tick_s` meanwhile (the activity's heartbeat: how a cancellation reaches it)."""
        self._start()
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + timeout_s
        while True:
            event = asyncio.Event()
            with self._lock:
                self._waiters.setdefault(name, set()).add((loop, event))
            try:
                if self.synced.is_set():
                    with self._lock:
                        current = self._nodes.get(name)
                    if (found := match(current)) is not None:
                        return found
                elif loop.time() - began > 3 * self.timeout_s:
                    raise fail(ErrorKind.UNAVAILABLE, f"cannot list and watch nodes: {self.last_error or 'no answer'}")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(event.wait(), min(remaining, tick_s))
                except TimeoutError:
                    if deadline > loop.time():  # not at the end: its answer goes out at once
                        tick()
            finally:
                with self._lock:
                    waiters = self._waiters.get(name, set())
                    waiters.discard((loop, event))
                    if not waiters:
                        self._waiters.pop(name, None)
