"""Training-time accounting per job: wall time, time lost to failures, restarts by cause, and the
effective training time ratio. Pure; the job-failures workflow keeps one `JobTrack` per job.

ETTR = (wall − lost) / wall, where
- wall: from the job's first start FleetMedic heard of to its last end (now, while it runs or waits
  for its restart);
- lost, per failure: the work since the last complete checkpoint (from it to the failure, when the
  job says when it was; otherwise unknown and counted as 0), plus the time from the failure to the
  restart (the next start of the same job; still growing while it waits). The restart reaching its
  previous step again is what this approximates: recomputing from the checkpoint is the first part.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from fleetmedic.job_failures import JobEnd


class JobTrack(BaseModel):
    job: str
    name: str = ""
    source: str = ""
    first_start: datetime | None = None
    last_end: datetime | None = None
    lost_s: float = 0.0
    failures: int = 0
    restarts_asked: int = 0
    by_cause: dict[str, int] = {}
    waiting_since: datetime | None = None  # a failure whose restart has not been seen yet
    completed: bool = False
    stopped: str = ""  # restarts stopped (the bound), and why
    nodes: list[str] = []  # the last allocation

    def ettr(self, now: datetime) -> float | None:
        wall = self.wall_s(now)
        if wall <= 0:
            return None
        return max(0.0, min(1.0, (wall - self.lost_now(now)) / wall))

    def wall_s(self, now: datetime) -> float:
        if self.first_start is None:
            return 0.0
        end = self.last_end if self.completed and self.last_end else now
        return max((end - self.first_start).total_seconds(), 0.0)

    def lost_now(self, now: datetime) -> float:
        waiting = (now - self.waiting_since).total_seconds() if self.waiting_since and not self.completed else 0.0
        return self.lost_s + max(waiting, 0.0)


def account(track: JobTrack, end: JobEnd, cause: str | None) -> JobTrack:
    """`track` after `end` (a failure when `cause` is given, else a completion)."""
    updated = track.model_copy(deep=True)
    updated.name = end.name or updated.name
    updated.source = end.source
    updated.nodes = list(end.nodes)[:16]  # what `fleetmedic jobs` shows; the evidence keeps them all
    if end.started_at is not None:
        if updated.first_start is None or end.started_at < updated.first_start:
            updated.first_start = end.started_at
        if updated.waiting_since is not None and end.started_at >= updated.waiting_since:
            updated.lost_s += (end.started_at - updated.waiting_since).total_seconds()
            updated.waiting_since = None
    elif updated.first_start is None:
        updated.first_start = end.ended_at
    updated.last_end = end.ended_at if updated.last_end is None else max(updated.last_end, end.ended_at)
    if cause is None:
        updated.completed = True
        updated.waiting_since = None
        return updated
    updated.completed = False
    updated.failures += 1
    updated.by_cause[cause] = updated.by_cause.get(cause, 0) + 1
    since = max(end.last_checkpoint_at, end.started_at or end.last_checkpoint_at) \
        if end.last_checkpoint_at is not None else None
    if since is not None and since < end.ended_at:
        updated.lost_s += (end.ended_at - since).total_seconds()
    updated.waiting_since = end.ended_at
    return updated
