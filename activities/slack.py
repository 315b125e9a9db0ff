"""Slack: one Block Kit message per runbook run, a thread reply per step.

A notification that cannot be delivered is logged and counted
(`fleetmedic_notifications_failed` on the worker's /metrics) and reported back, but never fails a runbook: the
Temporal history, not Slack, is the record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from temporalio import activity

from activities.metrics import count
from fleetmedic.models import NotifyResult, NotifyStart, NotifyStep

log = logging.getLogger(__name__)


class SlackActivities:
    def __init__(self, token: str | None, channel: str | None, base_url: str, timeout_s: float = 10.0,
                 shadow_channel: str | None = None) -> None:
        self.channel = channel
        # Dry runs post here (never in the live channel, never with a mention); None: nowhere.
        self.shadow_channel = shadow_channel
        self.client = WebClient(token=token, base_url=base_url, timeout=int(timeout_s)) if token else None

    def _post(self, kind: str, **kwargs: Any) -> NotifyResult:
        if self.client is None or not self.channel and "channel" not in kwargs:
            log.info("slack not configured; %s: %s", kind, kwargs.get("text"))
            return NotifyResult(delivered=False, error="slack is not configured")
        kwargs.setdefault("channel", self.channel)
        try:
            response = self.client.chat_postMessage(**kwargs)
        except SlackApiError as exc:
            error = str(exc.response.get("error", exc)) if exc.response is not None else str(exc)
        except Exception as exc:  # timeouts, connection errors: never fail the runbook
            error = f"{type(exc).__name__}: {exc}"
        else:
            count("fleetmedic_notifications_sent", "Slack notifications", {"kind": kind})
            return NotifyResult(delivered=True, channel=str(response["channel"]), ts=str(response["ts"]))
        count("fleetmedic_notifications_failed", "Slack notifications", {"kind": kind})
        log.warning("slack %s not delivered: %s", kind, error)
        return NotifyResult(delivered=False, channel=str(kwargs["channel"] or ""), error=error)

    @activity.defn(name="slack.notify_start")
    def notify_start(self, request: NotifyStart) -> NotifyResult:
        mode = " (shadow mode: nothing will be changed)" if request.dry_run else ""
        if request.dry_run and not self.shadow_channel:
            log.info("shadow run %s not posted (notify.shadow_channel is unset): %s", request.workflow_id, request.text)
            return NotifyResult(delivered=False, error="shadow runs post only to notify.shadow_channel, which is unset")
        blocks = [
            {"type": "header", "text": {"type": "plain_text", "text": f"FleetMedic: {request.runbook}"[:150]}},
            {"type": "section", "text": {"type": "mrkdwn", "text": request.text + mode}},
            {"type": "context", "elements": [{"type": "mrkdwn",
                                              "text": f"workflow `{request.workflow_id}` · no action required"}]},
        ]
        where = {"channel": self.shadow_channel} if request.dry_run else {}
        return self._post("start", text=f"{request.runbook} on {request.node}: {request.text}{mode}",
                          blocks=blocks, **where)

    @activity.defn(name="slack.notify_step")
    def notify_step(self, request: NotifyStep) -> NotifyResult:
        text = f"{request.mention} {request.text}" if request.mention else request.text
        return self._post("step", channel=request.channel, thread_ts=request.thread_ts, text=text)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.notify_start, self.notify_step]
