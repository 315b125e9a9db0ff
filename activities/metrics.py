"""Counters an activity adds to the worker's /metrics, beside Temporal's own (the SDK's meter)."""

from __future__ import annotations

from temporalio import activity


def count(name: str, description: str, attributes: dict[str, str] | None = None) -> None:
    """Add one to counter `name`. Outside an activity (a read shared by runs asking at once, tests
    of a class itself) there is no meter, and nothing is counted here: callers that must count
    regardless keep their own tally too."""
    try:
        activity.metric_meter().create_counter(name, description).add(1, attributes or {})
    except RuntimeError:
        pass
