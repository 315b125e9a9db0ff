"""Starting a runbook (or the fleet guard) the one way FleetMedic does: the workflow ID names the
incident, so a second start attaches to the run already open under it instead of starting
another, and a closed ID may run again. The webhook, the CLI and the activities share it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.common import TypedSearchAttributes, WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import fail
from fleetmedic.errors import ErrorKind

# What a workflow too busy to take a signal in time looks like: thousands of runs signalling one
# workflow at once meet the server's lock on its history ("Workflow is busy", after the client's own
# ~10 s of retries), its deadline, or the client's (CANCELLED, "Timeout expired": 11 of 5,000 runs
# started together in bench/worker_scale). Worth another try, not a traceback.
BUSY = (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.CANCELLED)

# How long a runbook's workflow task may be out with a worker before the server gives it out again:
# the SDK's 10 s. The clock starts when the server records the task handed out, not when the worker
# gets it, and a busy production server takes seconds between the two: with 5,000 runs started
# together on temporal-server with PostgreSQL (bench/worker_scale), the worker got first tasks 2.1-3.1 s
# after the server had stamped them started, and held them 5.0-5.7 s for the protective step (a
# local activity waiting its turn at slurmctld). At 7 s (this was 7 before 0.2.0) nearly every one of
# those timed out, was given out again and was done again: 521 tasks thrown away in the first four
# minutes, and 498 runs past their first task. The SDK's keep-alive of a task whose local activity
# runs long comes at 80 % of this after the worker got it, so it too must fit in what the server's
# delay leaves. What 10 s costs: a task a saturated server records as handed out to a poll that never
# gets it (its push to matching timed out; tens in a thousand runs started together) leaves its run
# idle 10 s before its next step, 3 s more than at 7. The fleet guard keeps the default as well.
RUNBOOK_TASK_TIMEOUT = timedelta(seconds=10)


async def start_or_attach(client: Client, workflow: str, arg: Any, *, workflow_id: str, task_queue: str,
                          signal: str | None = None, signal_args: Sequence[Any] = (),
                          search_attributes: TypedSearchAttributes | None = None, result_type: type | None = None,
                          rpc_timeout: timedelta | None = None, summary: str | None = None,
                          details: str | None = None, after_closed: bool = True,
                          task_timeout: timedelta | None = None) -> WorkflowHandle[Any, Any]:
    """Start `workflow`, or attach to its open run; `signal` reaches the run either way
    (signal-with-start). The handle's `result_run_id` says which run it is. `summary` and `details`:
    what the Temporal UI shows for the run (what, where, why), instead of "No summary available".
    `after_closed=False`: refuse (WorkflowAlreadyStartedError) when the ID has a closed run, so the
    caller can look at it first — one round trip for the common case, a new incident. `task_timeout`:
    its workflow tasks' (RUNBOOK_TASK_TIMEOUT for a runbook), else the SDK's 10 s."""
    return await client.start_workflow(
        workflow, arg, id=workflow_id, task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=(WorkflowIDReusePolicy.ALLOW_DUPLICATE if after_closed
                         else WorkflowIDReusePolicy.REJECT_DUPLICATE),
        start_signal=signal, start_signal_args=list(signal_args), search_attributes=search_attributes,
        result_type=result_type, rpc_timeout=rpc_timeout, static_summary=summary,
        static_details=details, task_timeout=task_timeout)


# What an activity attempt keeps of its start-to-close to report back after its call gave up.
REPORT_MARGIN = timedelta(seconds=2)


def attempt_deadline() -> timedelta | None:
    """The RPC deadline of a call that is all its activity does: what is left of the attempt's
    start-to-close, which runs from the server's hand-out (a busy worker may take seconds to begin
    it), less time to report back. At least a second. Outside an activity, the client's own (30 s)."""
    if not activity.in_activity() or (timeout := activity.info().start_to_close_timeout) is None:
        return None
    begun = max(datetime.now(UTC) - activity.info().started_time, timedelta(0))
    return max(timeout - begun - min(REPORT_MARGIN, timeout / 4), timedelta(seconds=1))


async def signal_shared(client: Client, workflow: str, arg: Any, *, refused: str, workflow_id: str, task_queue: str,
                        signal: str, **options: Any) -> WorkflowHandle[Any, Any]:
    """`start_or_attach` with a signal, for a workflow that every run of a cluster signals (its fleet
    guard, its Kueue quota sync): a server too busy to take it fails the attempt with `refused` and
    the reason on one line, retryable, so the step's bounded retry sends it again and an exhausted
    one escalates (or is let go) with that line, not a gRPC dump. From an activity, the call gives
    up within the attempt (`attempt_deadline`), so the attempt fails with that line: with the
    client's default deadline, the same 30 s as a call's attempt, the attempt timed out first (97
    times in bench/xid_latency's ramp of 1,000 runs), its history said only "timed out", and the
    worker's log warned of every answer that came after."""
    options.setdefault("rpc_timeout", attempt_deadline())
    try:
        return await start_or_attach(client, workflow, arg, workflow_id=workflow_id, task_queue=task_queue,
                                     signal=signal, **options)
    except RPCError as exc:
        if exc.status not in BUSY:
            raise
        raise fail(ErrorKind.UNAVAILABLE, f"{refused} ({exc.status.name}: {exc.message})") from None
