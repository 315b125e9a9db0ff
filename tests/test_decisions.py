"""The node runbook's pure decisions (fleetmedic/decisions.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleetmedic.decisions import approval_reason, fresh_checkpoint, is_lemon, left_node
from fleetmedic.models import Checkpoint, SlurmJob
from fleetmedic.policy import ApprovalPolicy, LemonPolicy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_approval_when_the_policy_names_the_step_or_too_much_of_the_fleet_is_out() -> None:
    rules = ApprovalPolicy(steps=["replace"], above_unavailable_fraction=0.2)
    assert approval_reason(rules, ("replace",), 0.0) == "policy asks approval for replace"
    assert approval_reason(rules, ("cordon", "slurm_down"), 0.1) is None
    assert approval_reason(rules, ("cordon",), 0.25) == "25% of GPU nodes are out, above the approval level 20%"
    assert approval_reason(ApprovalPolicy(), ("replace",), 0.9) is None


def test_lemon_at_the_policys_count() -> None:
    assert not is_lemon(2, LemonPolicy(count=3)) and is_lemon(3, LemonPolicy(count=3))


def test_a_checkpoint_is_fresh_only_after_the_signal() -> None:
    written = Checkpoint(path="/c/1/step-2", step=2, modified=NOW)
    assert fresh_checkpoint(written, NOW - timedelta(seconds=1)) and fresh_checkpoint(written, NOW)
    assert not fresh_checkpoint(written, NOW + timedelta(seconds=1)) and not fresh_checkpoint(None, NOW)


def test_a_job_has_left_the_node() -> None:
    running = SlurmJob(job_id=1, state="RUNNING", nodes=["gpu-1"])
    assert not left_node(running, "gpu-1") and left_node(running, "gpu-2")
    assert left_node(running.model_copy(update={"state": "PENDING"}), "gpu-1")
    done = running.model_copy(update={"state": "COMPLETED"})
    assert not left_node(done, "gpu-1") and left_node(done, "gpu-1", ended_counts=True)
    assert not left_node(None, "gpu-1")
