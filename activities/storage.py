"""Storage: the newest checkpoint of a job, from the layout the policy describes.

A POSIX file system (NFS, Lustre, a local mount in tests). The layout is a glob under a root,
e.g. `{job_id}/step-*`; the newest *complete* match by modification time is the checkpoint the job
will resume from (complete: a marker file exists, or its size is stable across two reads, as the
policy says), and its step number is read from the name with the policy's pattern.
"""

from __future__ import annotations

import glob
import os
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from activities.errors import fail
from fleetmedic.errors import ErrorKind
from fleetmedic.models import Checkpoint, CheckpointQuery
from fleetmedic.policy import StoragePolicy

# How many of the newest checkpoints are looked at for a complete one.
CANDIDATES = 3


def _footprint(path: str) -> tuple[int, float] | None:
    """Total size and newest modification time of a file or a directory tree; None when it is gone."""
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return st.st_size, st.st_mtime
        size, newest = 0, os.stat(path).st_mtime
        for root, _, files in os.walk(path):
            for name in files:
                st = os.stat(os.path.join(root, name))
                size, newest = size + st.st_size, max(newest, st.st_mtime)
        return size, newest
    except FileNotFoundError:
        return None


class StorageActivities:
    def __init__(self, policy: StoragePolicy) -> None:
        self.policy = policy
        self.step = re.compile(policy.step_pattern)

    @activity.defn(name="storage.newest_checkpoint")
    def newest_checkpoint(self, query: CheckpointQuery) -> Checkpoint | None:
        """The newest checkpoint that is complete by the storage's rule. A half-written one (the job
        was killed mid-write, or is writing now) does not count: resuming from it would fail."""
        pattern = os.path.join(self.policy.root, self.policy.layout.format(job_id=query.job_id,
                                                                           job_name=query.job_name or "*"))
        try:
            found = sorted(((os.stat(path).st_mtime, path) for path in glob.iglob(pattern)), reverse=True)
            complete = self._complete(found[:CANDIDATES])
        except OSError as exc:  # a stale NFS handle, a mount that went away
            raise fail(ErrorKind.UNAVAILABLE, f"checkpoint storage {self.policy.root}: {exc}") from None
        if complete is None:
            return None
        mtime, path, rule = complete
        numbers = self.step.findall(os.path.basename(path))
        return Checkpoint(path=path, step=int(numbers[-1]) if numbers else None,
                          modified=datetime.fromtimestamp(mtime, UTC), complete_by=rule)

    def _complete(self, candidates: list[tuple[float, str]]) -> tuple[float, str, str] | None:
        """The first of `candidates` (newest first) that is complete."""
        if self.policy.complete == "marker":
            for mtime, path in candidates:
                if os.path.exists(self.policy.marker.format(path=path)):
                    return mtime, path, "marker"
            return None
        # `stable`: nothing changed between two reads (a writer still at work changes size or mtime).
        before = {path: _footprint(path) for _, path in candidates}
        if candidates:
            time.sleep(self.policy.stable_interval.total_seconds())
        for _, path in candidates:
            after = _footprint(path)
            if after is not None and after == before[path]:
                return after[1], path, "stable size"
        return None

    def activities(self) -> list[Callable[..., Any]]:
        return [self.newest_checkpoint]
