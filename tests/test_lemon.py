"""The lemon rule's memory on the node: written per run, trimmed, counted within the window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fleetmedic.lemon import count_since, lemon_count, remediations, with_remediation

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_each_run_is_recorded_once_and_only_the_newest_are_kept() -> None:
    value = None
    for day in range(5):
        value = with_remediation(value, NOW - timedelta(days=10 - day), f"run-{day}", keep=3) or value
    assert [run for _, run in remediations(value)] == ["run-2", "run-3", "run-4"]
    assert with_remediation(value, NOW, "run-4", keep=3) is None  # a retried write is the same entry


def test_count_within_the_window_excludes_the_current_run() -> None:
    value = with_remediation(None, NOW - timedelta(days=9), "old", keep=10)
    value = with_remediation(value, NOW - timedelta(days=2), "recent", keep=10)
    value = with_remediation(value, NOW, "this", keep=10)
    assert count_since(value, NOW - timedelta(days=7), exclude_run="this") == 1
    assert count_since("not json", NOW - timedelta(days=7)) == 0  # a damaged annotation counts nothing
    assert lemon_count(0, 2) == 2 and lemon_count(3, 1) == 3
