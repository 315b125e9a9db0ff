"""Benchmark: does the job-failures runbook find the bad nodes of a fleet, and only them?

A simulated week of a 2,000-node fleet (16,000 GPUs, the size of Llama 3's pretraining cluster)
running 200 training jobs, replayed through the real attribution code (fleetmedic/attribution.py,
the functions the job-failures workflow calls) with the default policy. Drawn from a seeded model:

- job sizes 2-32 nodes (about two thirds of the fleet busy); every job checkpoints every 30 min;
- a few bad nodes: a job on one fails every `--bad-mtbf-h` hours of use (NCCL timeouts, a hang);
- transient hardware faults: one-off failures on random nodes, ~30 a week (Llama 3 reports 419
  unexpected interruptions in 54 days on 16k GPUs, 78 % of them hardware: about 55 a week);
- application crashes, ~15 a week, half of them recognisable as such (a Python traceback);
- one bad code push: 10 jobs fail within 20 minutes, for no node's fault;
- a failed job restarts on a new allocation that keeps each of its nodes with p = 0.5 (the others
  went to jobs that were waiting); FleetMedic restarts it within 5 minutes, a person (without
  FleetMedic) after an hour on average;
- a suspect's trial takes its node out 2 hours (drain, burn-in): a bad node fails the burn-in
  (p = 0.95) and is replaced by a good one; a good node passes and returns, its record cleared.

Reports precision and recall of the suspects sent to trial, the healthy nodes sent to burn-in, how
long a bad node stayed (in failures of a job that kept landing on it, and in hours), and the
effective training time ratio (ETTR) with FleetMedic, without it, and with an oracle that removes
each bad node at its first failure: the floor FleetMedic is measured against, in the same run.

    python bench/crash_attribution.py [--seeds 5] [--nodes 2000] [--jobs 200] [--bad 8]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile
from fleetmedic.attribution import Failure, assess, trials_within
from fleetmedic.policy import CrashPolicy

T0 = datetime(2026, 11, 23, tzinfo=UTC)
WEEK_H = 168.0
CHECKPOINT_H = 0.5
TRIAL_H = 2.0


@dataclass
class Job:
    name: str
    size: int
    nodes: list[str] = field(default_factory=list)
    started: float = 0.0  # the current attempt's start (hours)
    lost_h: float = 0.0
    epoch: int = 0  # bumps at every restart: failures drawn for an older attempt are void
    failures_on: dict[str, int] = field(default_factory=dict)  # bad node → failures of this job on it
    began: float = 0.0
    ended: float | None = None
    done: bool = False


class Fleet:
    """One simulated week under one attribution strategy: `fleetmedic`, `none` or `oracle`."""

    def __init__(self, seed: int, args: argparse.Namespace, strategy: str) -> None:
        self.rng = random.Random(seed)  # the same draws for every strategy until they diverge
        self.args, self.strategy = args, strategy
        self.policy = crash_policy(args)
        self.nodes = [f"gpu-{i:04d}" for i in range(args.nodes)]
        self.bad = set(self.rng.sample(self.nodes, args.bad))
        self.out: dict[str, float] = {}  # node → hour it returns from its trial
        self.busy: dict[str, str] = {}
        self.events: list[tuple[float, int, str, str, int]] = []  # (hour, seq, kind, job, epoch)
        self.seq = 0
        self.jobs: dict[str, Job] = {}
        self.next_job = 0
        self.failures: list[Failure] = []
        self.cleared: dict[str, datetime] = {}
        self.trials: list[datetime] = []
        self.tried: list[tuple[str, bool, float]] = []  # (node, was bad, hour)
        self.first_failure: dict[str, float] = {}  # bad node → hour of the first failure it caused
        self.caused: dict[str, int] = {}  # bad node → failures it caused while in service
        self.removed_after: dict[str, tuple[int, int, float]] = {}  # bad node → (failures, worst job's, hours)
        self.removed_job_size: dict[str, int] = {}  # bad node → the size of the job that failed most on it
        self.held = 0
        self.rules: dict[tuple[str, bool], int] = {}
        self.widespread = 0
        for _ in range(args.jobs):
            self.new_job(0.0)
        self.seq += 1
        heapq.heappush(self.events, (self.rng.uniform(24, WEEK_H - 24), self.seq, "code-push", "", 0))

    # --- the model -------------------------------------------------------------------------------

    def new_job(self, hour: float) -> None:
        """A job of 2-32 nodes (the fleet about 95 % busy) that runs `--job-hours` on average."""
        size = self.rng.choices([2, 4, 8, 16, 32], weights=[20, 25, 25, 20, 10])[0]
        size = min(size, len([n for n in self.nodes if n not in self.busy and self.out.get(n, -1.0) <= hour]))
        if size == 0:
            return
        job = Job(f"job-{self.next_job}", size, began=hour)
        self.next_job += 1
        self.jobs[job.name] = job
        self.allocate(job, hour, keep=[])
        self.schedule(job, hour)
        self.push(hour + self.rng.expovariate(1 / self.args.job_hours), "done", job)

    def push(self, hour: float, kind: str, job: Job) -> None:
        self.seq += 1
        heapq.heappush(self.events, (hour, self.seq, kind, job.name, job.epoch))

    def allocate(self, job: Job, hour: float, keep: list[str]) -> None:
        free = [n for n in self.nodes if n not in self.busy and self.out.get(n, -1.0) <= hour and n not in keep]
        # A fleet short of free nodes (trials out) runs the job a little smaller, not never.
        chosen = keep + self.rng.sample(free, min(job.size - len(keep), len(free)))
        for node in chosen:
            self.busy[node] = job.name
        job.nodes, job.started = chosen, hour

    def schedule(self, job: Job, hour: float) -> None:
        """The attempt's next failure: the first of its bad nodes, a transient fault, an app crash."""
        bad = [n for n in job.nodes if n in self.bad]
        rates = {"bad": len(bad) / self.args.bad_mtbf_h,
                 "transient": job.size * 30 / (WEEK_H * self.args.nodes),
                 "app": 15 / (WEEK_H * self.args.jobs)}
        total = sum(rates.values())
        at = hour + self.rng.expovariate(total)
        kind = self.rng.choices(list(rates), weights=list(rates.values()))[0]
        self.push(at, kind, job)

    def run(self) -> dict[str, float]:
        while self.events:
            hour, _, kind, name, epoch = heapq.heappop(self.events)
            if hour >= WEEK_H:
                break
            if kind == "code-push":  # 10 running jobs fail within 20 minutes: software
                running = [j for j in self.jobs.values() if not j.done]
                for job in self.rng.sample(running, min(10, len(running))):
                    self.push(hour + self.rng.uniform(0, 1 / 3), "push", job)
                continue
            job = self.jobs[name]
            if kind == "done":
                if not job.done:
                    self.finish(job, hour)
                continue
            if epoch != job.epoch or job.done:
                continue  # drawn for an attempt that already ended
            self.fail(job, hour, kind)
        wall = sum((j.ended or WEEK_H) - j.began for j in self.jobs.values())
        lost = sum(j.lost_h for j in self.jobs.values())
        return {"ettr": 1 - lost / wall, "lost_h": lost}

    def fail(self, job: Job, hour: float, kind: str) -> None:
        bad_here = [n for n in job.nodes if n in self.bad]
        culprit = self.rng.choice(bad_here) if kind == "bad" and bad_here else None
        if culprit is not None:
            self.first_failure.setdefault(culprit, hour)
            self.caused[culprit] = self.caused.get(culprit, 0) + 1
            job.failures_on[culprit] = job.failures_on.get(culprit, 0) + 1
        explained = "its output says the code failed" if kind == "app" and self.rng.random() < 0.5 else ""
        at = T0 + timedelta(hours=hour)
        failure = Failure(key=f"{job.name}:{hour}", job=job.name, nodes=tuple(job.nodes), at=at,
                          cause="exit" if kind == "app" else "nccl", explained=explained)
        self.failures.append(failure)
        self.failures = [f for f in self.failures if f.at > at - self.policy.window]
        delay = self.rng.expovariate(1.0) if self.strategy == "none" else 5 / 60
        job.lost_h += (hour - job.started) % CHECKPOINT_H + delay
        if self.strategy == "fleetmedic":
            self.attribute(failure, hour)
        elif self.strategy == "oracle" and culprit is not None:
            self.trial(culprit, hour, bad=True)
        self.restart(job, hour + delay)

    def finish(self, job: Job, hour: float) -> None:
        job.done, job.ended = True, hour
        job.epoch += 1
        for node in job.nodes:
            self.busy.pop(node, None)
        self.new_job(hour)  # the queue never empties: another job takes the nodes

    def restart(self, job: Job, hour: float) -> None:
        for node in job.nodes:
            self.busy.pop(node, None)
        keep = [n for n in job.nodes if self.rng.random() < self.args.keep and self.out.get(n, -1.0) <= hour]
        job.epoch += 1
        self.allocate(job, hour, keep)
        self.schedule(job, hour)

    def attribute(self, failure: Failure, hour: float) -> None:
        at = failure.at
        verdict = assess(self.failures, failure, self.policy, fleet_size=len(self.nodes), cleared=self.cleared,
                         now=at)
        if verdict.widespread:
            self.widespread += 1
            return
        for suspicion in verdict.suspects:
            if trials_within(self.trials, at) >= self.policy.max_suspects_per_hour:
                self.held += 1
                continue
            self.trials.append(at)
            self.cleared[suspicion.node] = at
            self.trial(suspicion.node, hour, bad=suspicion.node in self.bad, rule=suspicion.rule)

    def trial(self, node: str, hour: float, bad: bool, rule: str = "oracle") -> None:
        if self.out.get(node, -1.0) > hour:
            return
        self.tried.append((node, bad, hour))
        self.rules[(rule, bad)] = self.rules.get((rule, bad), 0) + 1
        self.out[node] = hour + TRIAL_H
        if bad and node not in self.removed_after:
            worst_job = max(self.jobs.values(), key=lambda j: j.failures_on.get(node, 0))
            worst = worst_job.failures_on.get(node, 0)
            self.removed_after[node] = (self.caused.get(node, 0), worst, hour - self.first_failure.get(node, hour))
            self.removed_job_size[node] = worst_job.size
        if bad and (self.strategy == "oracle" or self.rng.random() < 0.95):
            self.bad.discard(node)  # replaced by a good one
        owner = self.busy.get(node)
        if owner is not None:  # its job is drained and restarts elsewhere: no failure, a short loss
            job = self.jobs[owner]
            job.lost_h += 5 / 60
            self.restart(job, hour + 5 / 60)


