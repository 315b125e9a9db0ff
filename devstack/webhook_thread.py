"""`fleetmedic webhook` on a loopback port from a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn

from devstack.slurm_cluster import free_port
from fleetmedic.policy import RoutingPolicy
from workers.temporal_client import connect
from workers.webhook import AlertReceiver, available_runbooks


class WebhookThread:
    """`fleetmedic webhook` served by uvicorn on a loopback port, on its own loop in a thread (with
    its own Temporal client), so that a real Alertmanager can post to it."""

    def __init__(self, address: str, task_queue: str, token: str, routing: Any = None,
                 namespace: str = "default") -> None:
        self.address, self.task_queue, self.token, self.routing = address, task_queue, token, routing
        self.namespace = namespace
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="webhook")
        self._server: Any = None

    async def _start(self) -> None:
        client = await connect(target_host=self.address, namespace=self.namespace, lazy=True)
        # Tests and benchmarks name their cluster after their task queue: that is the one served.
        routing = self.routing or RoutingPolicy(clusters=[self.task_queue])
        receiver = AlertReceiver(client, routing, self.task_queue, self.token,
                                 available_runbooks())
        self._server = uvicorn.Server(uvicorn.Config(receiver.app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self._loop.create_task(self._server.serve())

    def __enter__(self) -> WebhookThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError("the webhook did not listen")

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
            time.sleep(0.3)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
