"""Benchmark: how long the worker stops for the garbage collector's full passes, with its start-up
objects frozen (workers/heap.py, as shipped) and without, alerts one at a time in the same world.

CPython's full (oldest-generation) pass walks every object the process tracks and stops the
whole worker meanwhile: its event loop, every workflow task, every activity thread. An alert whose
protective step meets one waits it out. Each side starts its own `fleetmedic worker` in a world
of `--fleet` nodes (bench/world.py: the real control plane, Debian's slurmctld, the dev or
production Temporal server), sends `--alerts` XID 79 alerts one at a time as xid_latency's
one-at-a-time case does, and records every full pass in the worker process (gc.callbacks, through
a sitecustomize of this benchmark's own). The side without the freeze is the same worker with
`gc.freeze` made a no-op: like for like, the floor the freeze is measured against.

    python bench/gc_pauses.py [--temporal dev|production] [--alerts 60] [--fleet 1320]

Prints one JSON object: for each side the passes during the alerts (how many, their pauses), the
alerts' latency (POST to cordoned and DRAIN, seen from outside) and those that met a pass; the
frozen side's pause p50 and max over the unfrozen side's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gc_record import passes_in, recording
from bench.world import BenchWorld
from bench.xid_latency import EVERY_RUN_ADMITTED, quietly, summary


async def side(temporal: str, alerts: int, fleet: int, frozen: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-bench-gc-"))
    env, passes = recording(workdir, unfrozen=not frozen)
    names = [f"gpu-a-{i}" for i in range(alerts + 1)]
    names += [f"gpu-z-{i}" for i in range(max(fleet - len(names), 0))]
    async with BenchWorld(names, workdir, EVERY_RUN_ADMITTED, worker_env=env, temporal=temporal) as world:
        await quietly(world, names[alerts])  # warm-up (not counted)
        sent: list[tuple[float, float]] = []
        began = time.time()
        for node in names[:alerts]:
            at = time.time()
            sent.append((at, await quietly(world, node)))
        ended = time.time()
    seen = passes_in(passes, began, ended)
    pauses = [length for _, length in seen]
    met = [latency for at, latency in sent if any(at <= start <= at + latency for start, _ in seen)]
    log = (workdir / "worker.log").read_text()
    frozen_line = next((line for line in log.splitlines() if "objects from start-up" in line), "")
    return {
        "frozen_at_start": frozen_line.split(": ", 2)[-1] if frozen_line else "nothing (gc.freeze made a no-op)",
        "full_passes": len(seen),
        "full_passes_per_minute": round(len(seen) / (ended - began) * 60, 1),
        "pause_ms": {"p50": round(statistics.median(pauses) * 1000, 1), "max": round(max(pauses) * 1000, 1)}
        if pauses else None,
        "alerts": summary([latency for _, latency in sent]),
        "alerts_that_met_a_pass": len(met),
        "their_latency_s": [round(x, 4) for x in met],
    }


async def main(temporal: str, alerts: int, fleet: int) -> dict[str, Any]:
    unfrozen = await side(temporal, alerts, fleet, frozen=False)
    frozen = await side(temporal, alerts, fleet, frozen=True)
    out: dict[str, Any] = {"temporal": temporal, "alerts": alerts, "fleet_nodes": fleet,
                           "shipped_frozen_start_up": frozen, "floor_unfrozen": unfrozen}
    if frozen["pause_ms"] and unfrozen["pause_ms"]:
        out["pause_p50_over_floor"] = round(frozen["pause_ms"]["p50"] / unfrozen["pause_ms"]["p50"], 2)
        out["pause_max_over_floor"] = round(frozen["pause_ms"]["max"] / unfrozen["pause_ms"]["max"], 2)
        out["pauses_shorter_than_floor"] = frozen["pause_ms"]["max"] < unfrozen["pause_ms"]["p50"]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temporal", choices=("dev", "production"), default="dev")
    parser.add_argument("--alerts", type=int, default=60)
    parser.add_argument("--fleet", type=int, default=1320, help="nodes in the world (xid_latency's default world)")
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.temporal, options.alerts, options.fleet)), indent=2))
