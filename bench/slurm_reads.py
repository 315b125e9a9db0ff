"""Benchmark: what the worker's Slurm reads cost as the cluster grows.

Every alert's protective step reads its Slurm node and the jobs that hold nodes (to find the
node's), the later steps read them again, and each of those jobs by its ID; in a storm runs asking
at once share each read (activities/shared_reads.py). Each read is a CLI process of the worker's
pod, and a request that slurmctld — one per cluster, the process a GPU cluster can least spare —
answers. Debian's slurmctld here, with a fleet of silent nodes (bench/world.py's) and held jobs,
each asking for 8 nodes, as a long training queue has them. Silent nodes run no job: no job here
holds a node, so the reads of the jobs on nodes print none, where a busy cluster's print one line
each.

For each size (`--sizes NODES:JOBS,...`), the CPU a read costs on the worker's side (the
process's, and the worker's own parsing of its answer), its wall time, and how much it printed:
- `jobs`: FleetMedic's read of the jobs that hold nodes (`SlurmCli.active_jobs`, squeue's text of
  those, in the fields it reads);
- `jobs_every_state`: the same text of every job, as FleetMedic read the jobs before it read those
  on nodes alone;
- `jobs_as_json`: every job as `squeue --json`, as FleetMedic read the jobs before it read the text
  (22.05's --json prints every field of every job and ignores every filter);
- `jobs_floor`: `squeue --noheader --states=<those on nodes> -o %i`, the IDs of the jobs that hold
  nodes and nothing else: the least a read of them costs (squeue loads every job either way);
- `job`: FleetMedic's read of one job by its ID (`SlurmCli.jobs_by_id`, squeue's text of that job,
  which squeue asks slurmctld for alone); `job_floor`: that job's ID alone (with jobs only);
- `ended_jobs`: FleetMedic's read of the jobs that ended (`SlurmCli.ended_jobs`, the job-failures
  runbook's reconciliation every 2 minutes: squeue's text of those jobs alone);
- `ended_jobs_as_json`: the same read as `squeue --json --states=all`, as FleetMedic read it before;
- `ended_jobs_floor`: `squeue --noheader --states=<the ended states> -o %i`, those jobs' IDs alone;
- `node`: FleetMedic's read of one node (`SlurmCli.nodes`: sinfo's text of that node);
- `node_with_scontrol`: the same read as `scontrol show node -o NAME`, as FleetMedic read a node
  before it read sinfo's text (scontrol loads every node of the cluster, then prints the one);
- `node_floor`: `sinfo --Node --nodes NAME --Format NodeList`, which asks slurmctld for that node
  alone, and prints its name: the least a read of one node costs.

Target: each FleetMedic read within 1.5x the floor's CPU, at every size. `NODES:JOBS:ENDED` adds
ENDED jobs cancelled while held (ended, kept MinJobAge as the ones the reconciliation looks for).

    python bench/slurm_reads.py [--sizes 1000:0,1000:2000,8000:2000,8000:6000:2000] [--reads 10]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from activities.slurm import ACTIVE_JOB_STATES, JOB_FIELDS, JOB_FORMAT, SlurmCli
from devstack.slurm_cluster import LocalSlurmCluster
from fleetmedic.job_failures import ENDED_STATES

TARGET_RATIO = 1.5
# Each read beside the floor of what it reads.
FLOOR_OF = {"jobs": "jobs_floor", "jobs_every_state": "jobs_floor", "jobs_as_json": "jobs_floor",
            "job": "job_floor", "ended_jobs": "ended_jobs_floor", "ended_jobs_as_json": "ended_jobs_floor",
            "node": "node_floor", "node_with_scontrol": "node_floor"}
TARGETS = ("jobs", "job", "ended_jobs", "node")
ACTIVE = ",".join(ACTIVE_JOB_STATES)
ENDED = ",".join(sorted(ENDED_STATES))


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


class Printed:
    """How many characters the last process of `cli` printed: its reads keep running their processes
    as the worker's do (`SlurmCli._run`), watched on their way back."""

    def __init__(self, cli: SlurmCli) -> None:
        self.chars, real = 0, cli._run

        def run(argv: Sequence[str], stdin: str | None = None,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            done = real(argv, stdin, env)
            self.chars = len(done.stdout)
            return done

        cli._run = run  # type: ignore[method-assign]


def measure(read: Callable[[], Any], printed: Printed, reads: int) -> dict[str, Any]:
    """CPU a read (its process's and this thread's: the parsing), wall time, what its process printed."""
    cpu, wall = [], []
    for _ in range(reads):
        children, own, began = children_cpu(), time.thread_time(), time.perf_counter()
        read()
        wall.append(time.perf_counter() - began)
        cpu.append(children_cpu() - children + time.thread_time() - own)
    return {"cpu_ms": round(statistics.median(cpu) * 1000, 2), "wall_ms": round(statistics.median(wall) * 1000, 2),
            "printed_chars": printed.chars}


def held_jobs(env: dict[str, str], jobs: int, ended: int) -> None:
    """`jobs` held jobs of 8 nodes each, and `ended` more cancelled, submitted by one shell (a process
    per sbatch from here would take longer than the reads)."""
    script = "".join(f"sbatch --hold -N 8 -J '{name}-{i}' --wrap 'sleep 1000' >/dev/null || exit 1\n"
                     for name, count in (("train", jobs), ("ended", ended)) for i in range(count))
    script += "squeue --noheader -o '%i %j' | awk '$2 ~ /^ended-/ {print $1}' | xargs -r scancel\n" if ended else ""
    subprocess.run(["bash", "-o", "pipefail"], input=script, text=True, env=env, check=True,
                   timeout=max(60, (jobs + ended) / 10))


def on(nodes: int, jobs: int, ended: int, reads: int) -> dict[str, Any]:
    names = [f"gpu-{i}" for i in range(nodes)]
    with LocalSlurmCluster([], silent_nodes=names, workdir=Path(tempfile.mkdtemp(prefix="fleetmedic-bench-"))) as slurm:
        held_jobs({**os.environ, **slurm.env}, jobs, ended)
        cli = SlurmCli(str(slurm.conf), timeout_s=60)
        printed = Printed(cli)
        node = names[len(names) // 2]
        ids = cli.run("squeue", "--noheader", "--states=all", "-o", "%i").split()
        job = int(ids[len(ids) // 2]) if ids else None
        by_id: tuple[tuple[str, Callable[[], Any]], ...] = () if job is None else (
            ("job", lambda: cli.jobs_by_id({job})),
            ("job_floor", lambda: cli.run("squeue", "--noheader", "--states=all", f"--jobs={job}", "-o", "%i")))
        found = {name: measure(read, printed, reads) for name, read in (
            ("jobs", cli.active_jobs),
            ("jobs_every_state", lambda: cli._jobs_read(cli.run(
                "squeue", "--noheader", "--all", "--states=all", f"--Format={JOB_FORMAT}"), JOB_FIELDS, "every job")),
            ("jobs_as_json", lambda: cli._json("squeue", "--json")["jobs"]),
            ("jobs_floor", lambda: cli.run("squeue", "--noheader", f"--states={ACTIVE}", "-o", "%i").split()),
            *by_id,
            ("ended_jobs", cli.ended_jobs),
            ("ended_jobs_as_json", lambda: cli._json("squeue", "--json", "--states=all")["jobs"]),
            ("ended_jobs_floor", lambda: cli.run("squeue", "--noheader", f"--states={ENDED}", "-o",
                                                 "%i").split()),
            ("node", lambda: cli.nodes({node})),
            ("node_with_scontrol", lambda: cli.run("scontrol", "show", "node", "-o", node)),
            ("node_floor", lambda: cli.run("sinfo", "--noheader", "--Node", "--nodes", node, "--Format", "NodeList")))}
        assert len(ids) == jobs + ended and cli.active_jobs() == [] and len(cli.ended_jobs()) == ended
        assert (job is None or list(cli.jobs_by_id({job})) == [job]) and cli.nodes({node})[node].name == node
        assert cli.jobs_read_as_json == 0
    ratios = {name: found[name]["cpu_ms"] / found[floor]["cpu_ms"] for name, floor in FLOOR_OF.items()
              if name in found}
    return {"cluster": {"nodes": nodes, "jobs": jobs, "ended": ended}, **found,
            "cpu_over_floor": {name: round(ratio, 2) for name, ratio in ratios.items()},
            "meets_target": {name: ratios[name] <= TARGET_RATIO for name in TARGETS if name in ratios}}


def main(sizes: list[tuple[int, int, int]], reads: int) -> dict[str, Any]:
    return {"benchmark": "slurm_reads", "slurm": "Debian's Slurm 22.05, silent nodes, held 8-node jobs",
            "what": "CPU of one read on the worker's side: the CLI process and the worker parsing its answer "
                    "(medians)", "target_ratio": TARGET_RATIO,
            "sizes": [on(nodes, jobs, ended, reads) for nodes, jobs, ended in sizes]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000:0,1000:2000,8000:2000,8000:6000:2000",
                        help="NODES:JOBS[:ENDED] of each cluster, comma-separated")
    parser.add_argument("--reads", type=int, default=10)
    options = parser.parse_args()
    sizes = [[int(n) for n in size.split(":")] + [0] for size in options.sizes.split(",")]
    print(json.dumps(main([(nodes, jobs, ended) for nodes, jobs, ended, *_ in sizes], options.reads)))
