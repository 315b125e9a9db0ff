"""Slack: one Block Kit message per runbook run, a thread reply per step.

A notification that cannot be delivered is logged and counted
(`fleetmedic_notifications_failed` on the worker's /metrics) and reported back, but never fails a runbook: the
Temporal history, not Slack, is the record.

Messages go through Slack's Web API (`chat.postMessage`, a JSON body and the bot token as Bearer,
https://api.slack.com/methods/chat.postMessage) on one pool of kept-alive connections. A runbook
waits for each reply it posts, and a new connection to slack.com is a TCP and TLS handshake, round
trips away: slack-sdk's WebClient (urllib) opened one for every message, and its handshake cost
the worker 1.7 ms of CPU a message against 0.5 ms on a kept connection (here, over TLS on loopback).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
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
        self.where = f"Slack at {urlsplit(base_url).netloc or base_url}"
        self.timeout_s = timeout_s
        self.client = httpx.Client(
            base_url=base_url.rstrip("/") + "/", timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json; charset=utf-8"},
        ) if token else None

    def _post(self, kind: str, **kwargs: Any) -> NotifyResult:
        if self.client is None or not self.channel and "channel" not in kwargs:
            log.info("slack not configured; %s: %s", kind, kwargs.get("text"))
            return NotifyResult(delivered=False, error="slack is not configured")
        kwargs.setdefault("channel", self.channel)
        payload = {key: value for key, value in kwargs.items() if value is not None}
        try:
            answer = self._answer(self.client.post("chat.postMessage", content=json.dumps(payload)))
        except httpx.TimeoutException:
            error = f"{self.where} did not answer within {self.timeout_s:g}s"
        except httpx.HTTPError as exc:  # connection refused, reset, a name that does not resolve
            error = f"{self.where} unreachable: {exc}"
        else:
            if isinstance(answer, dict):
                count("fleetmedic_notifications_sent", "Slack notifications", {"kind": kind})
                return NotifyResult(delivered=True, channel=str(answer["channel"]), ts=str(answer["ts"]))
            error = answer
        count("fleetmedic_notifications_failed", "Slack notifications", {"kind": kind})
        log.warning("slack %s not delivered: %s", kind, error)
        return NotifyResult(delivered=False, channel=str(kwargs["channel"] or ""), error=error)

    def _answer(self, response: httpx.Response) -> dict[str, Any] | str:
        """The message Slack posted (its channel and ts), or why it did not: Slack's own error
        (`channel_not_found`, `not_authed`, `ratelimited` with the seconds it asks to wait)."""
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code == 429:  # https://api.slack.com/apis/rate-limits: one message a second a channel
            return f"ratelimited: Slack asks to wait {response.headers.get('Retry-After', '?')} s"
        if response.status_code != 200 or not isinstance(body, dict):
            said = f": {body['error']}" if isinstance(body, dict) and body.get("error") else ""
            return f"{self.where} answered HTTP {response.status_code}{said}"
        if not body.get("ok"):  # Slack's own errors come with 200
            return str(body.get("error") or "ok: false")
        if not body.get("channel") or not body.get("ts"):
            return f"{self.where} answered ok without the message's channel and ts"
        return body

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
