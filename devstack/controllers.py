"""The controllers the emulated fleet lacks, driven explicitly (tests) or in the background (dev)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from devstack.kube_world import RealKube
from devstack.standins import ProviderStandIn

if TYPE_CHECKING:
    from devstack.kube_world import RealKube


def set_ready(kube: Any, node: str, ready: bool) -> None:
    """What a kubelet does: flip the node's Ready condition, with a fresh transition time."""
    if hasattr(kube, "set_ready"):  # the real control plane: kwok flips it, as a kubelet would
        kube.set_ready(node, ready)
        return
    obj = kube.get("v1", "Node", node)
    if obj is None:
        raise KeyError(f"node {node} does not exist")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for condition in obj["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "True" if ready else "False"
            condition["lastTransitionTime"] = now
    kube.put(obj)


@contextmanager
def every(interval_s: float, step: Callable[[], None], name: str) -> Iterator[None]:
    """Run `step` in a background thread every `interval_s` until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            step()
            stop.wait(interval_s)

    thread = threading.Thread(target=loop, daemon=True, name=name)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


@contextmanager
def provider_controller(kube: RealKube, provider: ProviderStandIn,
                        delay_s: float = 1.0, on_replaced: Callable[[str], None] | None = None) -> Iterator[list[str]]:
    """Play the node provider: each accepted request takes its node NotReady, then Ready again
    `delay_s` later (a new machine, or the same one rebooted, rejoining under the same name).
    `on_replaced(node)` runs while it is down: the dev stack's agents get healthy GPUs there."""
    handled: list[str] = []

    def step() -> None:
        for record in provider.records():
            if record.id in handled or record.body["action"] in ("rma", "prewarm"):
                continue
            handled.append(record.id)
            try:
                set_ready(kube, record.body["node"], False)
                if on_replaced is not None:
                    on_replaced(record.body["node"])
                time.sleep(delay_s)
                set_ready(kube, record.body["node"], True)
            except KeyError:
                pass

    with every(0.2, step, "provider-controller"):
        yield handled
