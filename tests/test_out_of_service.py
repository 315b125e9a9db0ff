"""The node watch's record of nodes out of service gives the cordon breaker the counts a pass over
the whole fleet would: checked against that pass, after random sequences of what a watch sees
(nodes cordoned, uncordoned, NotReady, relabelled, annotated, deleted, listed again)."""

from __future__ import annotations

import random

from activities.out_of_service import BEFORE, OutOfService, is_out
from fleetmedic.models import NodeInfo
from fleetmedic.selectors import label_selector_matches

SELECTOR = "nvidia.com/gpu.present=true"
ANNOTATION = "fleetmedic.io/workflow"


def reference(nodes: dict[str, NodeInfo], since: dict[str, float], node: str, window_start: float,
              minute_ago: float, pending: set[str]) -> tuple[int, int, int, bool, bool]:
    """The counts as a pass over every node makes them (the breaker's arithmetic before the record)."""
    gpu = [n for n in nodes.values() if label_selector_matches(SELECTOR, n.labels)]
    recent = {n.name for n in gpu if since.get(n.name, float("-inf")) > window_start} | pending
    ours = {n.name for n in gpu if since.get(n.name, float("-inf")) > minute_ago and n.annotations.get(ANNOTATION)} \
        | pending
    return len(gpu), len(recent), len(ours), node in recent, node in ours


def random_node(rng: random.Random, name: str) -> NodeInfo:
    return NodeInfo(name=name, ready=rng.random() > 0.2, unschedulable=rng.random() < 0.5, gpu_allocatable=8,
                    labels={"nvidia.com/gpu.present": "true"} if rng.random() < 0.8 else {},
                    annotations={ANNOTATION: f"xid-recovery/c/{name}"} if rng.random() < 0.5 else {})


def test_the_counts_are_those_of_a_pass_over_every_node() -> None:
    rng = random.Random(7)
    names = [f"n{i}" for i in range(60)]
    for _ in range(20):
        out = OutOfService(SELECTOR, ANNOTATION)
        nodes = {n: random_node(rng, n) for n in names}
        since = {n: BEFORE for n, info in nodes.items() if is_out(info)}  # out at the first list
        out.listed(nodes.values(), 0.0, first=True)
        now = 0.0
        for _ in range(300):
            now += rng.choice((0.0, 0.5, 7.0))  # equal times too: a list files many at once
            name = rng.choice(names)
            action = rng.random()
            if action < 0.05:  # deleted
                nodes.pop(name, None)
                since.pop(name, None)
                out.gone(name)
            elif action < 0.08:  # listed again after a broken watch (a node may have come back)
                nodes[name] = random_node(rng, name)
                since = {n: since.get(n, now) for n, info in nodes.items() if is_out(info)}
                out.listed(nodes.values(), now, first=False)
            else:
                nodes[name] = info = random_node(rng, name)
                if is_out(info):
                    since.setdefault(name, now)
                else:
                    since.pop(name, None)
                out.seen(info, now)
            for n in names:
                assert out.is_out(n) == (n in since)
            pending = set(rng.sample(names, rng.randint(0, 3)))
            window_start, minute_ago = now - rng.choice((0.0, 5.0, 60.0, 600.0)), now - 60.0
            asked = rng.choice(names)
            tally = out.tally(asked, window_start, minute_ago, pending)
            assert (tally.gpu_nodes, tally.recent, tally.ours, tally.node_recent, tally.node_ours) == \
                reference(nodes, since, asked, window_start, minute_ago, pending)
