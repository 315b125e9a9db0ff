"""Benchmark: thousands of runs in flight on one worker process.

`--runs` (5,000) XID 79 runs on as many nodes, each taken out of service and then waiting for a
replacement that takes longer than the benchmark (as real ones take minutes to hours) — the
state a fleet-wide incident leaves a worker in. One `fleetmedic worker` process, on the real
control plane, Debian's slurmctld and the Temporal dev server (bench/world.py). Reported: whether
every run got there without an error, escalation or client-pool warning; the worker's peak RSS
(target < 1 GiB); CPU seconds per run of the worker and of the Temporal server; and how long it
took to get all of them there. Then, with every run waiting (`--hold` seconds), what the waits
alone cost: the heartbeats the Temporal server records a second (each a write; a billed action
on Temporal Cloud), the seconds between two heartbeats of one wait, and the server's and the
worker's CPU. The worker is given the shipped manifests' memory limit (`--worker-memory`, 1Gi), as
the downward API gives it, and keeps as many runs in memory as that holds (workers/memory.py).
Last, from every run's history (bench/histories.py): the tasks that timed out, and how long the
worker held the workflow tasks it finished; and the worker's full garbage-collector passes
(bench/gc_record.py: each stops the whole worker), by the runs waiting when each began, with the
workflow tasks the SDK failed as potential deadlocks. `--ungated` is their floor: the same worker
with the interpreter making its full passes wherever they fall (workers/full_passes.py not started).

    python bench/worker_scale.py [--temporal dev|production|both] [--runs 5000] [--hold 300]
                                 [--wait-heartbeat 2m] [--worker-memory 1Gi] [--ungated]

Prints one JSON object, a section per server (`--temporal production`: bench/world.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gc_record import passes_in, recording
from bench.histories import timed_out_tasks
from bench.world import CLUSTER, SERVERS, BenchWorld, count, on_each, peak_rss_mib, start_xid_runs

WAITING = f'FleetCluster = "{CLUSTER}" AND FleetStep = "wait for node Ready"'
CLOSED = f'FleetCluster = "{CLUSTER}" AND ExecutionStatus != "Running"'


HEARTBEAT = "RecordActivityTaskHeartbeat"


async def main(temporal: str, runs: int, deadline_s: float, hold_s: float, wait_heartbeat: str,
               worker_memory: str, ungated: bool) -> dict[str, Any]:
    return {"benchmark": "worker_scale", "kubernetes": "real control plane", "runs": runs,
            "full_passes": "the interpreter's own" if ungated else "between activations (as shipped)",
            "temporal": await on_each(temporal, lambda server: on(server, runs, deadline_s, hold_s, wait_heartbeat,
                                                                   worker_memory, ungated))}


async def on(server: str, runs: int, deadline_s: float, hold_s: float, wait_heartbeat: str,
             worker_memory: str, ungated: bool) -> dict[str, Any]:
    nodes = [f"gpu-{i}" for i in range(runs)]
    # Every run admitted, the cordon breaker's included: this measures the worker, not the budget.
    policy = {"budget": {"max_concurrent": 100000, "max_unavailable_fraction": 1.0, "max_per_hour": 1000000,
                         "topology_label": None, "protective": {"max_out_fraction": 1.0, "max_per_minute": 100000}},
              "grace": {"node_ready_deadline": "6h"}, "retries": {"wait_heartbeat": wait_heartbeat}}
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-scale-"))
    gc_env, gc_passes = recording(workdir, ungated=ungated)
    # 5,000 kwok nodes renewing 40 s leases are 500 API writes a second, which on two cores starved
    # everything else (after 40 min not one run had got there): a 20-minute lease is ~4 a second.
    async with BenchWorld(nodes, workdir, policy, webhook=False, node_lease_s=1200,
                          worker_env={"FLEETMEDIC_WORKER_MEMORY": worker_memory, **gc_env}, temporal=server) as world:
        worker_cpu, server_cpu = world.worker_cpu(), world.temporal_cpu()
        began, began_at = time.monotonic(), time.time()
        await start_xid_runs(world.client, nodes, 200)
        waiting, seen = 0, [(began_at, 0)]  # (wall clock, runs waiting then)
        while time.monotonic() - began < deadline_s:
            waiting = await count(world.client, WAITING)
            seen.append((time.time(), waiting))
            if waiting >= runs:
                break
            await asyncio.sleep(5)
        ramp_s = time.monotonic() - began
        worker_cpu = world.worker_cpu() - worker_cpu
        server_cpu = world.temporal_cpu() - server_cpu
        # The waits alone once every run is there (all_there): nothing else moves, the replacements
        # take longer than the benchmark. Otherwise the ramp goes on during the hold.
        beats, hold_began = world.server_requests(HEARTBEAT), time.monotonic()
        hold_worker_cpu, hold_server_cpu = world.worker_cpu(), world.temporal_cpu()
        await asyncio.sleep(hold_s)
        held = time.monotonic() - hold_began
        beats = world.server_requests(HEARTBEAT) - beats
        hold_worker_cpu = world.worker_cpu() - hold_worker_cpu
        hold_server_cpu = world.temporal_cpu() - hold_server_cpu
        rss = peak_rss_mib(world.worker_pid())
        closed = await count(world.client, CLOSED)
        log = world.worker.log.read_text(errors="replace")
        passes = passes_in(gc_passes, began_at, time.time())
        tasks = await timed_out_tasks(world.client, f'FleetCluster = "{CLUSTER}"', world.server_log())
    pool_warnings = log.count("Connection pool is full")
    kept = re.search(r"keeps up to (\d+) runs in memory", log)
    return {
        "waiting_for_replacement": waiting, "all_there": waiting >= runs, "closed": closed,
        "client_pool_warnings": pool_warnings, "tracebacks_in_worker_log": log.count("Traceback"),
        # Tries refused by a guard too busy to take the request (retried; one line each since
        # workers/failure_lines.py, a traceback each before: tracebacks_in_worker_log counted them).
        "guard_busy_refusals": log.count("did not take the request"),
        "worker_memory": worker_memory, "workflow_cache": int(kept[1]) if kept else None,
        "worker_peak_rss_mib": round(rss, 1), "target_rss_mib": 1024, "meets_rss_target": rss < 1024,
        "worker_cpu_s_per_run": round(worker_cpu / runs, 4), "temporal_cpu_s_per_run": round(server_cpu / runs, 4),
        "ramp_s": round(ramp_s, 1), "runs_per_s": round(waiting / ramp_s, 1),
        "hold": {"seconds": round(held, 1), "wait_heartbeat": wait_heartbeat,
                 "heartbeats_per_s": round(beats / held, 1),
                 "s_between_heartbeats_of_a_wait": round(waiting * held / beats, 1) if beats else None,
                 "temporal_cpu_share": round(hold_server_cpu / held, 3),
                 "worker_cpu_share": round(hold_worker_cpu / held, 3)},
        "timed_out_tasks": tasks,
        "full_gc_passes": full_passes(passes, seen),
        # Workflow tasks the SDK failed for not yielding within its 2 s (given out again by the server).
        "deadlock_detections": log.count("Potential deadlock detected"),
    }


def full_passes(passes: list[tuple[float, float]], seen: list[tuple[float, int]]) -> dict[str, Any]:
    """The worker's full garbage-collector passes (the whole process stops for each; the SDK fails
    a workflow task that does not yield within 2 s), by the runs waiting when each began."""
    def waiting_at(moment: float) -> int:
        return max((n for at, n in seen if at <= moment), default=0)
    lengths = sorted(length for _, length in passes)
    by_thousand: dict[int, list[float]] = {}
    for start, length in passes:
        by_thousand.setdefault(waiting_at(start) // 1000 * 1000, []).append(length)
    buckets = sorted(by_thousand.items())
    return {"count": len(passes), "over_1s": sum(x > 1 for x in lengths), "over_2s": sum(x > 2 for x in lengths),
            "p50_s": round(lengths[len(lengths) // 2], 3) if lengths else None,
            "max_s": round(lengths[-1], 3) if lengths else None,
            "by_runs_waiting": {f"{k}+": {"count": len(v), "max_s": round(max(v), 3)} for k, v in buckets}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temporal", choices=(*SERVERS, "both"), default="both",
                        help="the Temporal server(s) to run on, one after the other")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--deadline", type=float, default=3600, help="seconds to wait for every run to get there")
    parser.add_argument("--hold", type=float, default=300, help="seconds to measure the waits alone after that")
    parser.add_argument("--wait-heartbeat", default="2m", help="the policy's retries.wait_heartbeat")
    parser.add_argument("--worker-memory", default="1Gi", help="the worker's memory limit (FLEETMEDIC_WORKER_MEMORY)")
    parser.add_argument("--ungated", action="store_true",
                        help="the floor: the worker's full garbage-collector passes made by the interpreter, "
                             "wherever they fall (workers/full_passes.py not started)")
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.temporal, options.runs, options.deadline, options.hold,
                                      options.wait_heartbeat, options.worker_memory, options.ungated))))
