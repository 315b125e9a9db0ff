"""Patch decisions a replay always repeats: taken before a workflow's first local activity.

`workflow.patched(id)` answers True while a run executes and, on a replay, True only when the
history has the patch's marker in the workflow task being replayed. Called right after a local
activity resolves, that is not always the same task: Temporal's core sometimes records the local
activity's marker in one workflow task and hands the result to the workflow in the next, so the
patch's marker lands one task later than the replay, which resolves the local activity where its
marker is, looks for it. The replay then answers False and fails the run's every workflow task with
"Non-deprecated patch marker encountered … but there is no corresponding change command" (seen on
the fleet guard, whose first steps were "load the policy, then decide two patches": a guard that
could not replay grants no lease, fleet-wide).

So every workflow decides once, before its first local activity, whether it started on code that
has every patch in `FOLDED_PATCHES` (`decide`). A run that did takes all of them without a marker
each — a new run takes every patch anyway — and nothing is decided after a local activity again.
A run recorded before keeps calling `workflow.patched` where it always did, and replays as it ran.
A patch added after this one is not in the set: it is decided where it is called, so it must not
be called straight after a local activity (decide it before, as here).
"""

from __future__ import annotations

from temporalio import workflow

DECIDED_FIRST = "patches-decided-before-local-activities"

# Every patch the workflows had when DECIDED_FIRST came in (fixed: never add one here).
FOLDED_PATCHES = frozenset({
    # fleet guard
    "guard-recounts-while-waiting", "guard-tells-far-places-less-often", "protective-nodes-in-line",
    "domain-counts-nodes-out",
    # the runbook base
    "lease-position-search-attribute", "outcome-memo", "waits-hold-no-thread", "dry-run-never-escalates",
    "fleet-pause-asked", "dry-run-outcome", "slack-after-protect",
    # node runbooks
    "served-cluster-check", "lease-wait-escalates", "kueue-sync-on-node-change", "follow-replacement",
    "lemon-count-on-node", "protective-first", "signal-before-down", "read-jobs-after-the-gate", "requeue-gated",
    "drain-on-blocked", "alert-occurrences-deduplicated", "protective-kill",
    # traffic runbooks
    "batch-within-minimum",
})


class Patches:
    """One run's patch decisions (`workflow.patched`, with the folded patches decided up front)."""

    def __init__(self) -> None:
        self.folded = False

    def decide(self) -> None:
        """Before the run's first local activity: a run started on this code takes every folded patch."""
        self.folded = workflow.patched(DECIDED_FIRST)

    def __call__(self, patch_id: str) -> bool:
        if self.folded and patch_id in FOLDED_PATCHES:
            return True
        return workflow.patched(patch_id)
