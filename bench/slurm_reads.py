"""Benchmark: what the protective step's Slurm reads cost as the cluster grows.

Every alert's protective step reads its Slurm node and the cluster's jobs (to find the node's), and
the later steps read them again; in a storm runs asking at once share each read
(activities/shared_reads.py). Each read is a CLI process of the worker's pod, and a request that
slurmctld — one per cluster, the process a GPU cluster can least spare — answers. Debian's
slurmctld here, with a fleet of silent nodes (bench/world.py's) and held jobs, each asking for 8
nodes, as a long training queue has them.

For each size (`--sizes NODES:JOBS,...`), the CPU a read costs on the worker's side (the
process's, and the worker's own parsing of its answer), its wall time, and how much it printed:
- `jobs`: FleetMedic's read of the jobs (`SlurmCli.jobs`, squeue's text in the fields it reads);
- `jobs_as_json`: the same read as `squeue --json`, as FleetMedic read the jobs before it read the text
  (22.05's --json prints every field of every job and ignores every filter);
- `jobs_floor`: `squeue --noheader --states=all -o %i`, every job's ID and nothing else: the least
  a read of the cluster's jobs costs;
- `node`: FleetMedic's read of one node (`SlurmCli.nodes`: sinfo's text of that node);
- `node_with_scontrol`: the same read as `scontrol show node -o NAME`, as FleetMedic read a node
  before it read sinfo's text (scontrol loads every node of the cluster, then prints the one);
- `node_floor`: `sinfo --Node --nodes NAME --Format NodeList`, which asks slurmctld for that node
  alone, and prints its name: the least a read of one node costs.

Target: each FleetMedic read within 1.5x the floor's CPU, at every size.

    python bench/slurm_reads.py [--sizes 1000:0,1000:2000,8000:2000] [--reads 10]

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from activities.slurm import SlurmCli
from devstack.slurm_cluster import LocalSlurmCluster

TARGET_RATIO = 1.5
# Each read beside the floor of what it reads.
FLOOR_OF = {"jobs": "jobs_floor", "jobs_as_json": "jobs_floor",
            "node": "node_floor", "node_with_scontrol": "node_floor"}


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


class Printed:
    """How many characters the last process of `cli` printed: its reads keep running their processes
    as the worker's do (`SlurmCli._run`), watched on their way back."""

    def __init__(self, cli: SlurmCli) -> None:
        self.chars, real = 0, cli._run

        def run(argv: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
            done = real(argv, stdin)
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


def held_jobs(env: dict[str, str], jobs: int) -> None:
    """`jobs` held jobs of 8 nodes each, submitted by one shell (a process per sbatch from here
    would take longer than the reads)."""
    script = "".join(f"sbatch --hold -N 8 -J 'train-{i}' --wrap 'sleep 1000' >/dev/null || exit 1\n"
                     for i in range(jobs))
    subprocess.run(["bash"], input=script, text=True, env=env, check=True, timeout=max(60, jobs / 10))


def on(nodes: int, jobs: int, reads: int) -> dict[str, Any]:
    names = [f"gpu-{i}" for i in range(nodes)]
    with LocalSlurmCluster([], silent_nodes=names, workdir=Path(tempfile.mkdtemp(prefix="fleetmedic-bench-"))) as slurm:
        held_jobs({**os.environ, **slurm.env}, jobs)
        cli = SlurmCli(str(slurm.conf), timeout_s=60)
        printed = Printed(cli)
        node = names[len(names) // 2]
        found = {name: measure(read, printed, reads) for name, read in (
            ("jobs", cli.jobs),
            ("jobs_as_json", lambda: cli._json("squeue", "--json")["jobs"]),
            ("jobs_floor", lambda: cli.run("squeue", "--noheader", "--states=all", "-o", "%i").split()),
            ("node", lambda: cli.nodes({node})),
            ("node_with_scontrol", lambda: cli.run("scontrol", "show", "node", "-o", node)),
            ("node_floor", lambda: cli.run("sinfo", "--noheader", "--Node", "--nodes", node, "--Format", "NodeList")))}
        assert len(cli.jobs()) == jobs and cli.nodes({node})[node].name == node and cli.jobs_read_as_json == 0
    ratios = {name: found[name]["cpu_ms"] / found[floor]["cpu_ms"] for name, floor in FLOOR_OF.items()}
    return {"cluster": {"nodes": nodes, "jobs": jobs}, **found,
            "cpu_over_floor": {name: round(ratio, 2) for name, ratio in ratios.items()},
            "meets_target": {name: ratios[name] <= TARGET_RATIO for name in ("jobs", "node")}}


def main(sizes: list[tuple[int, int]], reads: int) -> dict[str, Any]:
    return {"benchmark": "slurm_reads", "slurm": "Debian's Slurm 22.05, silent nodes, held 8-node jobs",
            "what": "CPU of one read on the worker's side: the CLI process and the worker parsing its answer "
                    "(medians)", "target_ratio": TARGET_RATIO,
            "sizes": [on(nodes, jobs, reads) for nodes, jobs in sizes]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000:0,1000:2000,8000:2000",
                        help="NODES:JOBS of each cluster, comma-separated")
    parser.add_argument("--reads", type=int, default=10)
    options = parser.parse_args()
    sizes = [size.split(":") for size in options.sizes.split(",")]
    print(json.dumps(main([(int(nodes), int(jobs)) for nodes, jobs in sizes], options.reads)))
