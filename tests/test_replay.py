"""Saved histories of finished runs replay against the current workflow code.

A change to a runbook that would break a run in flight fails here; such a change must go behind
`workflow.patched(...)`. Regenerate the files (only for a deliberate, versioned change) with
`FLEETMEDIC_SAVE_HISTORIES=tests/histories pytest tests/test_<runbook>.py` and rename them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions
from temporalio.workflow import NondeterminismError

from fleetmedic.converter import data_converter
from fleetmedic.models import RunbookStatus
from workflows.registry import WORKFLOWS
from workflows.xid_recovery import XidRecovery

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))
# The worker runs workflows without the sandbox (workers/worker.py says why), so the replays here
# use the strict one: it imports the workflow modules afresh, and a clock, randomness or I/O in
# them fails the replay. Only libraries known to be deterministic pass through.
STRICT = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(
    "pydantic", "pydantic_core", "annotated_types", "yaml"))


def load(path: Path) -> WorkflowHistory:
    workflow_id = path.stem
    return WorkflowHistory.from_json(workflow_id, json.loads(path.read_text()))


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_saved_history_replays(path: Path) -> None:
    replayer = Replayer(workflows=WORKFLOWS, data_converter=data_converter, workflow_runner=STRICT)
    await replayer.replay_workflow(load(path))


def test_there_are_histories_to_replay() -> None:
    assert {p.stem for p in HISTORIES} >= {"xid-recovery-remediated", "xid-recovery-aborted", "xid-recovery-shadow",
                                           "hot-gpu-pull-remediated", "hot-gpu-pull-recovered",
                                           "nvlink-fault-replace-kept-for-inference", "traffic-flip-flipped",
                                           "migrate-back-migrated", "kueue-quota-sync-cut-approved",
                                           # the safety model in the base (#16)
                                           "xid-recovery-signal-then-down", "xid-recovery-drain-blocked-skipped",
                                           "xid-recovery-dry-run-outcome", "migrate-back-within-minimum",
                                           # protective first (#20)
                                           "xid-recovery-protective-kill", "xid-recovery-protective-while-paused",
                                           "nvlink-fault-replace-protective-taint", "hot-gpu-pull-protective",
                                           # waits that hold no thread (#20)
                                           "migrate-back-waits-queue", "xid-recovery-new-name-waits-queue",
                                           "xid-recovery-protective-lemon",
                                           # replacements under new names, burn-in (#17)
                                           "xid-recovery-replaced-new-name", "xid-recovery-no-replacement",
                                           "xid-recovery-burn-in-failed",
                                           # the Slack thread after the protective step (#20)
                                           "xid-recovery-slack-after-protect", "hot-gpu-pull-slack-after-protect",
                                           "nvlink-fault-replace-slack-after-protect",
                                           # the fleet guard, continued-as-new, before and after its patches
                                           # were decided ahead of its local activity (workflows/patches.py);
                                           # the second one's policy result came a workflow task after its marker
                                           "fleet-guard-continued-as-new", "fleet-guard-patches-decided-first",
                                           # every runbook's patches decided before its local activities
                                           "xid-recovery-patches-decided-first", "hot-gpu-pull-patches-decided-first",
                                           "nvlink-fault-replace-patches-decided-first",
                                           "migrate-back-patches-decided-first",
                                           # the lemon count reads the protective step's read of the node (#20)
                                           "xid-recovery-lemon-from-protective-read",
                                           # the protective step a local activity in the run's workflow
                                           # task, the second fold of patches (#20)
                                           "xid-recovery-protective-local-activity",
                                           "hot-gpu-pull-protective-local-activity",
                                           "nvlink-fault-replace-protective-local-activity",
                                           # the fleet guard's signals, a batch a workflow task (#20)
                                           "fleet-guard-signals-in-batches",
                                           # a wait spans its deadline, ended by an abort or an
                                           # operator's `replaced`, the third fold (#20)
                                           "xid-recovery-waits-span-deadline", "xid-recovery-search-aborted",
                                           "xid-recovery-replacement-named-by-operator",
                                           # an abort cancels a drain or a batch coming home (#20)
                                           "xid-recovery-drain-aborted", "migrate-back-batch-aborted"}


@workflow.defn(name="xid-recovery", sandboxed=False)
class ReorderedXidRecovery(XidRecovery):
    """The runbook with one extra step, as an unguarded code change would make it."""

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        return await super().run(raw)

    async def take_lease(self) -> None:
        await workflow.sleep(1)
        await super().take_lease()


async def test_an_unguarded_change_is_caught() -> None:
    replayer = Replayer(workflows=[ReorderedXidRecovery], data_converter=data_converter)
    with pytest.raises(NondeterminismError):
        await replayer.replay_workflow(load(HISTORIES[[p.stem for p in HISTORIES].index("xid-recovery-remediated")]))


@workflow.defn(name="xid-recovery")
class ClockedXidRecovery(XidRecovery):
    """The runbook reading the machine's clock, as a careless change would make it."""

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        return await super().run(raw)

    async def take_lease(self) -> None:
        self.decide("lease", f"asked at {datetime.now()}")
        await super().take_lease()


async def test_the_strict_sandbox_catches_a_clock_in_workflow_code() -> None:
    replayer = Replayer(workflows=[ClockedXidRecovery], data_converter=data_converter,
                        workflow_runner=STRICT)
    with pytest.raises(Exception, match="datetime.datetime.now"):
        await replayer.replay_workflow(load(HISTORIES[[p.stem for p in HISTORIES].index("xid-recovery-remediated")]))
