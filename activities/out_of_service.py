"""Which nodes are out of service and since when, as the node watch sees them: the cordon
breaker's counts (activities/breaker.py) without a pass over the fleet.

The breaker asks at every protective step how many GPU nodes went out within its window and how
many of FleetMedic's own cordons came in the last minute. Counting that from a copy of the watch's
5,000 nodes, matching the GPU selector on each, took 58 % of a worker's CPU when 5,000 runs
started together (bench/worker_scale, production server), under the breaker's lock: the protective
steps waited on each other past their workflow task's timeout, and the server gave their tasks out
again. Here each node's state is filed once, as the watch sees it change, and a step's counts are
two binary searches over the times GPU nodes went out.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from fleetmedic.models import NodeInfo
from fleetmedic.selectors import label_selector_matches

# Out of service when the watch first listed it: out before anything counted.
BEFORE = float("-inf")


def is_out(node: NodeInfo) -> bool:
    """Out of service: cordoned, or not Ready."""
    return node.unschedulable or not node.ready


@dataclass(frozen=True)
class Tally:
    """What the breaker weighs for one step (`pending`: nodes the worker is cordoning that the watch
    has not shown yet, counted as gone out)."""

    gpu_nodes: int
    recent: int  # GPU nodes gone out since the window's start, with the pending ones
    ours: int  # GPU nodes FleetMedic took out within the minute, with the pending ones
    node_recent: bool  # this step's node is among `recent`: a retry, already counted
    node_ours: bool


class OutOfService:
    """Every node out of service and since when (monotonic; BEFORE for those already out at the first
    list), and, apart, the GPU nodes (`gpu_selector`) among them by when they went out, and those
    carrying FleetMedic's `annotation`. Fed by one watch; read by any thread."""

    def __init__(self, gpu_selector: str | None, annotation: str) -> None:
        self.gpu_selector, self.annotation = gpu_selector, annotation
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}  # every node out of service
        self._gpu: set[str] = set()
        self._filed: dict[str, tuple[float, bool]] = {}  # GPU nodes out: (since, FleetMedic's)
        self._times: list[float] = []  # sorted: when each GPU node out went out
        self._ours: list[float] = []  # sorted: the same, for those FleetMedic took out

    def seen(self, node: NodeInfo, now: float) -> None:
        """A node's state as the watch saw it at `now`."""
        with self._lock:
            self._file(node, now)

    def gone(self, name: str) -> None:
        """A node deleted."""
        with self._lock:
            self._since.pop(name, None)
            self._gpu.discard(name)
            self._unfile(name)

    def listed(self, nodes: Iterable[NodeInfo], now: float, first: bool) -> None:
        """Every node, from a list. The first list's nodes out of service went out BEFORE; a list
        again (after a broken watch) keeps when each node already out went out, and those that
        went out meanwhile go out `now`."""
        with self._lock:
            before = {} if first else self._since
            self._since, self._gpu, self._filed, self._times, self._ours = {}, set(), {}, [], []
            for node in nodes:
                if first and is_out(node):
                    self._since[node.name] = BEFORE
                elif node.name in before:
                    self._since[node.name] = before[node.name]
                self._file(node, now)

    def _file(self, node: NodeInfo, now: float) -> None:
        name = node.name
        self._unfile(name)
        if not is_out(node):
            self._since.pop(name, None)
        else:
            self._since.setdefault(name, now)
        if not label_selector_matches(self.gpu_selector, node.labels):
            self._gpu.discard(name)
            return
        self._gpu.add(name)
        if (since := self._since.get(name)) is not None:
            ours = bool(node.annotations.get(self.annotation))
            self._filed[name] = (since, ours)
            bisect.insort(self._times, since)
            if ours:
                bisect.insort(self._ours, since)

    def _unfile(self, name: str) -> None:
        if (filed := self._filed.pop(name, None)) is None:
            return
        since, ours = filed
        for times in (self._times, self._ours) if ours else (self._times,):
            del times[bisect.bisect_left(times, since)]  # one of the equal times: any will do

    def is_out(self, name: str) -> bool:
        with self._lock:
            return name in self._since

    def tally(self, node: str, since: float, minute_ago: float, pending: Collection[str]) -> Tally:
        """The counts for a step on `node`: GPU nodes gone out after `since`, and FleetMedic's after
        `minute_ago`, each with `pending` (a node in both counted once)."""
        with self._lock:
            def filed(name: str, when: float, mine: bool) -> bool:  # filed as out after `when`
                return (f := self._filed.get(name)) is not None and f[0] > when and (f[1] or not mine)

            def count(times: list[float], when: float, mine: bool) -> int:
                return len(times) - bisect.bisect_right(times, when) + sum(1 for p in pending
                                                                         if not filed(p, when, mine))

            return Tally(gpu_nodes=len(self._gpu), recent=count(self._times, since, False),
                         ours=count(self._ours, minute_ago, True),
                         node_recent=node in pending or filed(node, since, False),
                         node_ours=node in pending or filed(node, minute_ago, True))

    @staticmethod
    def of(nodes: Iterable[NodeInfo], since: dict[str, float], gpu_selector: str | None,
           annotation: str) -> OutOfService:
        """Built from nodes and when each of those out of service went out (BEFORE where `since`
        does not say), as a watch's first list would file them: for tests of the breaker."""
        out = OutOfService(gpu_selector, annotation)
        for node in nodes:
            if node.name in since:
                out._since[node.name] = since[node.name]
            out._file(node, BEFORE)
        return out
