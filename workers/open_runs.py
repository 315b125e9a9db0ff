"""The runs a webhook replica has lately started or given an alert to, so that the next alert for one
of them is one write to Temporal, its signal, instead of a start that finds the run and a signal.

A firing alert for a new incident is a plain start whose input carries the alert: the run takes
its input's alert as its first (workflows/runbook.py `remember_alert`, since 0.1.0), so the
start's own signal (signal-with-start) wrote the same alert twice, and cost the server a read of
the workflow ID's current run besides. On the dev server, 500 such starts at once went 1.11-1.15x
as fast as the signal-with-starts they replace (three rounds, no worker). A start that finds the
run open (another alert, another replica) attaches, and the alert follows as a signal to that run.

What is remembered is only a hint: a run remembered open that has closed answers the signal NOT_FOUND,
and the alert takes the start path again (a closed run's check, a new run). Bounded in entries and
age, as the resend memo is (workers/resends.py). Alerts for one workflow ID arriving together (an
Alertmanager group carries each GPU's alert of a node in one request) take turns: the first starts
the run, the others signal it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from workers.temporal_client import WebhookBusy

MAX_ENTRIES = 20_000  # a run ID and a time each: a few MB at most
MAX_AGE_S = 3600.0  # a hint: a stale one costs one NOT_FOUND signal, never a lost alert


class OpenRuns:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_age_s, self.clock = max_entries, max_age_s, clock
        self.runs: OrderedDict[str, tuple[str, float]] = OrderedDict()  # workflow ID -> (run ID, when seen)
        self.turns: dict[str, asyncio.Event] = {}  # workflow IDs an alert is being delivered to

    def run_id(self, workflow_id: str) -> str | None:
        """The run of `workflow_id` this replica last saw open, if it still remembers it."""
        seen = self.runs.get(workflow_id)
        if seen is None:
            return None
        if self.clock() - seen[1] > self.max_age_s:
            del self.runs[workflow_id]
            return None
        return seen[0]

    def opened(self, workflow_id: str, run_id: str) -> None:
        self.runs[workflow_id] = (run_id, self.clock())
        self.runs.move_to_end(workflow_id)
        while len(self.runs) > self.max_entries:
            self.runs.popitem(last=False)

    def closed(self, workflow_id: str) -> None:
        self.runs.pop(workflow_id, None)

    @contextlib.asynccontextmanager
    async def turn(self, workflow_id: str, within_s: float) -> AsyncIterator[None]:
        """Held while one alert is delivered to `workflow_id`: the next waits, then finds the run
        this one started or attached to. A wait past `within_s` is the webhook's own queue, not
        Temporal: WebhookBusy (503, and Alertmanager sends the batch again)."""
        try:
            async with asyncio.timeout(within_s):
                while (busy := self.turns.get(workflow_id)) is not None:
                    await busy.wait()
        except TimeoutError:
            raise WebhookBusy(f"webhook busy: alerts for {workflow_id} waited {within_s:g} s for the ones before "
                              "them, retry") from None
        done = self.turns[workflow_id] = asyncio.Event()
        try:
            yield
        finally:
            del self.turns[workflow_id]
            done.set()
