"""The agent's HTTP API (port 9400 by default):

- `GET /metrics` — Prometheus metrics (`metrics.METRICS`);
- `GET /healthz` — 200 while NVML answers, 503 when it does not;
- `GET /v1/gpus` — a fresh temperature and thermal margin per GPU (hot-gpu-pull confirms with it);
- `GET /v1/validate?since=<ISO time>&expected_gpus=<n>` — the verdict of a repaired node;
- `POST /v1/gpus/{gpu}/reset` — `Authorization: Bearer <FLEETMEDIC_AGENT_TOKEN>`; allowed only
  while the node is cordoned and no process uses the GPU (409 otherwise), one reset at a time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.node_agent.infiniband import Infiniband
from workers.node_agent.metrics import AgentCollector
from workers.node_agent.nvml import Nvml
from workers.node_agent.validation import verdict

log = logging.getLogger("fleetmedic.agent")


class Agent:
    def __init__(self, node: str, nvml: Nvml | None, infiniband: Infiniband, *, token: str | None,
                 expected_gpus: int | None, max_temperature_c: float,
                 node_cordoned: Callable[[], bool], nvml_error: str = "") -> None:
        self.node, self.nvml, self.infiniband = node, nvml, infiniband
        self.token, self.expected_gpus, self.max_temperature_c = token, expected_gpus, max_temperature_c
        self.node_cordoned = node_cordoned
        self.nvml_error = nvml_error
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(node, nvml, infiniband, expected_gpus))
        self._reset_lock = threading.Lock()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/metrics", self.metrics), Route("/healthz", self.healthz), Route("/v1/gpus", self.gpus),
            Route("/v1/validate", self.validate), Route("/v1/gpus/{gpu:int}/reset", self.reset, methods=["POST"]),
        ])

    async def metrics(self, request: Request) -> Response:
        body = await asyncio.to_thread(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        if self.nvml is None:
            return JSONResponse({"ok": False, "node": self.node, "error": self.nvml_error}, status_code=503)
        return JSONResponse({"ok": True, "node": self.node, "gpus": self.nvml.count})

    async def gpus(self, request: Request) -> Response:
        if self.nvml is None:
            return JSONResponse({"error": f"NVML unavailable: {self.nvml_error}"}, status_code=503)
        readings = await asyncio.to_thread(self.nvml.temperatures)
        return JSONResponse({"node": self.node, "gpus": [
            {"gpu": g.index, "temperature_c": g.temperature_c, "thermal_margin_c": g.thermal_margin_c}
            for g in readings]})

    async def validate(self, request: Request) -> Response:
        try:
            since = datetime.fromisoformat(request.query_params.get("since", "1970-01-01T00:00:00+00:00"))
            expected = request.query_params.get("expected_gpus")
            expected_gpus = int(expected) if expected else self.expected_gpus
        except ValueError as exc:
            return JSONResponse({"error": f"bad query: {exc}"}, status_code=400)
        if since.tzinfo is None:
            return JSONResponse({"error": "since needs a time zone (e.g. 2026-01-01T00:00:00Z)"}, status_code=400)

        def judge() -> list[dict[str, object]]:
            gpus = self.nvml.sample() if self.nvml else []
            xids = self.nvml.xids_since(since.timestamp()) if self.nvml else []
            checks = verdict(gpus, xids, self.infiniband.sample(), expected_gpus=expected_gpus,
                             max_temperature_c=self.max_temperature_c)
            return [asdict(c) for c in checks]

        checks = await asyncio.to_thread(judge)
        return JSONResponse({"node": self.node, "since": since.isoformat(),
                             "passed": all(c["passed"] for c in checks), "checks": checks})

    async def reset(self, request: Request) -> Response:
        if not self.token:
            return JSONResponse({"error": "GPU reset is disabled: no FLEETMEDIC_AGENT_TOKEN configured"},
                                status_code=403)
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        if self.nvml is None:
            return JSONResponse({"error": f"NVML unavailable: {self.nvml_error}"}, status_code=503)
        gpu = int(request.path_params["gpu"])
        if not 0 <= gpu < self.nvml.count:
            return JSONResponse({"error": f"no GPU {gpu} on {self.node} ({self.nvml.count} GPUs)"}, status_code=404)
        return await asyncio.to_thread(self._reset, gpu)

    def _reset(self, gpu: int) -> Response:
        assert self.nvml is not None
        if not self._reset_lock.acquire(blocking=False):
            return JSONResponse({"error": "another GPU reset is running on this node"}, status_code=409)
        try:
            # Both checks right before the reset: a node that is not cordoned may get work any
            # moment, and a reset under a running process kills it.
            try:
                cordoned = self.node_cordoned()
            except Exception as exc:  # the API server is the only judge; unknown means no
                return JSONResponse({"error": f"cannot tell whether {self.node} is cordoned: {exc}"}, status_code=503)
            if not cordoned:
                return JSONResponse({"error": f"node {self.node} is not cordoned: cordon it first"}, status_code=409)
            busy = self.nvml.processes(gpu)
            if busy:
                return JSONResponse({"error": f"GPU {gpu} has running processes: {busy}"}, status_code=409)
            log.warning("resetting GPU %s of %s", gpu, self.node)
            try:
                self.nvml.reset(gpu)
            except Exception as exc:
                return JSONResponse({"error": f"GPU {gpu} reset failed: {exc}"}, status_code=500)
            return JSONResponse({"detail": f"GPU {gpu} reset", "gpu": gpu})
        finally:
            self._reset_lock.release()
