"""The controllers the emulated fleet lacks, driven explicitly (tests) or in the background (dev)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from workers.devstack.kube_emulator import KubeEmulatorThread
from workers.devstack.standins import ProviderStandIn


def set_ready(kube: KubeEmulatorThread, node: str, ready: bool) -> None:
    """What a kubelet does: flip the node's Ready condition, with a fresh transition time."""
    obj = kube.emulator.get("v1", "Node", node)
    if obj is None:
        raise KeyError(f"node {node} does not exist")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for condition in obj["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = "True" if ready else "False"
            condition["lastTransitionTime"] = now
    kube.emulator.put(obj)


@contextmanager
def provider_controller(kube: KubeEmulatorThread, provider: ProviderStandIn,
                        delay_s: float = 1.0) -> Iterator[list[str]]:
    """Play the node provider: each accepted request takes its node NotReady, then Ready again
    `delay_s` later (a new machine, or the same one rebooted, rejoining under the same name)."""
    handled: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for record in provider.records():
                if record.id in handled or record.body["action"] == "rma":
                    continue
                handled.append(record.id)
                try:
                    set_ready(kube, record.body["node"], False)
                    time.sleep(delay_s)
                    set_ready(kube, record.body["node"], True)
                except KeyError:
                    pass
            stop.wait(0.2)

    thread = threading.Thread(target=loop, daemon=True, name="provider-controller")
    thread.start()
    try:
        yield handled
    finally:
        stop.set()
        thread.join(5)
