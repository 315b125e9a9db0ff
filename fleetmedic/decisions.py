"""The node runbook's pure decisions, out of the workflow so they are tested like `xid.py`:
when a step needs a person's approval, whether a node is a lemon, whether a checkpoint is fresh,
whether a job has left the bad node."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from fleetmedic.models import Checkpoint, SlurmJob
from fleetmedic.policy import ApprovalPolicy, LemonPolicy

# How a job that got the checkpoint signal may have ended by itself (it counts as having left).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def approval_reason(rules: ApprovalPolicy, kinds: Iterable[str], out_fraction: float) -> str | None:
    """Why a step of these kinds waits for an `approve`, or None: the policy names one of its kinds,
    or the share of GPU nodes already out is above the policy's approval level."""
    named = [kind for kind in kinds if kind in rules.steps]
    if named:
        return "policy asks approval for " + "/".join(named)
    level = rules.above_unavailable_fraction
    if level is not None and out_fraction > level:
        return f"{out_fraction:.0%} of GPU nodes are out, above the approval level {level:.0%}"
    return None


def is_lemon(count: int, rule: LemonPolicy) -> bool:
    """`count`: this node's remediations within the rule's window, this one included."""
    return count >= rule.count


def fresh_checkpoint(checkpoint: Checkpoint | None, signalled_at: datetime) -> bool:
    """A checkpoint written (complete, by the storage's rule) after the job was asked for one."""
    return checkpoint is not None and checkpoint.modified >= signalled_at


def left_node(job: SlurmJob | None, node: str, *, ended_counts: bool = False) -> bool:
    """The job no longer runs on the bad node: elsewhere, back in the queue, or (after our signal,
    `ended_counts`) ended by itself."""
    if job is None:
        return False
    return node not in job.nodes or job.state == "PENDING" or ended_counts and job.state in ENDED
