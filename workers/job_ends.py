"""The webhook's job-failure endpoints: training jobs' ends into the cluster's job-failures runbook.

- `POST /v1/jobs/ended`: `{"jobs": [JobEnd, ...]}` (fleetmedic/job_failures.py), from a training
  framework's own hook or any other source;
- `POST /v1/jobs/slurm`: the form Slurm's jobcomp script posts (deploy/slurm/fleetmedic-jobcomp):
  the variables jobcomp/script gives it (JOBID, JOBSTATE, NODES, EXITCODE, START, END, JOBNAME),
  url-encoded by curl, so a job name can hold any character without breaking the request.

The same token, body limit and answers as the alert webhook: 202 with one entry per job end
(`recorded`, `ignored`, `refused`, with the reason), 400 for a body that is not one, 401, 413, 503
when Temporal cannot take it (the sender retries; what already arrived is known by its key). A bad
entry is refused alone; everything refused or ignored is counted on /metrics by reason.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl

from prometheus_client import Counter
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from temporalio.service import RPCError, RPCStatusCode

from activities.start import start_or_attach
from fleetmedic.errors import validation_errors
from fleetmedic.ids import cluster_workflow_id
from fleetmedic.job_failures import JobEnd, JobEndAnswer, JobEndsPost, from_jobcomp
from fleetmedic.trust import UntrustedValue, checked_cluster
from workers.temporal_client import TemporalUnavailable, WebhookBusy

if TYPE_CHECKING:
    from workers.webhook import AlertReceiver

# Clocks disagree a little; an end later than this is a sender's mistake (it would stay in the
# evidence window for ever).
FUTURE_SKEW = timedelta(minutes=5)
# jobcomp/script variables the endpoint reads; anything else in the form is ignored.
JOBCOMP_FIELDS = ("JOBID", "JOBSTATE", "NODES", "EXITCODE", "START", "END", "JOBNAME", "CLUSTER")


def job_failures_id(cluster: str) -> str:
    return cluster_workflow_id("job-failures", cluster)


class JobEndReceiver:
    def __init__(self, receiver: AlertReceiver) -> None:
        self.receiver = receiver
        self.answers = Counter("fleetmedic_webhook_job_ends", "job ends answered, by action (recorded, ignored, "
                               "refused) and reason", ["action", "reason"], registry=receiver.metrics.registry)

    async def ended(self, request: Request) -> Response:
        return await self._guarded(request, self._parse_json)

    async def slurm(self, request: Request) -> Response:
        return await self._guarded(request, self._parse_jobcomp)

    async def _guarded(self, request: Request, parse: Any) -> Response:
        return await self.receiver.answering(self._answer_all(request, parse), "job ends")

    async def _answer_all(self, request: Request, parse: Any) -> Response:
        receiver = self.receiver
        body = await receiver.read_request(request)
        if isinstance(body, Response):
            return body
        try:
            entries = parse(body)
        except (ValueError, ValidationError, RecursionError) as exc:
            return receiver._refuse(400, "invalid_job_ends", _reason(exc))
        try:
            # One by one, in order: a job's failure and then its completion reach its run that way.
            answers = [await self._one(index, raw) for index, raw in enumerate(entries)]
        except (TimeoutError, TemporalUnavailable, WebhookBusy) as exc:
            return receiver.unavailable(exc)
        return JSONResponse({"jobs": [a.model_dump() for a in answers]}, status_code=202)

    def _parse_json(self, body: bytes) -> list[dict[str, Any]]:
        return [dict(e) for e in JobEndsPost.model_validate(json.loads(body)).jobs]

    def _parse_jobcomp(self, body: bytes) -> list[dict[str, Any]]:
        fields = dict(parse_qsl(body.decode("utf-8", errors="strict"), keep_blank_values=True, max_num_fields=64))
        return [{"jobcomp": {k: v[:4096] for k, v in fields.items() if k in JOBCOMP_FIELDS}}]

    async def _one(self, index: int, raw: dict[str, Any]) -> JobEndAnswer:
        routing = self.receiver.routing
        try:
            if "jobcomp" in raw:
                jobcomp = raw["jobcomp"]
                if str(jobcomp.get("JOBSTATE", "")).upper() in ("PENDING", "REQUEUED", "RUNNING"):
                    return self._answer(index, jobcomp.get("JOBID"), "ignored", "not an end (Slurm runs jobcomp at a "
                                        "requeue too)", "not_an_end")
                end = from_jobcomp(jobcomp, jobcomp.get("CLUSTER") or None)
            else:
                end = JobEnd.model_validate(raw)
            cluster = checked_cluster(end.cluster, routing.served_clusters, routing.default_cluster)
        except ValidationError as exc:
            where, why = validation_errors(exc)[0]
            return self._answer(index, None, "refused", f"{where or 'entry'}: {why}", "invalid")
        except (UntrustedValue, ValueError) as exc:
            return self._answer(index, None, "refused", str(exc)[:300], "invalid")
        if not end.ended:
            return self._answer(index, end.job, "ignored", f"state {end.state} is not an end", "not_an_end")
        # Checked here, not in the model: the workflow validates the same JobEnd when it replays a
        # signal, and a rule on the clock would refuse on replay what it took when it arrived.
        if end.ended_at > datetime.now(UTC) + FUTURE_SKEW:
            return self._answer(index, end.job, "refused", f"ended_at {end.ended_at.isoformat()} is in the future",
                                "invalid")
        end = end.model_copy(update={"cluster": cluster})
        try:
            async with self.receiver.slot():
                await self.receiver._temporal(lambda: start_or_attach(
                    self.receiver.client, "job-failures", {"cluster": cluster}, workflow_id=job_failures_id(cluster),
                    task_queue=self.receiver.task_queue, signal="ended", signal_args=[end],
                    rpc_timeout=self.receiver._rpc_timeout(), summary=f"job-failures {cluster}",
                    details="training-job failures: let it crash; if it persists, find the node"))
        except RPCError as exc:
            if exc.status == RPCStatusCode.INVALID_ARGUMENT:
                return self._answer(index, end.job, "refused", f"Temporal refused it: {exc.message[:200]}",
                                    "temporal_invalid_argument")
            raise TemporalUnavailable.from_rpc(exc) from exc
        return self._answer(index, end.job, "recorded", f"{end.state} on {len(end.nodes)} node(s)", "recorded")

    def _answer(self, index: int, job: object, action: Literal["recorded", "ignored", "refused"], reason: str,
                code: str) -> JobEndAnswer:
        self.answers.labels(action, code).inc()
        return JobEndAnswer(index=index, job=str(job)[:128] if job is not None else None, action=action,
                            reason=reason)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        where, why = validation_errors(exc)[0]
        return f"invalid job ends: {where or '(body)'}: {why}"
    return f"body is not JSON or a form: {str(exc)[:200]}"
