"""The cordon breaker and the fleet pause, as the protective step sees them — without asking anyone.

Protective first made a cordon cheap: it runs before the lease, so nothing counted it. A broken
exporter firing for half the fleet would cordon half the fleet. So every protective step passes a
breaker, decided here, on the worker, in the step itself (no round trip on the fast path):

- **Nodes gone out of service recently.** The worker's one node watch (activities/node_watch.py)
  sees every GPU node go out of service (cordoned or NotReady, by anyone) and when. More than
  `budget.protective.max_out_fraction` of the GPU nodes gone out within `budget.protective.window`
  — this step's node included — and the breaker trips. Nodes that were out before the watch started
  (or before the last reset) do not count: a person who reset the breaker has looked at them.
- **New protective steps a minute**, fleet-wide: FleetMedic's own cordons seen by the watch in the
  last minute, past `budget.protective.max_per_minute`.
- **The guard's word.** Once tripped, the breaker stays tripped in the fleet guard until a person
  resets it (`fleetmedic breaker reset`); the fleet pause holds new cordons too. Each worker reads
  both from the guard's memo (DescribeWorkflowExecution: no workflow task, no worker round trip)
  every `VIEW_EVERY` in the background, so a step reads a copy at most that old.

The check and the reservation of this step's place happen under one lock, and a node this worker is
cordoning counts as gone out until its watch shows it: one worker never goes past the bound. With
several workers, each sees the others' cordons when its watch does (tens of milliseconds on a
healthy API server): the bound can be passed by the cordons other workers made within that delay.
A step the breaker or the pause holds writes nothing; its run records the alert and waits in line
for its lease like any destructive step (the guard grants none to it while the breaker is tripped).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.out_of_service import OutOfService
from fleetmedic import ids
from fleetmedic.models import BreakerState, BreakerTrip, Operator
from fleetmedic.policy import Policy

log = logging.getLogger(__name__)

# How often each worker reads its guards' pause and breaker (the guard's memo).
VIEW_EVERY = 1.0
# How long a node this worker cordoned counts as gone out before its watch has shown it.
PENDING_S = 30.0
MINUTE_S = 60.0
# Read from the guard's memo, as the guard writes it (workflows/fleet_guard.py `publish`).
MEMO_KEY = "fleet"


@dataclass
class GuardView:
    """What the fleet guard says of the pause and the breaker, as this worker last read it."""

    paused: Operator | None = None
    breaker: BreakerState | None = None
    reset_at: datetime | None = None  # the breaker's last reset: nodes gone out before it do not count
    read_at: float = 0.0
    # The batch signals the guard's code takes (activities/guard_batches.py): none where it does not say.
    signals: frozenset[str] = frozenset()

    @staticmethod
    def from_memo(memo: Mapping[str, Any]) -> GuardView:
        fleet = memo.get(MEMO_KEY) or {}
        paused, breaker, reset = fleet.get("paused"), fleet.get("breaker"), fleet.get("breaker_reset_at")
        signals = fleet.get("signals")
        return GuardView(paused=Operator.model_validate(paused) if paused else None,
                         breaker=BreakerState.model_validate(breaker) if breaker else None,
                         reset_at=datetime.fromisoformat(reset) if reset else None, read_at=time.monotonic(),
                         signals=frozenset(s for s in signals if isinstance(s, str))
                         if isinstance(signals, list) else frozenset())


@dataclass
class Decision:
    """The breaker's answer to one protective step: go ahead (held None), or why not, and whether
    this step is the one that found the bound reached (`trip`: the counts the guard records)."""

    held: str | None = None
    held_by: Literal["breaker", "pause"] | None = None
    trip: BreakerTrip | None = None


@dataclass
class GuardViews:
    """Each served cluster's guard view, kept fresh by a background reader (started with the worker)."""

    client: Client
    clusters: list[str]
    views: dict[str, GuardView] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    def get(self, cluster: str) -> GuardView:
        return self.views.get(cluster) or GuardView()

    async def read(self, cluster: str) -> None:
        handle = self.client.get_workflow_handle(ids.guard_workflow_id(cluster))
        try:
            described = await handle.describe(rpc_timeout=timedelta(seconds=2))
            self.views[cluster] = GuardView.from_memo(await described.memo())
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:  # no guard yet: no pause, no breaker
                self.views[cluster] = GuardView(read_at=time.monotonic())
            else:  # keep the last view (or mark it read: the steps do not ask again, the loop does);
                # the node counts still bound the step
                self.views.setdefault(cluster, GuardView(read_at=time.monotonic()))
                log.debug("cannot read fleet-guard/%s: %s", cluster, err.message)

    def forget(self, cluster: str) -> None:
        """The guard's open run is gone: until the next read, nothing is known of it (no batches)."""
        self.views[cluster] = GuardView(read_at=time.monotonic())

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.read(c) for c in self.clusters), return_exceptions=True)
            await asyncio.sleep(VIEW_EVERY)

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(), name="fleetmedic-guard-views")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None


