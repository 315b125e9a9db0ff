"""Saved histories of finished runs replay against the current workflow code.

They were recorded from 0.1.0 (docs/upgrading.md). A change to a runbook that would break a run in
flight fails here; such a change ships behind `workflow.patched(...)` as docs/upgrading.md says, and
adds a history of its own. Record one with `FLEETMEDIC_SAVE_HISTORIES=tests/histories pytest
tests/test_<runbook>.py -k <test>` and rename it after its scenario.
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
    """Recorded from 0.1.0 (docs/upgrading.md), then from each patch's new behaviour, named by
    scenario: every runbook and the guard, each way a run can end, and each kind of wait a run can be
    in when a worker is replaced."""
    assert {p.stem for p in HISTORIES} >= {
        # how a node runbook ends
        "xid-recovery-remediated", "xid-recovery-aborted", "xid-recovery-shadow", "xid-recovery-dry-run-outcome",
        "xid-recovery-opted-out", "xid-recovery-quarantined", "xid-recovery-lemon", "xid-recovery-notified",
        "xid-recovery-burst-escalated", "xid-recovery-rejected", "hot-gpu-pull-remediated", "hot-gpu-pull-recovered",
        "nvlink-fault-replace-kept-for-inference", "nvlink-fault-replace-drained-fully",
        # the safety model in the base: the gate, pauses, approvals, escalations
        "xid-recovery-signal-then-down", "xid-recovery-drain-blocked-skipped", "xid-recovery-protective-while-paused",
        "xid-recovery-pause-mid-run", "xid-recovery-approved", "xid-recovery-approval-timeout",
        "xid-recovery-protect-escalated-retried", "xid-recovery-slurm-outage", "hot-gpu-pull-fault-gone-in-line",
        # replacements, followed under new names, and burn-in
        "xid-recovery-new-name-cluster-api", "xid-recovery-new-name-karpenter", "xid-recovery-new-name-http",
        "xid-recovery-new-name-manual", "xid-recovery-no-replacement", "xid-recovery-replacement-named-by-operator",
        "xid-recovery-repaired-in-place", "xid-recovery-burn-in-passed", "xid-recovery-burn-in-failed",
        # an abort ends a long step at once
        "xid-recovery-drain-aborted", "xid-recovery-search-aborted", "xid-recovery-burn-in-aborted",
        "migrate-back-batch-aborted", "traffic-flip-stop-wait-aborted",
        # traffic, Kueue and the guard
        "traffic-flip-flipped", "migrate-back-migrated", "kueue-quota-sync-cut-approved",
        "xid-recovery-remediated-kueue-sync", "fleet-guard-grants-in-batches",
        # 0.2.0, behind their patches (docs/upgrading.md): the pause holds the protective step; its
        # retries said in the status
        "xid-recovery-held-by-the-pause", "xid-recovery-protect-retries-said",
        # ... and a replacement held again once its slurmd registered (Slinky: the slurmd pod's
        # Slurm node), the operator's drain kept under FleetMedic's DOWN and put back
        "xid-recovery-slinky-replacement-held", "xid-recovery-slinky-operator-drain-kept",
        # ... and migrate-back's batch ended by a stop (its wait for replacements cancelled); the
        # traffic runbooks started by Kueue's own admission (a pending Workload) and Workload end
        "migrate-back-stopped-mid-batch", "traffic-flip-kueue-pending-training",
        "migrate-back-kueue-training-finished",
        # ... and the gate's opt-out read inside the workflow task (a local activity): a whole
        # remediation, an opt-out it finds mid-run, a drain it passes after a skipped escalation
        "xid-recovery-remediated-opt-out-in-task", "xid-recovery-opt-out-mid-run-in-task",
        "xid-recovery-drain-blocked-skipped-opt-out-in-task",
        # ... and the guard taking a worker's requests and releases in batches, its answers sent
        # without waiting for their delivery
        "fleet-guard-takes-batches",
        # ... and another GPU's alert in the first alert's Alertmanager group, acted on: an XID 79
        # beside an XID 13, a hot GPU beside one that cooled down
        "xid-recovery-early-alert-acted-on", "hot-gpu-pull-early-alert-pulled",
        # 0.2.0, new runbooks: training-job failures and the suspect's trial
        "job-failures-restarted-then-trial", "job-failures-restarts-stopped", "job-failures-widespread",
        "job-failures-kubernetes-pods", "suspect-node-burn-in-passed", "suspect-node-burn-in-failed-replaced"}


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
