"""What the Temporal UI shows an operator: every signal, query and Update says what it is (internal
ones say so), and a run's Current Details say what it waits for and the command that answers it."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio import workflow

from fleetmedic.details import current_details
from fleetmedic.models import Escalation, Operator
from workflows.registry import WORKFLOWS


def test_every_signal_query_and_update_has_a_description() -> None:
    missing = []
    for cls in WORKFLOWS:
        defn = workflow._Definition.must_from_class(cls)
        handlers = {"signal": defn.signals, "query": defn.queries, "update": defn.updates}
        for kind, named in handlers.items():
            for name, handler in named.items():
                if name is None or name.startswith("__"):
                    continue  # the SDK's own (stack trace, metadata)
                if not handler.description:
                    missing.append(f"{defn.name}: {kind} {name}")
    assert not missing, missing


def test_current_details_say_why_a_run_waits_and_what_to_do() -> None:
    wf = "xid-recovery/prod/gpu-node-7"
    escalated = current_details(wf, "take disruption lease", waiting_for="an operator's answer to the escalation",
                                escalation=Escalation(step="take disruption lease", since=datetime.now(UTC),
                                                      error="no disruption lease within 1:00:00 (position 3)"))
    assert "**take disruption lease**" in escalated and "position 3" in escalated
    assert f"fleetmedic answer {wf} retry|skip|abort --by YOU" in escalated
    assert f"fleetmedic abort {wf}" in escalated
    approval = current_details(wf, "replace", waiting_for="approval of replace", awaiting_approval="replace")
    assert f"fleetmedic approve {wf} --by YOU" in approval and "Update `approve`" in approval
    manual = current_details(wf, "replace", waiting_for="signal `replaced` from the person doing the replace")
    assert f"fleetmedic replaced {wf} [--new-node NAME] --by YOU" in manual
    paused = current_details(wf, "drain", waiting_for="the pause to be lifted", paused=Operator(by="bob", reason="x"))
    assert "Paused by bob: x" in paused
    done = current_details(wf, "done", outcome="aborted", dry_run=True)
    assert "Ended: **aborted**" in done and "shadow mode" in done and "To stop it" not in done


def test_a_run_closed_outside_its_workflow_leaves_the_details_alone() -> None:
    """A run evicted from the worker's cache has its coroutines closed outside the workflow's loop:
    `wait()`'s `finally` clears what the run waits for then. That must not raise (it surfaced as a
    PytestUnraisableExceptionWarning from an evicted run): the details belong to a run no longer here."""
    from workflows.runbook import Runbook

    run = Runbook()
    run._init_state("prod", "gpu-node-7", "xid-recovery/prod/gpu-node-7", dry_run=False)
    run.waiting_for = "approval of replace"
    run.waiting_for = None
    assert run.waiting_for is None
