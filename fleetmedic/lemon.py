"""The lemon rule's memory on the node itself: the times of its last remediations.

Temporal forgets closed runs after its retention (often 7–30 days), and a lemon window can be
longer. Each live remediation therefore writes its time on the Node (annotation
`fleetmedic.io/remediations`, the newest `keep` entries, keyed by the run so a retried write is
the same entry), and the rule counts the larger of the two sources.
"""

from __future__ import annotations

import json
from datetime import datetime


def remediations(value: str | None) -> list[tuple[datetime, str]]:
    """(time, run id) of each remediation the annotation records; a damaged value records none."""
    try:
        entries = json.loads(value or "[]")
        return [(datetime.fromisoformat(at), str(run)) for at, run in entries]
    except (ValueError, TypeError):
        return []


def with_remediation(value: str | None, at: datetime, run_id: str, keep: int) -> str | None:
    """The annotation with this run's remediation added (None: already there)."""
    entries = remediations(value)
    if any(run == run_id for _, run in entries):
        return None
    entries = sorted([*entries, (at, run_id)])[-keep:]
    return json.dumps([[when.isoformat(), run] for when, run in entries], separators=(",", ":"))


def count_since(value: str | None, since: datetime, exclude_run: str = "") -> int:
    """Remediations recorded on the node at or after `since`, other than `exclude_run`'s."""
    return sum(1 for at, run in remediations(value) if at >= since and run != exclude_run)


def lemon_count(from_history: int, from_node: int) -> int:
    """Earlier remediations within the window: Temporal's count and the node's, whichever saw more
    (each can miss some: runs past retention, a node object that was recreated)."""
    return max(from_history, from_node)
