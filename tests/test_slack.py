"""Slack's Web API against the stand-in: one message per run, a thread reply per step, on one kept
connection, and a failed notification never fails the runbook: it says why, naming Slack."""

from __future__ import annotations

from activities.slack import SlackActivities
from devstack.standins import SlackStandIn
from fleetmedic.models import NotifyStart, NotifyStep
from tests.harness import run_activity as run


def test_thread_per_run(slack: SlackStandIn) -> None:
    notifier = SlackActivities("xoxb-test", "#gpu-fleet", slack.api_url, timeout_s=5)
    start = run(notifier.notify_start, NotifyStart(workflow_id="xid-recovery/c/n1", runbook="xid-recovery",
                                                   node="n1", text="XID 79 on GPU 3"))
    assert start.delivered and start.channel == "#gpu-fleet"
    reply = run(notifier.notify_step, NotifyStep(channel=start.channel, thread_ts=start.ts, text="cordoned",
                                                 mention="@oncall"))
    assert reply.delivered
    threads = slack.threads()
    assert list(threads) == [start.ts]
    top, answer = threads[start.ts]
    assert top["blocks"][0]["type"] == "header" and "no action required" in str(top["blocks"])
    assert answer["text"] == "@oncall cordoned" and answer["thread_ts"] == start.ts


def test_shadow_runs_post_only_to_the_shadow_channel(slack: SlackStandIn) -> None:
    quiet = SlackActivities("xoxb-test", "#gpu-fleet", slack.api_url, timeout_s=5)
    result = run(quiet.notify_start, NotifyStart(workflow_id="w", runbook="xid-recovery", text="XID 79", dry_run=True))
    assert not result.delivered and "shadow_channel" in result.error
    assert slack.messages == []  # never in the live channel
    notifier = SlackActivities("xoxb-test", "#gpu-fleet", slack.api_url, timeout_s=5, shadow_channel="#fleet-shadow")
    result = run(notifier.notify_start, NotifyStart(workflow_id="w", runbook="xid-recovery", text="XID 79",
                                                    dry_run=True))
    assert result.delivered and result.channel == "#fleet-shadow"
    assert "shadow mode" in slack.messages[0]["text"] and slack.messages[0]["channel"] == "#fleet-shadow"


def test_failures_are_reported_not_raised(slack: SlackStandIn) -> None:
    notifier = SlackActivities("xoxb-test", "#gpu-fleet", slack.api_url, timeout_s=1)
    where = f"Slack at {slack.url.removeprefix('http://')}"

    def error() -> str:
        result = run(notifier.notify_start, NotifyStart(workflow_id="w", runbook="r", text="t"))
        assert not result.delivered and result.error
        return result.error

    slack.fail_next(500)
    assert error() == f"{where} answered HTTP 500: injected"
    slack.fail_next(200, body={"ok": False, "error": "channel_not_found"})
    assert error() == "channel_not_found"
    # Slack's rate limit (https://api.slack.com/apis/rate-limits): 429, and how long to wait.
    slack.fail_next(429, body={"ok": False, "error": "ratelimited"}, headers={"Retry-After": "3"})
    assert error() == "ratelimited: Slack asks to wait 3 s"
    slack.fail_next(status=0, delay_s=3)
    assert error() == f"{where} did not answer within 1s"
    unreachable = SlackActivities("xoxb-test", "#c", "http://127.0.0.1:9/api/", timeout_s=1)
    result = run(unreachable.notify_start, NotifyStart(workflow_id="w", runbook="r", text="t"))
    assert not result.delivered and result.error.startswith("Slack at 127.0.0.1:9 unreachable: ")
    assert run(notifier.notify_start, NotifyStart(workflow_id="w", runbook="r", text="t")).delivered


def test_messages_share_one_connection(slack: SlackStandIn) -> None:
    """A runbook waits for each reply it posts; a new connection to slack.com is a TCP and TLS
    handshake before it (slack-sdk's WebClient opened one a message). Counted where they arrive."""
    notifier = SlackActivities("xoxb-test", "#gpu-fleet", slack.api_url, timeout_s=5)
    start = run(notifier.notify_start, NotifyStart(workflow_id="w", runbook="xid-recovery", node="n1", text="XID 79"))
    for step in range(9):
        reply = NotifyStep(channel=start.channel, thread_ts=start.ts, text=f"step {step}")
        assert run(notifier.notify_step, reply).delivered
    assert len(slack.threads()[start.ts]) == 10 and slack.connections() == 1


def test_unconfigured_slack_only_logs() -> None:
    notifier = SlackActivities(None, None, "https://slack.invalid/api/")
    result = run(notifier.notify_start, NotifyStart(workflow_id="w", runbook="r", text="t"))
    assert not result.delivered and "not configured" in result.error
