"""The objects a FleetMedic process keeps for its whole life, left out of the garbage collector's
full passes.

CPython's collector walks every object it tracks on each full (oldest-generation) pass, and the
process stops meanwhile: its event loop, every workflow task, every activity thread. A worker's
modules, classes and wiring are ~96,000 of those objects, and the Kubernetes client's validators
~66,000 more once built (activities/kube_client.build_api_classes). In bench/xid_latency's world
(1,320 nodes, runs one at a time) the worker's full passes came every ~10 s and took 90-118 ms;
an alert whose protective step met one was out of service in 0.181 s against a median of 0.065 s.
With those objects frozen before the worker serves, the same passes took 8-30 ms (ad hoc, a
gc.callbacks probe in the worker process, 80 alerts).

Frozen objects are still freed when nothing refers to them any more; only a reference cycle among
them that later became unreachable would never be collected: at most some of what was alive at
start-up, once. Runs and requests come after the freeze, so their objects are collected as before.
What the passes still walk grows with the runs a worker keeps; workers/full_passes.py makes them
fall between workflow activations.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects(process: str) -> int:
    """Collect what start-up left behind, then move every object alive now out of the collector's
    passes (`gc.freeze`). Call once, after the imports and the wiring, before serving."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects from start-up are left out of the garbage collector's passes", process, frozen)
    return frozen