class CordonBreaker:
    """The bound on protective steps, decided on the worker from its node watch and guard views."""

    def __init__(self, policy: Policy, fleet: Callable[[], OutOfService | None],
                 views: Callable[[str], GuardView], clock: Callable[[], float] = time.monotonic) -> None:
        # `fleet`: the node watch's nodes out of service (None before its first list), filed with
        # the policy's GPU selector and workflow annotation.
        self.policy, self.fleet, self.views, self.clock = policy, fleet, views, clock
        self.lock = threading.Lock()
        self.pending: dict[str, float] = {}  # nodes this worker is cordoning → since when

    def decide(self, cluster: str, node: str) -> Decision:
        """Whether the protective step on `node` may cordon now. Reserves its place when it may (it
        counts as gone out until the watch shows it, or for PENDING_S)."""
        view = self.views(cluster)
        if view.paused is not None:
            return Decision(held=f"fleet paused by {view.paused.by}: {view.paused.reason}; nothing is cordoned "
                                 "ahead of the lease until it is resumed", held_by="pause")
        if view.breaker is not None:
            return Decision(held=f"cordon breaker tripped {view.breaker.tripped_at:%Y-%m-%d %H:%M:%S}: "
                                 f"{view.breaker.reason}; a person resets it (fleetmedic breaker reset)",
                            held_by="breaker")
        budget = self.policy.budget.protective
        with self.lock:
            # The counts taken under the lock: counts taken before it could predate a cordon whose
            # place another step has just handed from `pending` to the watch, and miss it.
            fleet = self.fleet()
            if fleet is None:  # the API server cannot be listed: the guard's view alone, said in the log
                log.warning("cordon breaker: no list of the nodes yet (%s): %s not counted", self.policy.labels
                            .gpu_node_selector, node)
                return Decision()
            now = self.clock()
            self.pending = {n: t for n, t in self.pending.items() if now - t < PENDING_S and not fleet.is_out(n)}
            since = now - budget.window.total_seconds()
            if view.reset_at is not None:  # nodes out before the reset were looked at by a person
                since = max(since, now - (datetime.now(UTC) - view.reset_at).total_seconds())
            # The GPU nodes as the fleet guard counts them (`labels.gpu_node_selector`).
            tally = fleet.tally(node, since, now - MINUTE_S, self.pending)
            bound = max(budget.min_nodes, int(budget.max_out_fraction * tally.gpu_nodes))
            why = None
            if not tally.node_recent and tally.recent + 1 > bound:
                why = (f"{tally.recent} of {tally.gpu_nodes} GPU nodes went out of service within {budget.window} "
                       f"(bound {bound}: {budget.max_out_fraction:.0%})")
            elif not tally.node_ours and tally.ours + 1 > budget.max_per_minute:
                why = f"{tally.ours} protective cordons in the last minute (bound {budget.max_per_minute})"
            if why is not None:
                why += "; same alert on many nodes: look at the exporter or a fleet-wide event first"
                return Decision(held=f"cordon breaker: {why}", held_by="breaker", trip=BreakerTrip(
                    out=tally.recent, gpu_nodes=tally.gpu_nodes, bound=bound, reason=why))
            self.pending[node] = now
        return Decision()
