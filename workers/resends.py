"""Exact resends of an alert, answered by the webhook replica that delivered the first copy, without
a Temporal write.

Alertmanager sends the same alert many times: every HA replica sends each notification, and a
group is sent again at every `group_interval` when any alert in it changes and at every
`repeat_interval` regardless. In a storm most deliveries are such copies — same fingerprint, same
`startsAt`, same status — and each one used to be a signal written to its run's history, which the
run then counted as no new occurrence (workflows/runbook.py `remember_alert`).

A copy is answered here only where that cannot change what happens:
- the first copy reached Temporal on this replica (delivered, or answered from Temporal's state);
- the route does not reopen a closed incident and the alert has a `startsAt`: then a copy arriving
  while the run is open is a resend the run ignores, and one arriving after it closed is refused by
  the closed-run check (it started before that run ended) — no write either way;
- the memory is bounded (entries and age): a copy that outlived it takes the Temporal path again,
  and copies that reach another replica are still deduplicated by the run.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from fleetmedic.models import Alert

MAX_ENTRIES = 20_000  # ~4 MB at most; a fleet-wide storm is a few thousand distinct alerts
MAX_AGE_S = 3600.0  # past Alertmanager's default group_interval (5 m), short of repeat_interval (4 h)

Key = tuple[str, str, str, str]


class ResendMemo:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_age_s, self.clock = max_entries, max_age_s, clock
        self.delivered: OrderedDict[Key, float] = OrderedDict()

    @staticmethod
    def key(workflow_id: str, alert: Alert, reopens: bool) -> Key | None:
        """The copy's identity as the run dedupes it, or None where a copy must reach Temporal."""
        if reopens or not alert.fingerprint or alert.starts_at is None:
            return None
        return workflow_id, alert.fingerprint, alert.starts_at.isoformat(), alert.status

    def age(self, key: Key) -> float | None:
        """Seconds since the first copy was answered from Temporal, or None if not remembered."""
        at = self.delivered.get(key)
        if at is None:
            return None
        age = self.clock() - at
        if age > self.max_age_s:
            del self.delivered[key]
            return None
        return age

    def remember(self, key: Key) -> None:
        self.delivered[key] = self.clock()
        self.delivered.move_to_end(key)
        while len(self.delivered) > self.max_entries:
            self.delivered.popitem(last=False)
