"""The XID catalog and the classification rules (bursts, repeats, linked XIDs)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleetmedic.policy import Policy
from fleetmedic.xid import XidAction, classify_xid

NOW = datetime(2026, 11, 29, 12, tzinfo=UTC)


def classify(xid: int, recent: list[datetime] | None = None, linked: int | None = None):  # type: ignore[no-untyped-def]
    policy = Policy().xid
    return classify_xid(xid, policy.catalog, unknown_action=policy.unknown_action,
                        application_burst=policy.application_burst, reset_repeat=policy.reset_repeat,
                        recent=recent or [], now=NOW, linked_xid=linked)


@pytest.mark.parametrize(("xid", "action"), [
    (79, XidAction.REPLACE), (48, XidAction.RESET_GPU), (62, XidAction.RESET_GPU), (64, XidAction.RESET_GPU),
    (95, XidAction.RESET_GPU), (119, XidAction.RESET_GPU), (120, XidAction.RESET_GPU), (140, XidAction.RESET_GPU),
    (143, XidAction.RESET_GPU), (74, XidAction.NVLINK), (13, XidAction.NOTIFY), (31, XidAction.NOTIFY),
    (43, XidAction.NOTIFY), (94, XidAction.NOTIFY), (92, XidAction.IGNORE), (61, XidAction.RESET_GPU),
    (63, XidAction.NOTIFY), (9999, XidAction.NOTIFY),
])
def test_default_actions(xid: int, action: XidAction) -> None:
    verdict = classify(xid)
    assert verdict.action is action
    assert verdict.destructive == (action in (XidAction.REPLACE, XidAction.RESET_GPU))


def test_application_xid_burst_escalates_to_diagnosis() -> None:
    four = [NOW - timedelta(hours=h) for h in (1, 2, 3, 4)]
    assert classify(13, four).action is XidAction.DIAGNOSE
    assert classify(13, four[:3]).action is XidAction.NOTIFY
    old = [NOW - timedelta(hours=h) for h in (1, 2, 3, 30)]  # one is outside the 24 h window
    assert classify(13, old).action is XidAction.NOTIFY


def test_repeated_reset_class_xid_replaces_the_node() -> None:
    verdict = classify(48, [NOW - timedelta(hours=2)])
    assert verdict.action is XidAction.REPLACE and "repeated 2 times" in verdict.reason


def test_linked_xid_is_followed() -> None:
    assert classify(45, linked=79).action is XidAction.REPLACE
    assert classify(45).action is XidAction.NOTIFY
