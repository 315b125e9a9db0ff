"""`fleetmedic webhook`: Alertmanager's webhook (version 4) → exactly one runbook per incident.

- `POST /v1/alerts/alertmanager` with `Authorization: Bearer <FLEETMEDIC_WEBHOOK_TOKEN>`;
- each alert is routed by the policy to a runbook and a workflow ID (`<runbook>/<cluster>/<node>`);
  a firing alert starts that workflow with the alert in its input, or is signalled to its running
  run (workers/open_runs.py);
  a resolved alert is signalled to the running workflow and starts nothing; a firing alert whose
  `startsAt` is not later than the end of the last closed run for its workflow ID is a resend of an
  incident already remediated and starts nothing (unless its route says `reopen`);
- the alerts of a batch are handled concurrently (bounded across every request);
- 202 with one entry per alert (`started`, `attached`, `ignored` or `refused`, with a reason and a
  reason code); 400 with the reason; 401; 413; 503 with its reason code when Temporal cannot be
  reached (`temporal_unavailable`) or does not answer an alert within
  FLEETMEDIC_WEBHOOK_TEMPORAL_TIMEOUT (`temporal_timeout`), or every call slot of the webhook stayed
  taken that long, or the alerts before it for the same run kept it waiting that long
  (`webhook_busy`) — the whole batch: Alertmanager resends it, and what already
  arrived attaches idempotently. Never any other 5xx;
- `POST /v1/jobs/ended` and `POST /v1/jobs/slurm`: training jobs' ends (workers/job_ends.py);
- `GET /healthz` (checks Temporal) and `GET /metrics` (every alert not acted on, by reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.start import RUNBOOK_TASK_TIMEOUT, start_or_attach
from fleetmedic.details import run_details
from fleetmedic.errors import validation_errors
from fleetmedic.ids import FLEET_OUTCOME, run_summary, start_attributes
from fleetmedic.models import Alert, AlertAnswer, AlertmanagerPayload, RunbookStatus
from fleetmedic.policy import Policy, RoutingPolicy
from fleetmedic.routing import Ignored, Refused, Routed, route
from fleetmedic.settings import Settings, SettingsError
from workers.heap import freeze_startup_objects
from workers.job_ends import JobEndReceiver
from workers.open_runs import OpenRuns
from workers.resends import ResendMemo
from workers.temporal_client import TemporalUnavailable, WebhookBusy, connect, missing_search_attribute

log = logging.getLogger(__name__)
MAX_BODY = 1024 * 1024  # Alertmanager batches are small; a megabyte is a misbehaving sender
# Alerts talking to Temporal at once, for all requests together. A fleet's burst goes to the server
# at once, as one client's starts would: what refuses it is the server's own admission (its
# frontend's rate limits answer RESOURCE_EXHAUSTED). At 64 the 500 starts of a burst trickled in
# while the first runs' work took the server: 58 starts/s against 103/s at 1,000 (the receiver's
# own calls, 500 at once, production server, FleetMedic's worker running them, 2 cores). The bound
# keeps a flood of batches from holding unbounded memory.
MAX_CONCURRENT_CALLS = 1000
# A firing alert's start and signal when its run keeps closing in between (a shadow run that ends
# as its alerts arrive): then 503, and Alertmanager sends it again.
DELIVERY_TRIES = 3
T = TypeVar("T")


class Metrics:
    def __init__(self, alertnames: frozenset[str]) -> None:
        self.registry = CollectorRegistry()
        # Alert names are untrusted: only routed names become label values, the rest are "other".
        self.alertnames = alertnames
        self.received = Counter("fleetmedic_alerts_received", "alerts received, by name and status",
                                ["alertname", "status"], registry=self.registry)
        self.runbooks = Counter("fleetmedic_webhook_runbooks", "alerts answered, by runbook and action",
                                ["runbook", "action"], registry=self.registry)
        self.alerts = Counter("fleetmedic_webhook_alerts", "alerts answered, by outcome (started, attached, "
                              "ignored, refused) and reason code", ["outcome", "reason"], registry=self.registry)
        self.rejected = Counter("fleetmedic_webhook_rejected", "requests refused, by reason", ["reason"],
                                registry=self.registry)
        self.latency = Histogram("fleetmedic_webhook_request_seconds", "time to answer a webhook request",
                                 registry=self.registry)
        self.insecure = Gauge("fleetmedic_webhook_insecure_no_auth", "1 when the webhook accepts alerts without "
                              "a token (--insecure-no-auth)", registry=self.registry)

    def alertname(self, name: str) -> str:
        return name if name in self.alertnames else "other"


class AlertReceiver:
    def __init__(self, client: Client, routing: RoutingPolicy, task_queue: str, token: str | None,
                 available: frozenset[str], max_body: int = MAX_BODY, temporal_timeout: float = 10.0,
                 max_calls: int = MAX_CONCURRENT_CALLS) -> None:
        self.client = client
        self.routing = routing
        self.task_queue = task_queue
        self.token = token
        self.available = available
        self.max_body = max_body
        # Temporal's time to answer an alert (its start, and the look at a closed run), and apart
        # from it the longest an alert waits for a call slot: past either the answer is 503 and
        # Alertmanager retries (within its notify budget: max(group_interval, 10 s)).
        self.temporal_timeout = temporal_timeout
        self.max_calls = max_calls
        self.calls = asyncio.Semaphore(max_calls)
        self.metrics = Metrics(frozenset(r.alertname for r in routing.routes))
        self.metrics.insecure.set(1 if token is None else 0)
        self.job_ends = JobEndReceiver(self)
        self.resends = ResendMemo()  # exact copies answered here, without a Temporal write (workers/resends.py)
        self.open_runs = OpenRuns()  # runs seen open here: an alert for one is its signal (workers/open_runs.py)

    # --- HTTP -----------------------------------------------------------------------------------

    def app(self) -> Starlette:
        jobs = self.job_ends
        return Starlette(routes=[
            Route("/v1/alerts/alertmanager", self.alerts, methods=["POST"]),
            Route("/v1/jobs/ended", jobs.ended, methods=["POST"]),
            Route("/v1/jobs/slurm", jobs.slurm, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ])

    def _refuse(self, status: int, reason: str, message: str) -> JSONResponse:
        self.metrics.rejected.labels(reason).inc()
        return JSONResponse({"error": message, "reason": reason}, status_code=status)

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
            return await self.answering(self._alerts(request), "an alert batch")
        finally:
            self.metrics.latency.observe(time.monotonic() - started)

    async def answering(self, answer: Awaitable[Response], what: str) -> Response:
        """Never a 500: the sender would resend for ever without anyone being told why."""
        try:
            return await answer
        except Exception:
            log.exception("unexpected error answering %s", what)
            return self._refuse(503, "internal_error", "internal error, retry (see the webhook's log)")

    async def read_request(self, request: Request) -> bytes | Response:
        """The body of an authorised request within the size limit, or the refusal (401, 413)."""
        if not self._authorized(request):
            return self._refuse(401, "unauthorized", "missing or wrong bearer token")
        body = await self._read_body(request)
        if body is None:
            return self._refuse(413, "too_large", f"body larger than {self.max_body} bytes")
        return body

    def unavailable(self, exc: TimeoutError | TemporalUnavailable | WebhookBusy) -> Response:
        if isinstance(exc, WebhookBusy):
            return self._refuse(503, "webhook_busy", str(exc))
        if isinstance(exc, TimeoutError):
            return self._refuse(503, "temporal_timeout",
                                f"Temporal did not answer within {self.temporal_timeout:g} s, retry")
        return self._refuse(503, "temporal_unavailable", f"Temporal unavailable, retry: {exc}")

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of the webhook's call slots, then `temporal_timeout` for Temporal to answer what is
        done inside. The wait for the slot is the webhook's own queue, bounded apart and told apart
        (WebhookBusy): an alert queued here behind a burst did not find Temporal slow, and its
        sender is not told so."""
        try:
            async with asyncio.timeout(self.temporal_timeout):
                await self.calls.acquire()
        except TimeoutError:
            raise WebhookBusy(f"webhook busy: its {self.max_calls} Temporal call slots stayed taken for "
                              f"{self.temporal_timeout:g} s, retry") from None
        try:
            async with asyncio.timeout(self.temporal_timeout):
                yield
        finally:
            self.calls.release()

    async def _alerts(self, request: Request) -> Response:
        body = await self.read_request(request)
        if isinstance(body, Response):
            return body
        try:
            payload = AlertmanagerPayload.model_validate(json.loads(body))
        except (ValueError, ValidationError, RecursionError) as exc:
            return self._refuse(400, "invalid", _reason(exc))
        handling = [asyncio.ensure_future(self.handle(alert)) for alert in payload.alerts]
        try:
            answers = await asyncio.gather(*handling)
        except (TimeoutError, TemporalUnavailable, WebhookBusy) as exc:
            return self.unavailable(exc)
        finally:  # the batch is answered 503 as a whole and resent: the rest of it stops here
            for task in handling:
                task.cancel()
        return JSONResponse({"alerts": [a.model_dump() for a in answers]}, status_code=202)

    async def healthz(self, request: Request) -> Response:
        insecure = {"warning": "accepting alerts without a token (--insecure-no-auth)"} if self.token is None else {}
        try:
            await self.client.service_client.check_health(timeout=timedelta(seconds=3))
        except Exception as exc:
            return JSONResponse({"ok": False, "temporal": str(exc), **insecure}, status_code=503)
        return JSONResponse({"ok": True, "temporal": "serving", **insecure})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- one alert ----------------------------------------------------------------------------

    async def handle(self, alert: Alert) -> AlertAnswer:
        self.metrics.received.labels(self.metrics.alertname(alert.labels.get("alertname", "")), alert.status).inc()
        decision = route(alert, self.routing, self.available)
        if isinstance(decision, Ignored):
            return self._answer(alert, decision.runbook, None, "ignored", decision.reason, decision.code)
        if isinstance(decision, Refused):
            return self._answer(alert, decision.runbook, None, "refused", decision.reason, decision.code)
        copy = self.resends.key(decision.workflow_id, alert, decision.route.reopen)
        if copy is not None and (age := self.resends.age(copy)) is not None:
            return self._answer(alert, decision.runbook, decision.workflow_id, "ignored",
                                f"an exact resend (fingerprint, startsAt, status) of an alert this webhook answered "
                                f"{age:.0f} s ago: its run has it, nothing written", "resend")
        try:
            if alert.status == "resolved":
                async with self.slot():
                    answer = await self._resolve(alert, decision)
            else:
                # Firing alerts for one run take turns (workers/open_runs.py), waiting for theirs
                # before a call slot, bounded apart; then its calls one after the other: a signal,
                # or a start (a closed run's look, a start), and the signal to a run it found open.
                async with self.open_runs.turn(decision.workflow_id, self.temporal_timeout), self.slot():
                    answer = await self._fire(alert, decision)
        except RPCError as exc:
            if (missing := missing_search_attribute(exc)) is not None:
                # Temporal's setup, not the alert (its labels never name a search attribute): a
                # namespace without FleetMedic's attributes, or one whose frontend has not seen them
                # yet (its namespace cache refreshes every few seconds). 503: Alertmanager retries.
                raise TemporalUnavailable(missing) from exc
            if exc.status == RPCStatusCode.INVALID_ARGUMENT:
                # Temporal refuses this alert's start (an ID or input it does not take): the rest of
                # the batch goes on, and the answer says why.
                return self._answer(alert, decision.runbook, decision.workflow_id, "refused",
                                    f"Temporal refused it: {exc.message[:200]}", "temporal_invalid_argument")
            raise TemporalUnavailable.from_rpc(exc) from exc
        if copy is not None:
            self.resends.remember(copy)
        return answer

    async def _fire(self, alert: Alert, decision: Routed) -> AlertAnswer:
        # One write for each alert (workers/open_runs.py): the start of a new run, which carries the
        # alert in its input, or a signal to the run already open. Called in the workflow ID's turn,
        # so the second GPU's alert of a node signals the run the first one started.
        for _ in range(DELIVERY_TRIES):
            if (run_id := self.open_runs.run_id(decision.workflow_id)) is not None:
                if await self._signal_run(alert, decision.workflow_id, run_id):
                    return self._answer(alert, decision.runbook, decision.workflow_id, "attached",
                                        f"signalled the running run {run_id}", "running_run")
                self.open_runs.closed(decision.workflow_id)  # it closed since: a start decides
            started = await self._start_run(alert, decision)
            if isinstance(started, AlertAnswer):
                return started
            self.open_runs.opened(decision.workflow_id, started.result_run_id or "")
            if _started(started):
                return self._answer(alert, decision.runbook, decision.workflow_id, "started",
                                    f"new run {started.result_run_id}", "new_run")
            # The start found a run open under the ID: the alert goes to it as a signal.
        raise TemporalUnavailable(f"the run of {decision.workflow_id} closed {DELIVERY_TRIES} times between its "
                                  "start and the alert's signal")

    async def _start_run(self, alert: Alert, decision: Routed) -> WorkflowHandle[Any, Any] | AlertAnswer:
        """Start the run, or find the one open (its handle); an answer when a closed run had this incident."""
        # One round trip for a new incident (no run under this ID, or one running): a closed run is
        # refused by the start, and only then read, to tell a resend of what it handled from a new fault.
        checks_closed = not decision.route.reopen and alert.starts_at is not None
        try:
            return await self._start(alert, decision, after_closed=not checks_closed)
        except WorkflowAlreadyStartedError:
            closed = await self._closed_run(decision.workflow_id)
            close_time, outcome = closed if closed is not None else (None, None)
            if close_time is not None and alert.starts_at is not None and alert.starts_at <= close_time:
                return self._answer(alert, decision.runbook, decision.workflow_id, "ignored",
                                    f"already remediated at {close_time.isoformat()}"
                                    + (f" (outcome {outcome})" if outcome else "")
                                    + "; the alert started before that run ended", "already_remediated")
            return await self._start(alert, decision, after_closed=True)

    async def _signal_run(self, alert: Alert, workflow_id: str, run_id: str | None = None) -> bool:
        """The alert to that run (`run_id`), or to the workflow ID's running one; False when it has
        closed or there is none (Temporal: NOT_FOUND)."""
        handle = self.client.get_workflow_handle(workflow_id, run_id=run_id or None)
        try:
            await self._temporal(lambda: handle.signal("alert", alert, rpc_timeout=self._rpc_timeout()))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    def _start(self, alert: Alert, decision: Routed, *, after_closed: bool) -> Awaitable[WorkflowHandle[Any, Any]]:
        # No start signal: the input carries the alert (decision.input.alert), and a run already open
        # under the ID is only found here (`started` false); _fire signals it.
        return self._temporal(lambda: start_or_attach(
            self.client, decision.runbook, decision.input, workflow_id=decision.workflow_id,
            task_queue=self.task_queue, result_type=RunbookStatus,
            search_attributes=start_attributes(decision.runbook, decision.cluster, decision.node,
                                               decision.input.xid),
            rpc_timeout=self._rpc_timeout(), after_closed=after_closed, task_timeout=RUNBOOK_TASK_TIMEOUT,
            summary=run_summary(decision.runbook, decision.cluster, decision.node, decision.input.xid,
                                decision.input.gpu, f"alert {alert.labels.get('alertname', '?')}"),
            details=run_details(decision.workflow_id, decision.runbook, decision.cluster, node=decision.node,
                                gpu=decision.input.gpu, xid=decision.input.xid, dry_run=decision.input.dry_run,
                                started_by=f"alert {alert.labels.get('alertname', '?')} (Alertmanager)")))

    async def _closed_run(self, workflow_id: str) -> tuple[datetime | None, str | None] | None:
        """(close time, outcome) of the latest run of `workflow_id` when it has closed; None when
        it runs or never ran."""
        try:
            description = await self._temporal(lambda: self.client.get_workflow_handle(workflow_id).describe(
                rpc_timeout=self._rpc_timeout()))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        if description.status == WorkflowExecutionStatus.RUNNING:
            return None
        return description.close_time, description.typed_search_attributes.get(FLEET_OUTCOME)

    async def _resolve(self, alert: Alert, decision: Routed) -> AlertAnswer:
        if not await self._signal_run(alert, decision.workflow_id):
            return self._answer(alert, decision.runbook, decision.workflow_id, "ignored",
                                "resolved, and no runbook is running for it", "resolved_not_running")
        return self._answer(alert, decision.runbook, decision.workflow_id, "attached",
                            "resolution delivered to the running run", "resolution")

    def _rpc_timeout(self) -> timedelta:
        return timedelta(seconds=self.temporal_timeout)

    async def _temporal(self, call: Callable[[], Awaitable[T]]) -> T:
        """A Temporal call, inside a `slot()`. Its own deadline passing is the slot's timeout
        (`temporal_timeout`, both): answered as Temporal not answering, not as it refusing."""
        try:
            return await call()
        except RPCError as exc:
            if exc.status == RPCStatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError from exc
            raise
        except RuntimeError as exc:  # the client could not connect at all
            raise TemporalUnavailable(str(exc)) from exc

    def _answer(self, alert: Alert, runbook: str | None, workflow_id: str | None, action: str,
                reason: str, code: str) -> AlertAnswer:
        self.metrics.runbooks.labels(runbook or "none", action).inc()
        self.metrics.alerts.labels(action, code).inc()
        return AlertAnswer(fingerprint=alert.fingerprint, runbook=runbook, workflow_id=workflow_id,
                           action=action, reason=reason, code=code)


