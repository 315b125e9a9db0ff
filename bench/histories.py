"""What the server's histories say about a benchmark's runs: the tasks that timed out, and how long
the worker held the workflow tasks it did finish. Read from the server, not from the worker's
bookkeeping, after the timed part of a benchmark."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from bench.stats import percentile
from workers.audit import LOCAL_ACTIVITY_MARKER

LOST = "workflow_tasks_handed_out_never_done"
KINDS = {TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE: LOST,
         TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START: "sticky_tasks_not_picked_up"}


ACTIVITY_TIMED_OUT = "activity_attempts_timed_out"


def timeout_kind(event: HistoryEvent) -> str | None:
    if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
        return KINDS.get(event.workflow_task_timed_out_event_attributes.timeout_type, "other")
    started = event.activity_task_started_event_attributes
    if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and started.attempt > 1 \
            and started.last_failure.HasField("timeout_failure_info"):
        return ACTIVITY_TIMED_OUT
    return None


def activity_timeout(event: HistoryEvent, scheduled: dict[int, str]) -> str:
    """`<activity type>: <timeout>` of an activity attempt that timed out (its retry's started event
    carries the failure): which calls a storm makes late, and how (start-to-close: the call ran too
    long or its result came too late; heartbeat: a wait that went quiet)."""
    started = event.activity_task_started_event_attributes
    timeout = TimeoutType.Name(started.last_failure.timeout_failure_info.timeout_type)
    return f"{scheduled.get(started.scheduled_event_id, '?')}: {timeout.removeprefix('TIMEOUT_TYPE_').lower()}"


async def timed_out_tasks(client: Client, query: str, server_log: Path | None = None) -> dict[str, Any]:
    """Tasks that timed out in every run `query` lists, by kind. A workflow task handed out and never
    done (start-to-close) went to a poll and no worker ran it: the run sat idle for its whole
    workflow-task timeout before the task was given out again. A sticky task not picked up
    (schedule-to-start) waited for the worker that ran the run's last step until the sticky timeout
    (10 s), then went back to the shared queue. An activity attempt that timed out (its retry's
    started event carries the failure) is counted whatever the cause. And how long the workflow
    tasks that were done were held, from hand-out to done: what a workflow-task timeout must allow
    for, lest a task the worker is running be given out again. With the server's log (temporal-server's
    JSON lines), what it says of the runs that lost a workflow task (`server_says`)."""
    ids = [w.id async for w in client.list_workflows(query)]
    gate = asyncio.Semaphore(16)
    # Apart: tasks that ran a local activity (the protective step), which the SDK keeps alive past
    # 80 % of the timeout, and the others, which must be done within it (a task kept alive that way
    # is done at 80 % without its local activity's marker, and counts among the others).
    held: dict[bool, list[float]] = {True: [], False: []}
    activities: Counter[str] = Counter()
    lost: set[str] = set()

    async def timeouts(workflow_id: str) -> list[str]:
        handed_out: dict[int, float] = {}
        scheduled: dict[int, str] = {}  # activity scheduled event id -> its type
        found: list[str] = []
        last: float | None = None  # the last task done, until its commands show whether it ran one
        async with gate:
            async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
                at = event.event_time.ToDatetime().timestamp()
                if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                    scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                    handed_out[event.event_id] = at
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                    if last is not None:
                        held[False].append(last)
                    # A task whose started event the history lacks (seen once, with tiny rounds on the
                    # dev server: KeyError lost the whole server's section) is left out, not guessed.
                    started = handed_out.get(event.workflow_task_completed_event_attributes.started_event_id)
                    last = at - started if started is not None else None
                elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED and last is not None \
                        and event.marker_recorded_event_attributes.marker_name == LOCAL_ACTIVITY_MARKER:
                    held[True].append(last)
                    last = None
                elif kind := timeout_kind(event):
                    found.append(kind)
                    if kind == ACTIVITY_TIMED_OUT:
                        activities[activity_timeout(event, scheduled)] += 1
                    if kind == LOST:  # to set beside the server's log, which names the run
                        lost.add(workflow_id)
                        print(f"lost workflow task: {workflow_id}, timed out at {event.event_time.ToJsonString()}",
                              file=sys.stderr)
            if last is not None:
                held[False].append(last)
        return found

    found = await asyncio.gather(*(timeouts(i) for i in ids))
    names = (*KINDS.values(), "other", ACTIVITY_TIMED_OUT)
    return {"runs": len(ids), **{name: sum(f.count(name) for f in found) for name in names},
            "activity_attempts_timed_out_by_type": dict(activities.most_common()),
            "runs_with_a_lost_workflow_task": sum(1 for f in found if LOST in f),
            **({"server_says_of_runs_that_lost_one": server_says(server_log, lost)} if server_log else {}),
            "workflow_tasks_done": {"with_a_local_activity": spread(held[True]), "others": spread(held[False])}}


def server_says(log: Path, runs: set[str]) -> dict[str, Any]:
    """What temporal-server's own log (JSON lines, warn and above) says of `runs`: its lines that
    name one of them, counted by message, queue task and error. A task handed out and never done is
    the server's loss, not the worker's, when the server logged failing to hand it out."""
    said: Counter[str] = Counter()
    named: set[str] = set()
    with log.open(errors="replace") as lines:
        for line in lines:
            if '"wf-id"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("wf-id") in runs:
                named.add(entry["wf-id"])
                what = (entry.get("msg"), entry.get("queue-task-type"), entry.get("error-type") or entry.get("error"))
                said[": ".join(str(part) for part in what if part)] += 1
    return {"runs": len(runs), "runs_it_names": len(named), "lines": dict(said.most_common())}


def spread(held: list[float]) -> dict[str, Any]:
    """How long tasks were held, hand-out to done."""
    if not held:
        return {"tasks": 0}
    return {"tasks": len(held), "held_p99_s": round(percentile(held, 99), 3),
            "held_p999_s": round(percentile(held, 99.9), 3), "held_max_s": round(max(held), 3)}
