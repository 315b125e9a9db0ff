"""Storage: the newest checkpoint of a job, from the layout the policy describes.

A POSIX file system (NFS, Lustre, a local mount in tests). The layout is a glob under a root,
e.g. `{job_id}/step-*`; the newest match by modification time is the checkpoint the job will
resume from, and its step number is read from the name with the policy's pattern.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from activities.errors import fail
from fleetmedic.errors import ErrorKind
from fleetmedic.models import Checkpoint, CheckpointQuery
from fleetmedic.policy import StoragePolicy


class StorageActivities:
    def __init__(self, policy: StoragePolicy) -> None:
        self.policy = policy
        self.step = re.compile(policy.step_pattern)

    @activity.defn(name="storage.newest_checkpoint")
    def newest_checkpoint(self, query: CheckpointQuery) -> Checkpoint | None:
        pattern = os.path.join(self.policy.root, self.policy.layout.format(job_id=query.job_id,
                                                                           job_name=query.job_name or "*"))
        newest: tuple[float, str] | None = None
        try:
            for path in glob.iglob(pattern):
                mtime = os.stat(path).st_mtime
                if newest is None or mtime > newest[0]:
                    newest = (mtime, path)
        except OSError as exc:  # a stale NFS handle, a mount that went away
            raise fail(ErrorKind.UNAVAILABLE, f"checkpoint storage {self.policy.root}: {exc}") from None
        if newest is None:
            return None
        numbers = self.step.findall(os.path.basename(newest[1]))
        return Checkpoint(path=newest[1], step=int(numbers[-1]) if numbers else None,
                          modified=datetime.fromtimestamp(newest[0], UTC))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.newest_checkpoint]
