"""How many runs a worker keeps in memory between their steps: as many as the memory it has holds.

A run kept in memory costs the worker ~200 KB: the SDK keeps the state of every step the run took,
and the run's own objects (bench/worker_scale.py: 1,124 MiB for 5,000 runs in flight, ~155 of them
the process at start). At a fixed 10,000, a worker under the shipped 1 GiB limit would be killed
for memory at ~4,300 runs in flight, a fleet-wide incident's worth, and its replacement would replay
them all back into memory, to be killed again. A run that is not kept costs nothing while it waits (a
wait is one activity: the run does not wake) and is replayed from its history at its next step, a
few tens of milliseconds. So the bound follows the worker's memory: the `FLEETMEDIC_WORKER_MEMORY`
the manifests set from the container's limit (downward API), else the limit of the process's cgroup.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fleetmedic.settings import Settings

# What a kept run is counted at: the ~200 KB measured, with room for a long run's history.
PER_RUN = 256 * 1024
# The process itself (~155 MiB at start), the waits' coroutines of runs not kept, a replay's peak.
RESERVED = 320 * 1024 * 1024
# Without a limit: enough for every run a 5,000-node incident leaves in flight, twice over.
MOST = 10_000
# With too little memory for the reserve: still enough runs kept that a small storm is not replayed
# at every step (and the process is told so at start).
LEAST = 100
# cgroup v1 writes "no limit" as the largest page-aligned int64.
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class CacheSize:
    runs: int
    why: str


def workflow_cache(settings: Settings, cgroup_root: Path = Path("/sys/fs/cgroup"),
                   proc_cgroup: Path = Path("/proc/self/cgroup")) -> CacheSize:
    """The runs this worker keeps in memory, and why that many (logged at start)."""
    if settings.workflow_cache is not None:
        return CacheSize(settings.workflow_cache, "FLEETMEDIC_WORKFLOW_CACHE")
    memory: int | None
    if settings.worker_memory is not None:
        memory, source = settings.worker_memory, "FLEETMEDIC_WORKER_MEMORY"
    else:
        memory, source = cgroup_memory_limit(cgroup_root, proc_cgroup), "the cgroup's memory limit"
    if memory is None:
        return CacheSize(MOST, "no memory limit")
    runs = min(MOST, max(LEAST, (memory - RESERVED) // PER_RUN))
    return CacheSize(runs, f"{memory / 2**20:.0f} MiB ({source}): {RESERVED >> 20} MiB for the process, "
                           f"{PER_RUN >> 10} KiB a run")


def cgroup_memory_limit(root: Path, proc_cgroup: Path) -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, else v1 `memory.limit_in_bytes`),
    None when there is none or it cannot be read. Inside a container the cgroup is its root."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            candidates += [root / relative / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            v1 = root / "memory"
            candidates += [v1 / relative / "memory.limit_in_bytes", v1 / "memory.limit_in_bytes"]
    for candidate in candidates:
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        return int(text) if text.isdigit() and int(text) < UNLIMITED else None
    return None