def crash_policy(args: argparse.Namespace) -> CrashPolicy:
    return CrashPolicy.model_validate(dict(kv.split("=", 1) for kv in args.set))


def one_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    runs = {s: Fleet(seed, args, s) for s in ("fleetmedic", "none", "oracle")}
    results = {s: f.run() for s, f in runs.items()}
    fm = runs["fleetmedic"]
    initially_bad = set(Fleet(seed, args, "none").bad)
    failing_bad = set(fm.first_failure)  # bad nodes that failed a job: those there was evidence for
    tried_bad = {n for n, bad, _ in fm.tried if bad}
    tried_good = {n for n, bad, _ in fm.tried if not bad}
    removal = list(fm.removed_after.values())
    return {
        "seed": seed, "bad_nodes": len(initially_bad), "bad_nodes_that_failed_jobs": len(failing_bad),
        "trials": len(fm.tried), "bad_found": len(tried_bad & initially_bad), "healthy_to_burn_in": len(tried_good),
        "recall": len(tried_bad & failing_bad) / len(failing_bad) if failing_bad else 1.0,
        "precision": len(tried_bad) / (len(tried_bad) + len(tried_good)) if fm.tried else 1.0,
        "failures_before_removal": [r[0] for r in removal],
        "worst_job_failures_before_removal": [r[1] for r in removal],
        "worst_job_sizes": [fm.removed_job_size[n] for n in fm.removed_after],
        "hours_first_failure_to_trial": [round(r[2], 2) for r in removal],
        "trials_by_rule": {f"{rule} ({'bad' if bad else 'healthy'})": n for (rule, bad), n in sorted(fm.rules.items())},
        "held_by_hourly_bound": fm.held, "widespread_verdicts": fm.widespread,
        **{f"ettr_{name}": round(result["ettr"], 5) for name, result in results.items()},
        **{f"lost_h_{name}": round(result["lost_h"], 1) for name, result in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--bad", type=int, default=8)
    parser.add_argument("--bad-mtbf-h", type=float, default=4.0, help="hours of use between a bad node's failures")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a crash policy key for this run (e.g. significance=0.05)")
    parser.add_argument("--job-hours", type=float, default=36.0, help="a job's mean run time, hours")
    parser.add_argument("--keep", type=float, default=0.5, help="chance a restarted job keeps each of its nodes")
    args = parser.parse_args()
    began = time.monotonic()
    seeds = [one_seed(seed, args) for seed in range(1, args.seeds + 1)]
    worst: list[float] = [w for s in seeds for w in s["worst_job_failures_before_removal"]]
    hours: list[float] = [h for s in seeds for h in s["hours_first_failure_to_trial"]]
    recall = statistics.mean(s["recall"] for s in seeds)
    precision = statistics.mean(s["precision"] for s in seeds)
    lost_fm, lost_oracle = (sum(s[f"lost_h_{name}"] for s in seeds) for name in ("fleetmedic", "oracle"))
    out = {
        "benchmark": "crash_attribution", "nodes": args.nodes, "jobs": args.jobs, "bad_nodes": args.bad,
        "bad_mtbf_h": args.bad_mtbf_h, "keep": args.keep, "job_hours": args.job_hours,
        "policy": crash_policy(args).model_dump(mode="json"),
        "recall": round(recall, 3), "precision": round(precision, 3),
        "healthy_to_burn_in": sum(s["healthy_to_burn_in"] for s in seeds),
        "worst_job_failures_before_removal_p50": percentile(worst, 50) if worst else None,
        "worst_job_failures_before_removal_max": max(worst) if worst else None,
        # By the size of the job that failed most on the node: the intersection of a large job's
        # allocations, which keep half their nodes at each restart, narrows one failure at a time.
        "worst_job_failures_before_removal_p50_by_job_size": {
            size: percentile(by_size, 50) for size in (2, 4, 8, 16, 32)
            if (by_size := [float(w) for s in seeds for w, z in zip(s["worst_job_failures_before_removal"],
                                                                    s["worst_job_sizes"], strict=True) if z == size])},
        "hours_first_failure_to_trial_p50": percentile(hours, 50) if hours else None,
        "hours_first_failure_to_trial_max": max(hours) if hours else None,
        **{f"ettr_{name}": round(statistics.mean(s[f"ettr_{name}"] for s in seeds), 5)
           for name in ("fleetmedic", "none", "oracle")},
        # The floor: an oracle that removes each bad node at its first failure, in the same runs.
        "lost_hours_vs_oracle": round(lost_fm / lost_oracle, 3) if lost_oracle else None,
        "seeds": seeds,
        "verdicts": {
            "recall_at_least_0_9": recall >= 0.9,
            "precision_at_least_0_9": precision >= 0.9,
            "bad_node_out_within_3_failures_of_a_job": bool(worst) and max(worst) <= 3,
        },
        "seconds": round(time.monotonic() - began, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
