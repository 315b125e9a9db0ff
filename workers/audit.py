"""`fleetmedic audit <workflow-id>`: one run's timeline, read from its Temporal history.

The alert that started it, every decision with its reason (the runbook's report), every external
call with its result and duration, escalations and who answered them, operator signals, and the
outcome. The history is the record: this works for a run closed months ago, with no worker up.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHistory
from temporalio.service import RPCError

_ENDED = (EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
          EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED)


def _decode(client: Client, payloads: Any) -> Any:
    values = [client.data_converter.payload_converter.from_payload(p) for p in payloads.payloads]
    return values[0] if len(values) == 1 else values


def _summary(client: Client, event: HistoryEvent) -> str:
    if event.HasField("user_metadata") and event.user_metadata.HasField("summary"):
        return str(client.data_converter.payload_converter.from_payload(event.user_metadata.summary, str))
    return ""


LOCAL_ACTIVITY_MARKER = "core_local_activity"


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, dict) or "seconds" not in value:
        return None
    return datetime.fromtimestamp(int(value["seconds"]) + int(value.get("nanos", 0)) / 1e9, UTC).replace(tzinfo=None)


def local_activity(event: HistoryEvent) -> dict[str, Any] | None:
    """A local activity the run ran inside a workflow task (the protective step, the configuration
    reads), as the SDK's core records it: a marker with its type, its attempt, when it was done (the
    `complete_time` the SDK stamps, by the worker's clock: measured with 50 workflow tasks at once,
    up to 0.25 s before the step's own requests reached the API server, so an order, not a
    latency; the marker keeps no start: its `original_schedule_time` serves timeouts across
    backoffs and may be later than the completion), and its result or failure. None for any other
    event."""
    if not event.HasField("marker_recorded_event_attributes"):
        return None
    attrs = event.marker_recorded_event_attributes
    if attrs.marker_name != LOCAL_ACTIVITY_MARKER or "data" not in attrs.details:
        return None
    data = json.loads(attrs.details["data"].payloads[0].data)
    return {"type": str(data.get("activity_type", "?")), "attempt": int(data.get("attempt") or 1),
            "done": _timestamp(data.get("complete_time")) or event_time(event),
            "failure": attrs.failure.message if attrs.HasField("failure") else None,
            "result": attrs.details["result"] if "result" in attrs.details else None}


def event_time(event: HistoryEvent) -> datetime:
    """When the server recorded the event (naive UTC, microseconds)."""
    return event.event_time.ToDatetime().replace(microsecond=event.event_time.nanos // 1000)


def timeline(client: Client, history: WorkflowHistory, live_status: dict[str, Any] | None = None) -> dict[str, Any]:
    """The audit of one run as data: `entries` in time order, plus the run's own report (for a run
    still open, `live_status`: its `status` query, when a worker answered it)."""
    entries: list[dict[str, Any]] = []
    scheduled: dict[int, tuple[str, str, datetime]] = {}
    report: Any = None
    started_input: Any = None
    for event in history.events:
        at = event_time(event)
        kind = event.event_type
        attrs: Any  # each event type has its own attributes message
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            attrs = event.workflow_execution_started_event_attributes
            started_input = _decode(client, attrs.input) if attrs.input.payloads else None
            entries.append({"at": at, "kind": "started", "what": attrs.workflow_type.name,
                            "detail": started_input, "by": attrs.identity})
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = (attrs.activity_type.name, _summary(client, event), at)
        elif kind in (EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
                      EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT):
            if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                attrs = event.activity_task_completed_event_attributes
                detail = _decode(client, attrs.result) if attrs.result.payloads else None
                status = "ok"
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
                attrs = event.activity_task_failed_event_attributes
                detail, status = attrs.failure.message, "failed"
            else:
                attrs = event.activity_task_timed_out_event_attributes
                detail, status = attrs.failure.message, "timed out"
            name, summary, start = scheduled.get(attrs.scheduled_event_id, ("?", "", at))
            entries.append({"at": start, "kind": "call", "what": name, "summary": summary, "status": status,
                            "duration_ms": round((at - start).total_seconds() * 1000), "detail": detail})
        elif (ran := local_activity(event)) is not None:
            result = _decode(client, ran["result"]) if ran["result"] and ran["result"].payloads else None
            entries.append({"at": ran["done"], "kind": "call", "what": ran["type"], "local": True,
                            "summary": _summary(client, event), "status": "failed" if ran["failure"] else "ok",
                            "attempt": ran["attempt"], "duration_ms": None, "detail": ran["failure"] or result})
        elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
            attrs = event.timer_started_event_attributes
            entries.append({"at": at, "kind": "timer", "what": _summary(client, event) or "durable wait",
                            "detail": f"{attrs.start_to_fire_timeout.ToTimedelta()}"})
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = event.workflow_execution_signaled_event_attributes
            entries.append({"at": at, "kind": "signal", "what": attrs.signal_name, "by": attrs.identity,
                            "detail": _decode(client, attrs.input) if attrs.input.payloads else None})
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            attrs = event.workflow_execution_completed_event_attributes
            report = _decode(client, attrs.result) if attrs.result.payloads else None
            entries.append({"at": at, "kind": "completed", "what": (report or {}).get("outcome", "")
                            if isinstance(report, dict) else str(report), "detail": None})
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            attrs = event.workflow_execution_update_accepted_event_attributes
            request = attrs.accepted_request
            arg = _decode(client, request.input.args) if request.input.args.payloads else None
            by = arg.get("by", "") if isinstance(arg, dict) else ""
            entries.append({"at": at, "kind": "update", "what": request.input.name, "by": by or request.meta.identity,
                            "detail": arg})
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED:
            attrs = event.workflow_execution_update_completed_event_attributes
            outcome = attrs.outcome
            detail = (outcome.failure.message if outcome.HasField("failure") else
                      _decode(client, outcome.success) if outcome.success.payloads else None)
            entries.append({"at": at, "kind": "update", "what": "answered", "detail": detail})
        elif kind in _ENDED:
            entries.append({"at": at, "kind": "ended", "what": EventType.Name(kind).removeprefix("EVENT_TYPE_"),
                            "detail": None})
    if report is None and live_status is not None:  # a run still open: its decisions so far
        report = live_status
    if isinstance(report, dict):
        for decision in report.get("decisions", []):
            entries.append({"at": datetime.fromisoformat(decision["at"]).replace(tzinfo=None), "kind": "decision",
                            "what": decision["step"], "detail": decision["result"]})
    entries.sort(key=lambda e: (e["at"], e["kind"] != "started"))
    return {"workflow_id": history.workflow_id, "input": started_input, "report": report, "entries": entries}


def render_markdown(audit: dict[str, Any]) -> str:
    report = audit["report"] if isinstance(audit["report"], dict) else {}
    lines = [f"# Audit of `{audit['workflow_id']}`", ""]
    if report:
        mode = " (shadow mode: nothing was changed)" if report.get("dry_run") else ""
        where = (f"- Node: {report.get('node')} in cluster {report.get('cluster')}" if report.get("node")
                 else f"- Cluster: {report.get('cluster')}")
        outcome = report.get("outcome") or f"still running, at {report.get('step')}"
        lines += [f"- Outcome: **{outcome}**{mode}", f"- Runbook: {report.get('runbook')}", where, ""]
    lines += ["| time (UTC) | kind | what | detail |", "|---|---|---|---|"]
    for entry in audit["entries"]:
        detail = entry.get("detail")
        if entry["kind"] == "call":
            took = "in the workflow task" if entry.get("local") else f"{entry['duration_ms']} ms"
            what = f"{entry['what']} ({entry['status']}, {took})"
            detail = _short(detail)  # an activity's result can be large: the JSON audit has all of it
        else:
            what = entry["what"] + (f" by {entry['by']}" if entry.get("by") else "")
            detail = _short(detail, limit=None)  # decisions, signals, approvals: whole
        lines.append(f"| {entry['at']:%Y-%m-%d %H:%M:%S.%f}"[:-3] + f" | {entry['kind']} | {what} | {detail} |")
    if report.get("actions"):
        lines += ["", "## Changes made" + (" (would have been made)" if report.get("dry_run") else ""), ""]
        lines += [f"- {action}" for action in report["actions"]]
    return "\n".join(lines) + "\n"


def _short(value: Any, limit: int | None = 400) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


async def audit_command(client: Client, workflow_id: str, fmt: str) -> int:
    handle = client.get_workflow_handle(workflow_id)
    history = await handle.fetch_history()
    live: dict[str, Any] | None = None
    if not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED or e.event_type in _ENDED
               for e in history.events):
        try:  # open: ask the run itself for its decisions so far
            live = (await handle.query("status", rpc_timeout=timedelta(seconds=3))) or None
        except RPCError:
            live = None
    audit = timeline(client, history, live)
    if fmt == "json":
        json.dump(audit, sys.stdout, default=str, indent=2)
        print()
    else:
        print(render_markdown(audit), end="")
    return 0
