"""`fleetmedic webhook`: Alertmanager's webhook (version 4) → exactly one runbook per incident.

- `POST /v1/alerts/alertmanager` with `Authorization: Bearer <FLEETMEDIC_WEBHOOK_TOKEN>`;
- each alert is routed by the policy to a runbook and a workflow ID (`<runbook>/<cluster>/<node>`);
  a firing alert signal-with-starts that workflow (it starts it, or attaches to the running one);
  a resolved alert is signalled to the running workflow and starts nothing;
- 202 with one entry per alert; 400 with the reason; 401; 413; 503 when Temporal cannot be reached
  (the whole batch: Alertmanager resends it, and what already arrived attaches idempotently);
- `GET /healthz` (checks Temporal) and `GET /metrics`.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from fleetmedic.ids import start_attributes
from fleetmedic.models import Alert, AlertAnswer, AlertmanagerPayload, RunbookStatus
from fleetmedic.policy import Policy, RoutingPolicy
from fleetmedic.routing import Ignored, Routed, route
from fleetmedic.settings import Settings, SettingsError
from workers.temporal_client import connect

log = logging.getLogger(__name__)
MAX_BODY = 1024 * 1024  # Alertmanager batches are small; a megabyte is a misbehaving sender

# Temporal answers that mean "not now, try again": the sender must retry, nothing is lost.
UNAVAILABLE = {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED,
               RPCStatusCode.ABORTED, RPCStatusCode.INTERNAL, RPCStatusCode.UNKNOWN}


class TemporalUnavailable(Exception):
    pass


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.received = Counter("fleetmedic_alerts_received", "alerts received, by name and status",
                                ["alertname", "status"], registry=self.registry)
        self.runbooks = Counter("fleetmedic_webhook_runbooks", "alerts answered, by runbook and action",
                                ["runbook", "action"], registry=self.registry)
        self.rejected = Counter("fleetmedic_webhook_rejected", "requests refused, by reason", ["reason"],
                                registry=self.registry)
        self.latency = Histogram("fleetmedic_webhook_request_seconds", "time to answer a webhook request",
                                 registry=self.registry)


class AlertReceiver:
    def __init__(self, client: Client, routing: RoutingPolicy, task_queue: str, token: str | None,
                 available: frozenset[str], max_body: int = MAX_BODY) -> None:
        self.client = client
        self.routing = routing
        self.task_queue = task_queue
        self.token = token
        self.available = available
        self.max_body = max_body
        self.metrics = Metrics()

    # --- HTTP -----------------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/alerts/alertmanager", self.alerts, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ])

    def _refuse(self, status: int, reason: str, message: str) -> JSONResponse:
        self.metrics.rejected.labels(reason).inc()
        return JSONResponse({"error": message}, status_code=status)

    def _authorized(self, request: Request) -> bool:
        if self.token is None:
            return True  # started with --insecure-no-auth
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(supplied.encode(), self.token.encode())

    async def _read_body(self, request: Request) -> bytes | None:
        """The body, or None when it is larger than the limit (checked while reading)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return None
        return bytes(body)

    async def alerts(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            return await self._alerts(request)
        finally:
            self.metrics.latency.observe(time.monotonic() - started)

    async def _alerts(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refuse(401, "unauthorized", "missing or wrong bearer token")
        body = await self._read_body(request)
        if body is None:
            return self._refuse(413, "too_large", f"body larger than {self.max_body} bytes")
        try:
            payload = AlertmanagerPayload.model_validate(json.loads(body))
        except (ValueError, ValidationError, RecursionError) as exc:
            return self._refuse(400, "invalid", _reason(exc))
        try:
            answers = [await self.handle(alert) for alert in payload.alerts]
        except TemporalUnavailable as exc:
            return self._refuse(503, "temporal_unavailable", f"Temporal unavailable, retry: {exc}")
        return JSONResponse({"alerts": [a.model_dump() for a in answers]}, status_code=202)

    async def healthz(self, request: Request) -> Response:
        try:
            await self.client.service_client.check_health(timeout=timedelta(seconds=3))
        except Exception as exc:
            return JSONResponse({"ok": False, "temporal": str(exc)}, status_code=503)
        return JSONResponse({"ok": True, "temporal": "serving"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- one alert ----------------------------------------------------------------------------

    async def handle(self, alert: Alert) -> AlertAnswer:
        name = alert.labels.get("alertname", "")
        self.metrics.received.labels(name, alert.status).inc()
        decision = route(alert, self.routing, self.available)
        if isinstance(decision, Ignored):
            return self._answer(alert, decision.runbook, None, "ignored", decision.reason)
        if alert.status == "resolved":
            return await self._resolve(alert, decision)
        handle = await self._temporal(lambda: self.client.start_workflow(
            decision.runbook, decision.input, id=decision.workflow_id, task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            start_signal="alert", start_signal_args=[alert], result_type=RunbookStatus,
            search_attributes=start_attributes(decision.runbook, decision.cluster, decision.node,
                                               decision.input.xid)))
        if _started(handle):
            return self._answer(alert, decision.runbook, decision.workflow_id, "started",
                                f"new run {handle.result_run_id}")
        return self._answer(alert, decision.runbook, decision.workflow_id, "attached",
                            f"signalled the running run {handle.result_run_id}")

    async def _resolve(self, alert: Alert, decision: Routed) -> AlertAnswer:
        handle = self.client.get_workflow_handle(decision.workflow_id)
        try:
            await self._temporal(lambda: handle.signal("alert", alert))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return self._answer(alert, decision.runbook, decision.workflow_id, "ignored",
                                    "resolved, and no runbook is running for it")
            raise
        return self._answer(alert, decision.runbook, decision.workflow_id, "attached",
                            "resolution delivered to the running run")

    async def _temporal(self, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except RPCError as exc:
            if exc.status in UNAVAILABLE:
                raise TemporalUnavailable(exc.message) from exc
            raise
        except RuntimeError as exc:  # the client could not connect at all
            raise TemporalUnavailable(str(exc)) from exc

    def _answer(self, alert: Alert, runbook: str | None, workflow_id: str | None, action: str,
                reason: str) -> AlertAnswer:
        self.metrics.runbooks.labels(runbook or "none", action).inc()
        return AlertAnswer(fingerprint=alert.fingerprint, runbook=runbook, workflow_id=workflow_id,
                           action=action, reason=reason)  # type: ignore[arg-type]


def _started(handle: WorkflowHandle[Any, Any]) -> bool:
    # Signal-with-start tells whether it created the run; the SDK keeps the response on the handle.
    response = getattr(handle, "_start_workflow_response", None)
    return bool(getattr(response, "started", False))


def available_runbooks() -> frozenset[str]:
    """The runbooks this version's worker runs: alerts for others are answered `ignored`, never
    started into a queue no worker reads."""
    from workflows.registry import WORKFLOWS

    return frozenset(str(getattr(cls, "runbook", "")) for cls in WORKFLOWS) - {""}


async def serve(settings: Settings, policy: Policy, *, host: str, port: int, insecure_no_auth: bool) -> None:
    import uvicorn

    if not settings.webhook_token and not insecure_no_auth:
        raise SettingsError("FLEETMEDIC_WEBHOOK_TOKEN is not set: refusing to accept alerts from anyone "
                            "(give --insecure-no-auth to run without a token)")
    # Lazy: the webhook starts, and answers 503, while Temporal is unreachable.
    client = await connect(lazy=True)
    receiver = AlertReceiver(client, policy.routing, settings.task_queue, settings.webhook_token,
                             available_runbooks())
    config = uvicorn.Config(receiver.app(), host=host, port=port, log_level="info", access_log=False)
    log.info("webhook listening on %s:%d, runbooks %s", host, port, sorted(receiver.available))
    await uvicorn.Server(config).serve()


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "(body)"
        return f"invalid Alertmanager payload: {where}: {error['msg']}"
    return f"body is not JSON: {exc}"
