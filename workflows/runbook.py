"""The runbook engine every FleetMedic workflow stands on.

A `Runbook` owns one incident. It gives each runbook, without repeating it:
- operator controls: query `status`; signals `pause`, `resume`, `abort`, `alert` (a duplicate or
  resolved alert attaches here), `answer` (retry / skip / abort an escalation), `replaced`;
- `call()`: one activity with its timeout and a bounded retry policy; when the retries run out
  the step escalates (Slack mention) and waits for an operator's answer instead of vanishing;
- the safety gate before every destructive step (`hold_before_destructive`): an aborted run
  ends, a paused run (or fleet) waits, the opt-out of what the step touches is read again, and
  shadow (dry-run) runs record "would …" instead of acting, page nobody, and end `dry-run`;
- the Slack thread of the run and the `FleetStep` / `FleetOutcome` search attributes.

No I/O here: everything external is an activity, referenced by name so the sandbox never
imports a client library.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import MetricMeter, RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, ValidationError

    from fleetmedic import activity_refs as refs
    from fleetmedic import ids
    from fleetmedic.activity_refs import Activity, NoArgs
    from fleetmedic.details import current_details
    from fleetmedic.errors import NON_RETRYABLE, validation_errors
    from fleetmedic.models import (
        ActionResult,
        Alert,
        Approval,
        Escalation,
        EscalationAnswer,
        EventRequest,
        LeaseAnswer,
        NotifyResult,
        NotifyStart,
        NotifyStep,
        Operator,
        OptOut,
        Replaced,
        RunbookStatus,
        StepRecord,
    )
    from fleetmedic.policy import Policy, shared
    from fleetmedic.trust import node_name_error


In = TypeVar("In")
Out = TypeVar("Out")

# Until the policy is loaded (its own activity), the defaults of the policy apply.
READ_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=20),
                         maximum_attempts=8, non_retryable_error_types=list(NON_RETRYABLE))
NOTIFY_RETRY = RetryPolicy(maximum_attempts=2)
SHORT = timedelta(seconds=30)
# A step that evicts while it waits hears an abort within 0.8 × this (runbook.evicting_heartbeat).
EVICTING_HEARTBEAT = timedelta(seconds=10)
CONFIGURATION_TRIES = 3  # a configuration read the worker cancelled, tried again in the same task
CANCELLED = "Cancelled"  # the error type of a local activity the worker cancelled (`local`)


class ConfigurationCancelled(RuntimeError):
    """The worker's configuration could not be read in this workflow task (`configuration`). Not a
    Temporal failure: it fails the task, which the server gives to a worker again, not the run."""


class RunbookAborted(Exception):
    """An operator aborted the run (or an escalation); the runbook ends in `aborted`."""

    def __init__(self, by: str, reason: str) -> None:
        super().__init__(f"aborted by {by}: {reason}")
        self.by, self.reason = by, reason


class DryRunEnded(Exception):
    """A dry (shadow) run met an error where a live run would escalate: it ends `dry-run` instead
    of paging a person about a run that was never going to change anything."""

    def __init__(self, step: str, error: str) -> None:
        super().__init__(f"{step}: {error}")
        self.step, self.error = step, error


# Outcomes that change nothing, live or dry: a dry run ends with them as they are. Every other
# outcome of a dry run becomes `dry-run` ("would have ended remediated: …").
UNCHANGED_OUTCOMES = frozenset({"unknown-node", "invalid-input", "notified", "ignored", "escalated", "recovered",
                                "not-needed", "not-yet", "nothing-to-move"})

NOT_SHOWN = object()  # a search attribute this run has not written yet (`Runbook.shown`)

# How often a runbook without a lease asks the fleet guard whether the fleet is still paused
# (a long pause costs a few events a minute in its history, not a few a second).
FLEET_PAUSE_POLL = timedelta(minutes=1)


class Runbook:
    """Base class of every runbook workflow: state, operator handlers and step helpers."""

    runbook = "runbook"

    def _init_state(self, cluster: str, node: str, workflow_id: str, dry_run: bool) -> None:
        self.cluster, self.node, self.workflow_id = cluster, node, workflow_id
        self.dry_run = dry_run
        self.policy: Policy | None = None
        self.step_name = "starting"
        self._waiting_for: str | None = None
        self.paused: Operator | None = None
        self.abort_request: Operator | None = None
        self.abort_honoured = False  # raised once: what follows (the outcome, recovery) must still run
        self._escalation: Escalation | None = None
        self.escalation_answer: EscalationAnswer | None = None
        self.replaced_signal: Replaced | None = None
        self.skipped = 0  # steps an operator answered `skip` (their call returned None)
        self.alerts: list[Alert] = []
        # Alertmanager resends a firing alert every repeat_interval and the whole group when any
        # alert in it changes: one incident is one (fingerprint, startsAt, status), however often
        # it arrives. Indices into `alerts` of the resends, which count as no new occurrence.
        self.alert_keys: set[tuple[str, str, str]] = set()
        self.alert_resends: set[int] = set()
        self.decisions: list[StepRecord] = []
        self.actions: list[ActionResult] = []
        self.outcome: str | None = None
        self.thread: NotifyResult | None = None
        self.thread_task: asyncio.Future[NotifyResult] | None = None
        self.thread_text: str | None = None  # a thread held back until the protective step is done
        self.lease_answer: LeaseAnswer | None = None
        self._awaiting_approval: str | None = None
        self.approval: tuple[str, Approval] | None = None  # ("approve" | "reject", who and why)
        self.fleet_paused: Operator | None = None  # the fleet guard's global pause
        # Search attributes held until the run next waits (`show`), and those written, by name.
        self.unshown: dict[str, SearchAttributeUpdate[Any]] = {}
        self.shown_values: dict[str, Any] = {}

    @property
    def waiting_for(self) -> str | None:
        return self._waiting_for

    @waiting_for.setter
    def waiting_for(self, what: str | None) -> None:
        self._waiting_for = what
        self.show_details()

    # An escalation and an approval wait show in the details as soon as they are set: a runbook
    # sets one, then calls Slack, then waits, and a query in between must not see the old details.
    @property
    def escalation(self) -> Escalation | None:
        return self._escalation

    @escalation.setter
    def escalation(self, escalation: Escalation | None) -> None:
        self._escalation = escalation
        self.show_details()

    @property
    def awaiting_approval(self) -> str | None:
        return self._awaiting_approval

    @awaiting_approval.setter
    def awaiting_approval(self, step: str | None) -> None:
        self._awaiting_approval = step
        self.show_details()

    def show_details(self) -> None:
        """Keep the UI's Current Details true: step, what the run waits for, what an operator can do
        (metadata only: no command, no history event, nothing a replay compares). An evicted run's
        coroutines close outside the workflow's loop (`wait()`'s `finally`): nothing to show then."""
        if not workflow.in_workflow():
            return
        workflow.set_current_details(current_details(
            self.workflow_id, self.step_name, waiting_for=self._waiting_for, dry_run=self.dry_run,
            escalation=self.escalation, awaiting_approval=self.awaiting_approval,
            paused=self.paused or self.fleet_paused, outcome=self.outcome))

    # --- operator handlers --------------------------------------------------------------------

    @workflow.query(description="Where the run is: step, what it waits for and why, decisions, changes made")
    def status(self) -> RunbookStatus:
        return RunbookStatus(
            runbook=self.runbook, workflow_id=self.workflow_id, cluster=self.cluster, node=self.node,
            step=self.step_name, waiting_for=self.waiting_for, dry_run=self.dry_run,
            paused=self.paused or self.fleet_paused, awaiting_approval=self.awaiting_approval,
            escalation=self.escalation, outcome=self.outcome, decisions=list(self.decisions),
            actions=[a.summary for a in self.actions],
        )

    @workflow.signal(description='Hold before the next destructive step: {"by": "alice", "reason": "..."}')
    def pause(self, operator: Operator) -> None:
        self.paused = operator

    @workflow.signal(description='Lift this run\'s pause: {"by": "alice"}')
    def resume(self, operator: Operator) -> None:
        self.paused = None

    @workflow.signal(description='Abort the run; what it changed stays, annotated: {"by": "alice", "reason": "..."}')
    def abort(self, operator: Operator) -> None:
        self.abort_request = operator

    @workflow.signal(description="Internal (the webhook): a repeated or resolved alert for this incident")
    def alert(self, alert: Alert) -> None:
        """A duplicate, repeated or resolved alert for the incident this run owns."""
        self.remember_alert(alert)

    def remember_alert(self, alert: Alert) -> None:
        key = (alert.fingerprint, alert.starts_at.isoformat() if alert.starts_at else "", alert.status)
        if alert.fingerprint and key in self.alert_keys:
            self.alert_resends.add(len(self.alerts))
        self.alert_keys.add(key)
        self.alerts.append(alert)

    def new_alerts(self, since: int) -> list[Alert]:
        """Alerts that arrived after index `since`, less resends of an incident already seen."""
        return [a for i, a in enumerate(self.alerts) if i >= since and i not in self.alert_resends]

    @workflow.signal(description='Answer an escalation: {"action": "retry|skip|abort", "by": "alice", "reason": "..."}')
    def answer(self, answer: EscalationAnswer) -> None:
        if self.escalation is not None:
            self.escalation_answer = answer

    @workflow.signal(description='A person replaced or repaired the node: {"by": "alice", "new_node": null}')
    def replaced(self, replaced: Replaced) -> None:
        # The UI's signal form takes any text (the CLI checks the name first): a name that is not a
        # node's reaches neither the API nor Slurm, and the run says why it did not follow it.
        if replaced.new_node is not None and (error := node_name_error(replaced.new_node)) is not None:
            self.decide(self.step_name, f"ignored {replaced.by}'s `replaced`: {error}")
            return
        self.replaced_signal = replaced

    @workflow.update(description='Approve the step the run waits on: {"by": "alice", "reason": "..."}')
    def approve(self, approval: Approval) -> str:
        self.approval = ("approve", approval)
        return f"{self.awaiting_approval} approved by {approval.by}"

    @approve.validator
    def _validate_approve(self, approval: Approval) -> None:
        self._validate_answer(approval, needs_reason=False)

    @workflow.update(description='Reject the step the run waits on; the run ends: {"by": "alice", "reason": "why"}')
    def reject(self, approval: Approval) -> str:
        self.approval = ("reject", approval)
        return f"{self.awaiting_approval} rejected by {approval.by}"

    @reject.validator
    def _validate_reject(self, approval: Approval) -> None:
        self._validate_answer(approval, needs_reason=True)

    def _validate_answer(self, approval: Approval, needs_reason: bool) -> None:
        # Validators refuse before anything is written to the history.
        if not approval.by.strip():
            raise ValueError("an approver is required (by)")
        if needs_reason and not approval.reason.strip():
            raise ValueError("a rejection needs a reason")
        if self.awaiting_approval is None:
            raise ValueError("this run is not waiting for an approval")

    @workflow.signal(description="Internal (the fleet guard): lease granted, or the place in line")
    def lease(self, answer: LeaseAnswer) -> None:
        """From the fleet guard: granted, or our place in line; and whether the fleet is paused."""
        self.lease_answer = answer
        self.fleet_paused = answer.paused
        if not answer.granted and self.waiting_for is not None and self.waiting_for.startswith("lease"):
            self.waiting_for = self.place_in_line(answer)
            self.shown()  # now: the run is waiting already

    def place_in_line(self, answer: LeaseAnswer) -> str:
        """What a run in line for its lease waits for, from the guard's answer; and the same in the
        UI's list, for `FleetStep = "waiting for lease (position 3)"` queries (written when the run
        next waits)."""
        self.show(ids.FLEET_STEP.value_set(f"waiting for lease (position {answer.position})"))
        return f"lease, position {answer.position} ({answer.reason})"

    # --- bookkeeping --------------------------------------------------------------------------

    def decide(self, step: str, result: str) -> None:
        """Record a decision with its reason: the status query, the audit and the UI show it."""
        self.decisions.append(StepRecord(step=step, at=workflow.now(), result=result))
        workflow.logger.info("%s: %s", step, result)

    def enter(self, step: str) -> None:
        if step != self.step_name:  # runbooks by step, on the worker's /metrics
            workflow.metric_meter().create_counter("fleetmedic_runbook_steps", "runbook steps entered").add(
                1, {"runbook": self.runbook, "step": step})
        self.step_name = step
        self.waiting_for = None  # and the UI's details say the new step
        self.show(ids.FLEET_STEP.value_set(step))

    def show(self, *updates: SearchAttributeUpdate[Any]) -> None:
        """Search attributes for the UI's list and the operators' queries, held until the run next
        waits (an activity, a condition, the end): the steps one workflow task goes through were
        never visible apart, and each upsert is an event in the history and a write to the
        visibility store."""
        self.unshown.update((update.key.name, update) for update in updates)

    def shown(self) -> None:
        """What `show` holds and is not shown already, in one upsert: called right before the run waits."""
        updates = [u for name, u in self.unshown.items() if self.shown_values.get(name, NOT_SHOWN) != u.value]
        self.unshown = {}
        if updates:
            workflow.upsert_search_attributes(updates)
            self.shown_values.update((u.key.name, u.value) for u in updates)

    def finish(self, outcome: str) -> str:
        self.outcome = outcome
        self.step_name = "done"
        self.show_details()
        self.show(ids.FLEET_OUTCOME.value_set(outcome), ids.FLEET_STEP.value_set("done"))
        self.shown()
        # Every run closes COMPLETED (green in the UI's list), whatever it did: the memo and the
        # FleetOutcome column (README, "Temporal UI") tell an aborted or a shadow run apart.
        workflow.upsert_memo({"outcome": outcome, "dry_run": self.dry_run})
        return outcome

    def fail_if_invalid(self, invalid: str | None) -> None:
        if invalid is not None:
            raise ApplicationError(f"invalid {self.runbook} input: {invalid}", type="InvalidInput",
                                   non_retryable=True)

    def check_abort(self) -> None:
        if self.abort_pending():
            assert self.abort_request is not None
            self.abort_honoured = True
            raise RunbookAborted(self.abort_request.by, self.abort_request.reason)

    def abort_pending(self) -> bool:
        return self.abort_request is not None and not self.abort_honoured

    async def wait(self, what: str, condition: Any, timeout: timedelta | None = None) -> bool:
        """wait_condition that also wakes up for an abort, and says what it waits for."""
        self.waiting_for = what
        self.shown()
        try:
            await workflow.wait_condition(lambda: bool(condition()) or self.abort_pending(),
                                          timeout=timeout, timeout_summary=f"waiting for {what}"[:200])
            self.check_abort()
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting_for = None

    async def sleep(self, duration: timedelta, summary: str) -> None:
        """A durable timer (a poll's pause), with what `show` holds written first: the run waits."""
        self.shown()
        await workflow.sleep(duration, summary=summary)

    async def load_policy(self) -> Policy:
        """The worker's policy (a local activity: no round trip through the task queue), shadow mode
        when it says so, and the run's search attributes."""
        self.enter("load policy")
        self.policy = shared(Policy.model_validate(await configuration(refs.CONFIG_POLICY)))
        if self.policy.shadow.enabled_for(self.runbook) and not self.dry_run:
            self.dry_run = True
            self.decide("load policy", f"shadow mode for {self.runbook} (policy): nothing will be changed")
        self.show(ids.FLEET_RUNBOOK.value_set(self.runbook), ids.FLEET_CLUSTER.value_set(self.cluster),
                  ids.FLEET_DRY_RUN.value_set(self.dry_run))
        return self.policy

    # --- activities ---------------------------------------------------------------------------

    def retry(self, kind: str = "reads") -> RetryPolicy:
        """The policy's bounded retry budget for reads or writes."""
        return bounded_retry(self.policy, kind)

    def call_timeout(self) -> timedelta:
        return self.policy.retries.call_timeout if self.policy else SHORT

    def wait_heartbeat(self) -> timedelta:
        """The heartbeat timeout of a wait on the waits queue (policy `retries.wait_heartbeat`):
        longer than an ordinary call's, since thousands of runs wait for hours in an incident and
        each heartbeat is a write on the server. Not a command attribute a replay compares."""
        return self.policy.retries.wait_heartbeat if self.policy else SHORT

    def evicting_heartbeat(self) -> timedelta:
        """The heartbeat timeout of a step that evicts while it waits (a drain waiting out a PDB, a
        batch of traffic moved home): an abort cancels it, and the worker hears so only at a
        heartbeat, so at `wait_heartbeat`'s 96 s it would go on evicting that long after an operator
        said stop. Few run at once (a drain holds a lease; migrate-back is one per cluster), so their
        heartbeats every 8 s cost the server little. Not a command attribute a replay compares."""
        return min(self.wait_heartbeat(), EVICTING_HEARTBEAT)

    def waits_queue(self) -> str:
        """Where an activity that waits runs (activities/waits.py: async, holding no thread): the
        run's queue's `-waits` twin."""
        return ids.waits_queue(workflow.info().task_queue)

    async def call(self, step: str, activity: Activity[In, Out], arg: In, *,
                   timeout: timedelta | None = None, retry: RetryPolicy | None = None,
                   heartbeat: timedelta | None = None, summary: str | None = None,
                   escalate: bool = True, task_queue: str | None = None, in_task: bool = False,
                   until: Callable[[], bool] | None = None, retries_said: bool = False) -> Out | None:
        """Run one activity; when its retries are exhausted, escalate and wait for an answer.
        `task_queue`: another queue than the run's. `in_task`: as a local activity, inside the
        workflow task that asks for it, on the worker running the run (the protective step: no
        round trip through the server, no queue to wait in). `until`: a long wait that an abort
        or `until()` ends early (`until_done`). `retries_said` (with `in_task`): the retries are the
        workflow's, one attempt at a time, each failure in the run's status and the UI's details as
        it happens — a local activity's own retries show nowhere until they are all spent.

        Returns None when the operator answered `skip`, or `until()` ended the wait.
        """
        policy = retry or self.retry("reads")
        tries, delay = 1, policy.initial_interval
        while True:
            self.check_abort()
            self.shown()
            options: dict[str, Any] = {"start_to_close_timeout": timeout or self.call_timeout(),
                                       "retry_policy": policy, "summary": summary or f"{step}: {activity.name}"}
            if in_task and retries_said:
                options["retry_policy"] = RetryPolicy(maximum_attempts=1)
            try:
                if in_task:
                    result: Out | None = await local(activity, arg, **options)
                elif until is None:
                    result = await execute(activity, arg, heartbeat_timeout=heartbeat, task_queue=task_queue,
                                           **options)
                else:
                    result = await self.until_done(start(activity, arg, heartbeat_timeout=heartbeat,
                                                         task_queue=task_queue, **options), until)
            # A local activity whose retries ran out raises its own error, not wrapped in an
            # ActivityError as a task queue's activity is (its timeout is wrapped): both escalate.
            except (ActivityError, ApplicationError) as err:
                if in_task and retries_said and tries < (policy.maximum_attempts or 1) and _retryable(err, policy):
                    self.waiting_for = (f"try {tries + 1} of {policy.maximum_attempts} of {step} in {delay}; "
                                        f"try {tries} failed: {describe_failure(err)}")
                    self.decide(step, f"try {tries} failed: {describe_failure(err)}")
                    await self.sleep(delay, summary=f"{step}: try again")
                    self.waiting_for = None
                    tries, delay = tries + 1, min(delay * policy.backoff_coefficient,
                                                  policy.maximum_interval or delay * policy.backoff_coefficient)
                    continue
                tries, delay = 1, policy.initial_interval
                if not escalate:
                    raise
                answer = await self.escalate(step, describe_failure(err))
                if answer.action == "retry":
                    continue
                if answer.action == "skip":
                    self.skipped += 1
                    self.decide(step, f"skipped by {answer.by}: {answer.reason}")
                    return None
                raise RunbookAborted(answer.by, answer.reason or f"abandoned at {step}") from err
            if isinstance(result, ActionResult):
                self.actions.append(result)
            return result

    async def until_done(self, running: workflow.ActivityHandle[Out], until: Callable[[], bool]) -> Out | None:
        """The activity's result; unless an abort or `until()` comes first: then the activity is
        cancelled (it learns so at its next heartbeat) and the run goes on at once, with
        RunbookAborted or None. A wait that spans its whole deadline costs the server its heartbeats
        alone, not a workflow task every few minutes, and still hears an operator now."""
        await workflow.wait_condition(lambda: running.done() or self.abort_pending() or until())
        if not running.done():
            running.cancel()
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await running  # resolved cancelled without waiting for the worker (TRY_CANCEL)
            self.check_abort()
            return None
        return await running

    async def act(self, step: str, activity: Activity[In, ActionResult], arg: In, *,
                  timeout: timedelta | None = None, heartbeat: timedelta | None = None) -> ActionResult | None:
        """A mutating activity: returns what it did, or would have done in shadow mode."""
        result = await self.call(step, activity, arg, timeout=timeout, retry=self.retry("writes"),
                                 heartbeat=heartbeat)
        if result is not None:
            self.decide(step, result.summary)
        return result

    async def escalate(self, step: str, error: str) -> EscalationAnswer:
        """Tell a human (Slack mention) and wait for `answer`; remind every `reminder`. A dry run
        pages nobody: it ends there (`DryRunEnded`), saying what it would have escalated."""
        if self.dry_run:
            raise DryRunEnded(step, error)
        self.escalation = Escalation(step=step, error=error, since=workflow.now())
        self.escalation_answer = None
        mention = self.policy.escalation.slack_mention if self.policy else None
        reminder = self.policy.escalation.reminder if self.policy else timedelta(hours=1)
        self.decide(step, f"escalated: {error}")
        await self.say(f":rotating_light: *{step}* failed after its retries: {error}. "
                       f"Answer with `retry`, `skip` or `abort` (signal `answer`).", mention=mention)
        while not await self.wait(f"an operator's answer to the escalation of {step}",
                                  lambda: self.escalation_answer is not None, timeout=reminder):
            await self.say(f"still waiting for an answer about *{step}*: {error}", mention=mention)
        answer = self.escalation_answer
        assert answer is not None
        self.escalation = self.escalation.model_copy(update={"answered_by": answer.by, "answer": answer.action})
        self.decide(step, f"{answer.by} answered {answer.action}" + (f": {answer.reason}" if answer.reason else ""))
        self.escalation = None
        return answer

    # --- safety gate --------------------------------------------------------------------------

    async def hold_before_destructive(self, step: str,
                                      opt_out: Callable[[], Awaitable[OptOut]] | None = None) -> OptOut:
        """The one gate every destructive call of every runbook passes, right before it: an abort
        ends the run; a pause (this run's, or the fleet's) is waited out; then the opt-out of the
        objects the step touches is read now (`opt_out`: the node's label for node steps)."""
        self.check_abort()
        await self.hold_while_paused(step)
        self.check_abort()
        if opt_out is None:
            return OptOut(opted_out=False)
        return await opt_out()

    def hears_fleet_pause(self) -> bool:
        """Whether the fleet guard's pause reaches this run by itself (with its lease answers).
        Runbooks without a lease ask the guard at each gate instead."""
        return False

    async def hold_while_paused(self, step: str) -> None:
        """Wait while this run or the fleet is paused; say so once per pause."""
        announced: Operator | None = None
        while True:
            asks = not self.hears_fleet_pause() and not self.dry_run
            if asks:
                fleet = await self.call(f"{step}: fleet pause", refs.GUARD_PAUSED, self.cluster)
                self.fleet_paused = fleet.paused if fleet is not None else None
            pause = self.paused or self.fleet_paused
            if pause is None:
                return
            scope = "paused" if self.paused else "fleet paused"
            if pause != announced:
                await self.say(f":double_vertical_bar: {scope} by {pause.by} before *{step}*: {pause.reason}")
                announced = pause
            # A run without a lease is told of no resume: it asks again every FLEET_PAUSE_POLL.
            await self.wait(f"resume ({scope} by {pause.by}: {pause.reason})",
                            lambda: (self.paused or self.fleet_paused) is None,
                            timeout=FLEET_PAUSE_POLL if asks and not self.paused else None)

    # --- the end ------------------------------------------------------------------------------

    async def record_outcome(self, outcome: str, message: str, warning: bool = False,
                             event_on: str | None = None) -> str:
        """The outcome everywhere it is looked for: an Event on the node the run was about (`event_on`,
        by default the run's node; none when empty), the Slack thread, the decisions, the metrics and
        the `FleetOutcome` search attribute. A dry run ends `dry-run`, with what it would have done."""
        self.enter("record outcome")
        if self.dry_run and outcome not in UNCHANGED_OUTCOMES | {"dry-run"}:
            message, outcome = f"would have ended {outcome}: {message}", "dry-run"
        subject = self.node if event_on is None else event_on
        if subject:
            event = EventRequest(name=subject, reason=f"FleetMedic{outcome.title().replace('-', '')}",
                                 message=f"{self.runbook} ({self.workflow_id}): {message}",
                                 type="Warning" if warning else "Normal", dry_run=self.dry_run)
            try:
                await self.call("record outcome", refs.RECORD_EVENT, event, escalate=False)
            except ActivityError:
                workflow.logger.warning("could not record the outcome Event; the history still has it")
        prefix = "shadow run: " if self.dry_run else ""
        await self.say(f"*{outcome}*: {prefix}{message}")
        self.decide("record outcome", f"{outcome}: {message}")
        self.record_metrics(outcome)
        return self.finish(outcome)

    async def end_dry_run(self, ended: DryRunEnded, event_on: str | None = None) -> str:
        return await self.record_outcome("dry-run", f"would have escalated {ended.step} to a person: {ended.error}",
                                         warning=True, event_on=event_on)

    def record_metrics(self, outcome: str) -> MetricMeter:
        """Runbooks by outcome on the worker's /metrics (the SDK drops metrics recorded while
        replaying, so each run counts once). Returns the meter, for what a runbook adds."""
        meter = workflow.metric_meter().with_additional_attributes(
            {"runbook": self.runbook, "cluster": self.cluster, "outcome": outcome, "dry_run": str(self.dry_run)})
        meter.create_counter("fleetmedic_runbooks_finished", "runbooks finished, by outcome").add(1)
        return meter

    # --- Slack --------------------------------------------------------------------------------

    def open_thread(self, text: str, after_protect: bool = False) -> None:
        """Post the run's Slack message without waiting for it: Slack's latency must not delay
        taking a bad node out of service. Replies wait for it (`say`).

        `after_protect`: not even posted until the protective step is done (`open_held_thread`),
        or the run has something else to say. Posted beside the protective step, its activity and
        the workflow task of its answer fell in the same second as the cordons of a storm, on the
        same server."""
        if after_protect:
            self.thread_text = text
            return
        self._post_thread(text)

    def open_held_thread(self) -> None:
        if self.thread_text is not None:
            text, self.thread_text = self.thread_text, None
            self._post_thread(text)

    def _post_thread(self, text: str) -> None:
        self.thread_task = asyncio.ensure_future(execute(
            refs.NOTIFY_START, NotifyStart(workflow_id=self.workflow_id, runbook=self.runbook, node=self.node,
                                           text=text, dry_run=self.dry_run),
            start_to_close_timeout=self.call_timeout(), retry_policy=NOTIFY_RETRY,
            summary="notify: open the Slack thread"))

    async def say(self, text: str, mention: str | None = None) -> None:
        """A thread reply; notifications never fail the runbook. Dry runs mention nobody."""
        if self.dry_run:
            mention = None
        self.open_held_thread()
        if self.thread is None and self.thread_task is not None:
            try:
                self.thread = await self.thread_task
            except ActivityError:
                self.thread = NotifyResult(delivered=False, error="could not open the thread")
        if self.thread is None or not self.thread.delivered:
            return
        try:
            await execute(
                refs.NOTIFY_STEP, NotifyStep(channel=self.thread.channel, thread_ts=self.thread.ts, text=text,
                                             mention=mention),
                start_to_close_timeout=self.call_timeout(), retry_policy=NOTIFY_RETRY,
                summary="notify: thread reply")
        except ActivityError:
            workflow.logger.warning("slack reply failed; continuing")


def execute(activity: Activity[In, Out], arg: In, **options: Any) -> Awaitable[Out]:
    """`workflow.execute_activity` of a typed activity reference (the name, its arguments, its result)."""
    return workflow.execute_activity(activity.name, args=activity.args(arg), result_type=activity.result,
                                     **options)


def start(activity: Activity[In, Out], arg: In, **options: Any) -> workflow.ActivityHandle[Out]:
    """`workflow.start_activity` of a typed activity reference: a handle the run can cancel."""
    return workflow.start_activity(activity.name, args=activity.args(arg), result_type=activity.result,
                                   **options)


def abort_alone() -> bool:
    """`until` for a long step that only an abort ends early (a drain, a batch of traffic coming home,
    the burn-in, a traffic runbook's wait for the other one to stop)."""
    return False


async def local(activity: Activity[In, Out], arg: In, **options: Any) -> Out:
    """A local activity (the worker's own configuration, the protective step: no round trip through
    the task queue). One the worker cancelled fails with ApplicationError "Cancelled", never as the
    run's cancel. A run never cancels its local activities (an operator's cancel of the run arrives
    as asyncio's CancelledError, not caught here), but under load the SDK's core resolved one as
    cancelled: with 5,000 runs started together on temporal-server (bench/worker_scale), a first
    workflow task completed with its protective step "Cancelled" mid-call to kube-apiserver — most
    likely the step of an attempt the server had given up on, handed to the next attempt. It raised
    out of the run, which failed with the node cordoned and nobody told (8 of 5,000 runs). As an
    ApplicationError it is a failed try of the step (`Runbook.call`: tried again or escalated), and
    a configuration read asks again (`configuration`)."""
    options.setdefault("start_to_close_timeout", timedelta(seconds=10))
    try:
        result: Out = await workflow.execute_local_activity(activity.name, args=activity.args(arg),
                                                            result_type=activity.result, **options)
    except CancelledError as err:
        raise ApplicationError(f"{activity.name} was cancelled by the worker before it finished (a workflow "
                               "task given up under load)", type=CANCELLED) from err
    return result


async def configuration(activity: Activity[NoArgs, Out]) -> Out:
    """The worker's configuration (its policy, its context): a local activity, the first step of every
    run, and of every continued run of the fleet guard and the job-failures listener. One the worker
    cancelled (`local`) would fail the run before it did anything, and a failed guard loses its
    holders and its line, so the next request starts an empty one that lets a second wave past the
    budget. A read the worker cancelled is asked again, at most CONFIGURATION_TRIES times in the
    task; then the task fails (ConfigurationCancelled), and the server gives it to a worker again:
    the run is kept."""
    for _ in range(CONFIGURATION_TRIES):
        try:
            return await local(activity, ())
        except ApplicationError as err:
            if err.type != CANCELLED:
                raise
            workflow.logger.warning("%s: the worker cancelled the local activity; asking again", activity.name)
    raise ConfigurationCancelled(f"{activity.name}: the worker cancelled this local activity {CONFIGURATION_TRIES} "
                                 "times in one workflow task; the task fails and the server gives it to a worker "
                                 "again")


def bounded_retry(policy: Policy | None, kind: str = "reads") -> RetryPolicy:
    """The policy's bounded retry budget for reads or writes (every activity call has a bound)."""
    if policy is None:
        return READ_RETRY
    budget = policy.retries.writes if kind == "writes" else policy.retries.reads
    return RetryPolicy(initial_interval=budget.initial_interval, maximum_interval=budget.max_interval,
                       maximum_attempts=budget.attempts, non_retryable_error_types=list(NON_RETRYABLE))


def input_error(raw: Any, model: type[BaseModel]) -> str | None:
    """Why `raw` is not a valid `model` start input, in one line (None when it is one). Inputs arrive
    as plain JSON (the UI's Start Workflow form, the CLI, the webhook) and are checked in the
    workflow, so a bad one fails the run with the reason instead of a stuck workflow task."""
    if not isinstance(raw, dict):
        return f"expected a JSON object, got {type(raw).__name__}"
    try:
        model.model_validate(raw)
    except ValidationError as exc:
        return "; ".join(f"{where or 'input'}: {why}" for where, why in validation_errors(exc))
    return None


def _retryable(err: ActivityError | ApplicationError, policy: RetryPolicy) -> bool:
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, ApplicationError):
        return not cause.non_retryable and (cause.type or "") not in (policy.non_retryable_error_types or ())
    return True


def describe_failure(err: ActivityError | ApplicationError) -> str:
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, ApplicationError):
        return f"{cause.type or 'error'}: {cause.message}"
    return str(cause or err)
