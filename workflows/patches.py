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
has every patch of a fold (`decide`): the newest fold whose marker it records or finds. A run that
did takes all of the fold's patches without a marker each — a new run takes every patch anyway —
and nothing is decided after a local activity again. A run recorded before keeps calling
`workflow.patched` where it always did, and replays as it ran. A new patch is decided where it is
called, so it must not be called straight after a local activity; one that is (the protective
step is a local activity now, and what follows it asks) comes with a new fold, which holds every
patch of the one before it.
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


# The protective step runs as a local activity inside the run's workflow task (node runbooks).
PROTECT_IN_TASK = "protective-local-activity"
# Search attributes are upserted once when the run next waits, not at every step (the runbook base).
SHOWN_WHEN_WAITING = "search-attributes-when-waiting"
# The fleet guard sends at most `budget.guard_signals_per_task` signals a workflow task.
GUARD_SIGNALS_IN_BATCHES = "guard-signals-in-batches"
# A wait for a replacement or for Ready is one activity up to its deadline, ended early (cancelled)
# by an abort or an operator's `replaced`, not a 5-minute window the run schedules again (node runbooks).
WAITS_SPAN_DEADLINE = "waits-span-their-deadline"

# A drain, or a batch of traffic moved and waited home, is cancelled by an abort at once, not heard
# when it ends (node runbooks, migrate-back). Decided where it is asked, far from a local activity:
# in no fold.
LONG_STEPS_HEAR_ABORT = "long-steps-hear-abort"
# So is the burn-in job (node runbooks: the worker cancels the job in Slurm) and a traffic
# runbook's wait for the other one to close (up to 15 minutes). Each follows a task queue's
# activity, not a local one: in no fold.
BURN_IN_HEARS_ABORT = "burn-in-hears-abort"
STOP_WAIT_HEARS_ABORT = "stop-wait-hears-abort"

# Each fold: the marker a run started on its code records first, and the patches it takes with it
# (fixed, like the runs recorded under them: a new one goes into a new fold, never an old one).
FOLDS: tuple[tuple[str, frozenset[str]], ...] = (
    (DECIDED_FIRST, FOLDED_PATCHES),
    ("patches-decided-before-local-activities-2",
     FOLDED_PATCHES | {"lemon-count-from-protective-read", PROTECT_IN_TASK, SHOWN_WHEN_WAITING,
                      GUARD_SIGNALS_IN_BATCHES}),
    ("patches-decided-before-local-activities-3",
     FOLDED_PATCHES | {"lemon-count-from-protective-read", PROTECT_IN_TASK, SHOWN_WHEN_WAITING,
                      GUARD_SIGNALS_IN_BATCHES, WAITS_SPAN_DEADLINE}),
)


class Patches:
    """One run's patch decisions (`workflow.patched`, with a fold's patches decided up front)."""

    def __init__(self) -> None:
        self.folded: frozenset[str] = frozenset()

    def decide(self) -> None:
        """Before the run's first local activity: the newest fold the run started on. A new run records
        the newest fold's marker alone; a recorded run finds the marker its code recorded, or none."""
        for marker, patches in reversed(FOLDS):
            if workflow.patched(marker):
                self.folded = patches
                return

    def __call__(self, patch_id: str) -> bool:
        if patch_id in self.folded:
            return True
        return workflow.patched(patch_id)
