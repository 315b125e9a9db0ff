"""HTTP stand-ins for what cannot run here: Slack's Web API and an `http` node provider.

Each serves on 127.0.0.1 from its own thread, records every request it received, and can be
told to fail the next N requests (a status, a Slack error, or a delay for timeouts).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

from aiohttp import web

BODY: web.RequestKey[Any] = web.RequestKey("body", object)


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    peer: Any = None  # the client's (address, port): one per connection it opened


@dataclass
class Failure:
    status: int = 500
    times: int = 1
    delay_s: float = 0.0
    body: Any = None
    headers: dict[str, str] | None = None


class ThreadedServer:
    """An aiohttp app on a loopback port, on its own loop in a thread."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.failures: list[Failure] = []
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=type(self).__name__)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = dict(await request.post()) if raw else None
        with self.lock:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.requests.append(Recorded(request.method, request.path, dict(request.headers), body, peer))
            failure = next((f for f in self.failures if f.times > 0), None)
            if failure is not None:
                failure.times -= 1
        if failure is not None:
            if failure.delay_s:
                await asyncio.sleep(failure.delay_s)
            if failure.status:
                return web.json_response(failure.body or {"error": "injected"}, status=failure.status,
                                         headers=failure.headers)
        request[BODY] = body
        response: web.StreamResponse = await handler(request)
        return response

    def fail_next(self, status: int = 500, times: int = 1, delay_s: float = 0.0, body: Any = None,
                  headers: dict[str, str] | None = None) -> None:
        with self.lock:
            self.failures.append(Failure(status=status, times=times, delay_s=delay_s, body=body, headers=headers))

    def connections(self) -> int:
        """Connections the requests came on (each client port seen)."""
        with self.lock:
            return len({r.peer for r in self.requests})

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._middleware])
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SlackStandIn(ThreadedServer):
    """`chat.postMessage` as Slack answers it: ok, channel, ts; thread replies keep thread_ts."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[dict[str, Any]] = []
        self._ts = itertools.count(1)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/api/chat.postMessage", self._post_message)

    @property
    def api_url(self) -> str:
        return f"{self.url}/api/"

    async def _post_message(self, request: web.Request) -> web.Response:
        body = request[BODY] or {}
        if not request.headers.get("Authorization", "").startswith("Bearer "):
            return web.json_response({"ok": False, "error": "not_authed"})
        if not body.get("channel"):
            return web.json_response({"ok": False, "error": "channel_not_found"})
        ts = f"{int(time.time())}.{next(self._ts):06d}"
        message = {"channel": body["channel"], "ts": ts, "text": body.get("text", ""),
                   "thread_ts": body.get("thread_ts"), "blocks": body.get("blocks")}
        with self.lock:
            self.messages.append(message)
        return web.json_response({"ok": True, "channel": body["channel"], "ts": ts, "message": message})

    def threads(self) -> dict[str, list[dict[str, Any]]]:
        """Top-level messages by ts, each with its replies."""
        with self.lock:
            tops = {m["ts"]: [m] for m in self.messages if not m["thread_ts"]}
            for m in self.messages:
                if m["thread_ts"] in tops:
                    tops[m["thread_ts"]].append(m)
        return tops


@dataclass
class ProviderRequestRecord:
    id: str
    key: str
    body: dict[str, Any]
    status: str = "accepted"
    created: float = field(default_factory=time.time)
    replacement: str = "same"  # "new": a new machine under a new name (`new_node` once it joined)
    new_node: str | None = None


class ProviderStandIn(ThreadedServer):
    """The `http` provider contract of docs/http-provider.md, with idempotency keys."""

    def __init__(self, token: str | None = None) -> None:
        super().__init__()
        self.token = token
        self.by_key: dict[str, ProviderRequestRecord] = {}
        self._ids = itertools.count(1)
        # What a replace yields: "same" (the node comes back under its name) or "new" (another name).
        self.replacement = "same"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/requests", self._create)
        app.router.add_get("/v1/requests/{id}", self._get)

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    async def _create(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        key = request.headers.get("Idempotency-Key")
        body = request[BODY] or {}
        if not key:
            return web.json_response({"error": "Idempotency-Key header is required"}, status=400)
        missing = [f for f in ("cluster", "node", "action") if not body.get(f)]
        if missing or body.get("action") not in ("replace", "reboot", "rma", "prewarm"):
            return web.json_response({"error": f"bad request: {missing or body.get('action')}"}, status=400)
        with self.lock:
            existing = self.by_key.get(key)
            if existing is not None:
                if existing.body != body:
                    return web.json_response({"error": "idempotency key reused for another request"}, status=409)
                return web.json_response(self._view(existing), status=200)
            record = ProviderRequestRecord(id=f"req-{next(self._ids)}", key=key, body=body,
                                           replacement=self.replacement if body["action"] == "replace" else "same")
            self.by_key[key] = record
        return web.json_response(self._view(record), status=202)

    async def _get(self, request: web.Request) -> web.Response:
        with self.lock:
            record = next((r for r in self.by_key.values() if r.id == request.match_info["id"]), None)
        if record is None:
            return web.json_response({"error": "not found"}, status=404)
        return web.json_response(self._view(record))

    @staticmethod
    def _view(record: ProviderRequestRecord) -> dict[str, Any]:
        view = {"id": record.id, "status": record.status, **record.body}
        if record.replacement == "new":
            view["replacement"] = "new"
            view["node"] = record.new_node  # the new machine's node once it joined; null before
        return view

    def complete(self, record_id: str, node: str | None = None, status: str = "done") -> None:
        """The provider finished a request (a new machine joined as `node`), or failed it."""
        with self.lock:
            record = next(r for r in self.by_key.values() if r.id == record_id)
            record.status, record.new_node = status, node

    def accepted(self) -> list[dict[str, Any]]:
        """The bodies of the distinct requests (one per idempotency key), oldest first."""
        return [r.body for r in self.records()]

    def records(self) -> list[ProviderRequestRecord]:
        with self.lock:
            return list(self.by_key.values())


class AgentStandIn(ThreadedServer):
    """The node agent's HTTP API (GPU readings, validation and GPU reset) for runbook tests; the
    real agent is `fleetmedic agent`. `passed` is what /v1/validate answers, `temperatures` what
    /v1/gpus reads; resets are recorded."""

    def __init__(self, token: str = "agent-secret") -> None:
        super().__init__()
        self.token = token
        self.passed = True
        self.resets: list[tuple[str, int]] = []
        # What GET /v1/gpus reads now: GPU index -> °C (tests heat and cool them).
        self.temperatures: dict[int, float] = dict.fromkeys(range(8), 55.0)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{node}/healthz", self._healthz)
        app.router.add_get("/{node}/v1/gpus", self._gpus)
        app.router.add_get("/{node}/v1/validate", self._validate)
        app.router.add_post("/{node}/v1/gpus/{gpu}/reset", self._reset)

    @property
    def url_template(self) -> str:
        return f"{self.url}/{{node}}"

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _gpus(self, request: web.Request) -> web.Response:
        with self.lock:
            gpus = [{"gpu": g, "temperature_c": t, "thermal_margin_c": 87.0 - t}
                    for g, t in sorted(self.temperatures.items())]
        return web.json_response({"gpus": gpus})

    async def _validate(self, request: web.Request) -> web.Response:
        expected = request.query.get("expected_gpus", "8")
        checks = [
            {"name": "gpus_present", "passed": True, "value": f"{expected}/{expected}"},
            {"name": "gpus_answer", "passed": True, "value": f"{expected}/{expected}"},
            {"name": "no_xid_since", "passed": self.passed, "value": "none" if self.passed else "XID 79 on GPU 3"},
            {"name": "temperature", "passed": True, "value": "61 C max"},
        ]
        return web.json_response({"passed": self.passed, "checks": checks, "since": request.query.get("since")})

    async def _reset(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        gpu = int(request.match_info["gpu"])
        with self.lock:
            self.resets.append((request.match_info["node"], gpu))
        return web.json_response({"detail": f"GPU {gpu} reset"})