def _started(handle: WorkflowHandle[Any, Any]) -> bool:
    # The start tells whether it created the run or found one open; the SDK keeps its response on the handle.
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
    if insecure_no_auth and not settings.webhook_token:
        log.warning("--insecure-no-auth: accepting alerts from anyone who reaches %s:%d without a token; "
                    "run it this way only on a trusted network", host, port)
    # Lazy: the webhook starts, and answers 503, while Temporal is unreachable.
    client = await connect(lazy=True)
    receiver = AlertReceiver(client, policy.routing, settings.task_queue, settings.webhook_token,
                             available_runbooks(), temporal_timeout=settings.webhook_temporal_timeout_s)
    config = uvicorn.Config(receiver.app(), host=host, port=port, log_level="info", access_log=False)
    freeze_startup_objects("webhook")  # before it answers: see workers/heap.py
    log.info("webhook listening on %s:%d, runbooks %s, clusters %s", host, port, sorted(receiver.available),
             list(policy.routing.served_clusters))
    await uvicorn.Server(config).serve()


def default_listen_host() -> str:
    """0.0.0.0 in a container (its network namespace is the boundary), else loopback only: on an
    operator's machine the webhook is not offered to the whole network by default."""
    in_container = (os.environ.get("KUBERNETES_SERVICE_HOST") or os.path.exists("/.dockerenv")
                    or os.path.exists("/run/.containerenv"))
    return "0.0.0.0" if in_container else "127.0.0.1"


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        where, why = validation_errors(exc)[0]
        return f"invalid Alertmanager payload: {where or '(body)'}: {why}"
    return f"body is not JSON: {exc}"
