"""Which node, if any, a run of training-job failures points at. Pure and deterministic: the
job-failures workflow calls it inside its workflow code, and bench/crash_attribution.py replays a
simulated week of failures through the same functions.

Krea's rule: restart the job; if it persists, replace the hardware. What "persists" means here:

- **A job that keeps landing on the node** (`crash.suspect_after`, 3): the node was in each of the
  job's last 3 (or more) failed allocations, the allocations otherwise varied (so the code ran fine
  on other nodes), and at most `crash.max_common_nodes` nodes were in all of them. More cannot be
  told apart yet: restarts go on, and each failure on a varied allocation narrows the common nodes
  (a 64-node job that keeps most of its nodes needs more failures than an 8-node one).
- **A node that fails several jobs**: it took part in failures of at least `crash.min_jobs`
  different jobs within `crash.window`, and far more of them than chance gives a node. Only
  failures are reported, never the allocations that went well, so the statistic compares each node
  with the fleet: if failures fell on nodes evenly, a node's count of failed allocations would be
  Poisson with mean λ = (node-failures in the window) / (nodes in the fleet). The node is a suspect
  when P(X ≥ its count) < `crash.significance` / nodes — a Bonferroni correction, because every
  node of the fleet is tested at once, and a fleet of 2,000 would otherwise send a healthy node to
  burn-in every few days by chance alone. Needing several different jobs keeps one job's own bug,
  which fails the same allocation again and again, from counting against its nodes.

What is not evidence: failures with a known cause (the job's own limit, a cancel or preemption, an
exit code or output line the policy calls the code's own, a hardware runbook already on one of its
nodes). When failures are spread over many jobs at once (`crash.widespread_jobs` within
`crash.widespread_window`) it reads as software (a bad push, a broken dataset): nobody is taken out.
A node sent to trial takes the failures it was part of with it: they count against no node after
(a trial that passes starts the node with a clean record; one that fails explained them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

from fleetmedic.durations import format_duration
from fleetmedic.job_failures import NOT_EVIDENCE_STATES, JobEnd
from fleetmedic.policy import CrashPolicy


class Failure(BaseModel):
    """One failed allocation of a job, as attribution keeps it."""

    model_config = ConfigDict(frozen=True)

    key: str
    job: str
    nodes: tuple[str, ...]
    at: datetime
    cause: str  # a bounded label: a policy pattern's name, node_fail, a Slurm state, or "exit"
    explained: str = ""  # why it is no evidence against a node ("" = it is evidence)
    line: str = ""  # the output line that named the cause

    @property
    def evidence(self) -> bool:
        return not self.explained


class Suspicion(BaseModel):
    model_config = ConfigDict(frozen=True)

    node: str
    rule: str  # "same-job" or "many-jobs"
    why: str


class Verdict(BaseModel):
    suspects: list[Suspicion] = []
    widespread: str = ""  # non-empty: software, nobody is taken out, and why
    notes: list[str] = []


def classify(end: JobEnd, policy: CrashPolicy, lines: Sequence[str], hardware: Mapping[str, str]) -> Failure:
    """The failure's cause and whether a known cause explains it. `lines`: the job's output lines
    (read by the worker, or posted); `hardware`: node → the hardware runbook that ran there lately."""
    cause, line = "", ""
    for text in lines:
        for name, pattern in policy.patterns.items():
            if re.search(pattern, text):
                cause, line = name, text
                break
        if cause:
            break
    explained = ""
    if end.state in NOT_EVIDENCE_STATES:
        explained, cause = NOT_EVIDENCE_STATES[end.state], cause or end.state.lower()
    elif end.exit_code is not None and end.exit_code in policy.application_exit_codes:
        explained = f"exit code {end.exit_code} is the job's own error (crash.application_exit_codes)"
    elif not cause and (app := _first_match(lines, policy.application_patterns)):
        explained, line = f"its output says the code failed ({app[0]}: {app[1][:120]})", app[1]
        cause = app[0]
    if not explained and (on := sorted(n for n in end.nodes if n in hardware)):
        explained = f"{hardware[on[0]]} ran on {on[0]}" + (f" (and {len(on) - 1} more)" if len(on) > 1 else "")
    if not cause:
        cause = "node_fail" if end.state == "NODE_FAIL" else "exit"
    return Failure(key=end.key, job=end.job, nodes=tuple(end.nodes), at=end.ended_at, cause=cause,
                   explained=explained, line=line[:300])


def _first_match(lines: Sequence[str], patterns: Mapping[str, str]) -> tuple[str, str] | None:
    for text in lines:
        for name, pattern in patterns.items():
            if re.search(pattern, text):
                return name, text
    return None


def assess(failures: Sequence[Failure], latest: Failure, policy: CrashPolicy, *, fleet_size: int,
           cleared: Mapping[str, datetime], now: datetime) -> Verdict:
    """Who the failures point at, after `latest` was recorded (it is in `failures`)."""
    verdict = Verdict()
    if not latest.evidence:
        verdict.notes.append(f"not evidence against its nodes: {latest.explained}")
        return verdict
    recent = [f for f in failures if f.evidence and f.at > now - policy.window]
    spread = _widespread(recent, policy, now)
    if spread:
        verdict.widespread = spread
        return verdict
    storms = _in_storms(recent, policy)
    # A failure whose allocation held a node sent to trial since is explained by that node (the
    # trial looks at it): it no longer counts against the nodes beside it either. Without this, a job
    # whose bad node was replaced pointed at whichever neighbour it kept.
    recent = [f for f in recent if f.key not in storms and not any(
        n in cleared and cleared[n] >= f.at for n in f.nodes)]
    # Each node's failures, indexed once: allocations run to thousands of nodes, and a scan of every
    # failure's node list for each node of the latest one grew with their product.
    by_node: dict[str, list[Failure]] = {}
    for failure in recent:
        for node in failure.nodes:
            by_node.setdefault(node, []).append(failure)
    seen: set[str] = set()
    for suspicion in [*_same_job(recent, by_node, latest, policy, verdict),
                      *_many_jobs(recent, by_node, latest, policy, fleet_size)]:
        if suspicion.node not in seen:
            seen.add(suspicion.node)
            verdict.suspects.append(suspicion)
    return verdict


def _widespread(recent: Sequence[Failure], policy: CrashPolicy, now: datetime) -> str:
    window = [f for f in recent if f.at > now - policy.widespread_window]
    jobs = {f.job for f in window}
    if len(jobs) < policy.widespread_jobs:
        return ""
    nodes = {n for f in window for n in f.nodes}
    return (f"widespread failures: {len(jobs)} jobs failed within {format_duration(policy.widespread_window)} on "
            f"{len(nodes)} nodes: looks like software (a code push, a dataset, a shared service), not a node; "
            "nobody is taken out")


def _same_job(recent: Sequence[Failure], by_node: Mapping[str, list[Failure]], latest: Failure,
              policy: CrashPolicy, verdict: Verdict) -> list[Suspicion]:
    """The nodes in each of the job's last k failed allocations, k from `suspect_after` up: a large
    job that keeps most of its nodes across restarts shares many with each failure, and each more
    failure that varied narrows them down to the one it keeps landing on."""
    history = sorted((f for f in recent if f.job == latest.job), key=lambda f: f.at)
    if len(history) < policy.suspect_after:
        return []
    common: set[str] = set()
    for k in range(policy.suspect_after, len(history) + 1):
        mine = history[-k:]
        common = set(mine[0].nodes).intersection(*(f.nodes for f in mine[1:]))
        union = set().union(*(f.nodes for f in mine))
        if not common:
            return []
        if common != union and len(common) <= policy.max_common_nodes:
            causes = ", ".join(sorted({_cause(f) for f in mine}))
            why = f"failed allocations of job {latest.job} ({causes}); the other {len(union - common)} node(s) varied"
            if len(common) == 1:
                [node] = common
                return [Suspicion(node=node, rule="same-job", why=f"{node} was in {k} of the last {k} {why}")]
            # Two or more in all of them: the one that also failed other jobs, when one alone did.
            others = {n: len({f.job for f in by_node.get(n, []) if f.job != latest.job}) for n in common}
            best = max(others.values())
            leaders = [n for n, count in others.items() if count == best]
            if best > 0 and len(leaders) == 1:
                node = leaders[0]
                return [Suspicion(node=node, rule="same-job", why=(
                    f"{node} was in {k} of the last {k} {why}, as were {', '.join(sorted(common - {node}))}, and "
                    f"{node} also failed {best} other job(s)"))]
    if len(common) > 1 and common != union and len(common) <= policy.max_common_nodes:
        verdict.notes.append(f"{', '.join(sorted(common))} were each in every failed allocation of job {latest.job}: "
                             "nothing else tells them apart yet")
    elif common == union:
        verdict.notes.append(f"job {latest.job} failed on the same {len(union)} node(s) {len(history)} times: the "
                             "code cannot be told from a node until an allocation differs")
    else:
        verdict.notes.append(f"{len(common)} nodes were in each of the last {len(history)} failed allocations of job "
                             f"{latest.job}: more than crash.max_common_nodes ({policy.max_common_nodes}) to tell "
                             "apart")
    return []


def _many_jobs(recent: Sequence[Failure], by_node: Mapping[str, list[Failure]], latest: Failure,
               policy: CrashPolicy, fleet_size: int) -> list[Suspicion]:
    """Each job counts once per node: a job that fails five times on one allocation (its own bug, or
    the bad node beside them) is one job against each of its nodes, not five."""
    nodes_in_fleet = max(fleet_size, len({n for f in recent for n in f.nodes}), 1)
    pairs: dict[str, set[str]] = {}  # job → the nodes of its failed allocations
    for failure in recent:
        pairs.setdefault(failure.job, set()).update(failure.nodes)
    mean = sum(len(nodes) for nodes in pairs.values()) / nodes_in_fleet
    threshold = policy.significance / nodes_in_fleet
    found = []
    for node in latest.nodes:
        mine = by_node.get(node, [])
        jobs = {f.job for f in mine}
        if len(jobs) < policy.min_jobs:
            continue
        tail = poisson_tail(len(jobs), mean)
        if tail >= threshold:
            continue
        causes = ", ".join(sorted({_cause(f) for f in mine}))
        found.append(Suspicion(node=node, rule="many-jobs", why=(
            f"{node} was in failed allocations of {len(jobs)} different jobs within {format_duration(policy.window)} "
            f"({causes}); chance gives a node {mean:.2f} (P = {tail:.1e}, below {policy.significance:g} / "
            f"{nodes_in_fleet} nodes)")))
    return found


def _in_storms(recent: Sequence[Failure], policy: CrashPolicy) -> set[str]:
    """Keys of failures inside a widespread episode (`crash.widespread_jobs` jobs failing within
    `crash.widespread_window`): software, so no evidence against any node, then or later."""
    ordered = sorted(recent, key=lambda f: f.at)
    storm: set[str] = set()
    jobs: dict[str, int] = {}
    start = 0
    for end, failure in enumerate(ordered):
        jobs[failure.job] = jobs.get(failure.job, 0) + 1
        while ordered[start].at <= failure.at - policy.widespread_window:
            gone = ordered[start].job
            jobs[gone] -= 1
            if not jobs[gone]:
                del jobs[gone]
            start += 1
        if len(jobs) >= policy.widespread_jobs:
            storm.update(f.key for f in ordered[start:end + 1])
    return storm


def poisson_tail(count: int, mean: float) -> float:
    """P(X ≥ count) for X ~ Poisson(mean)."""
    if count <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    term = math.exp(-mean)
    below = term
    for k in range(1, count):
        term *= mean / k
        below += term
    return max(0.0, 1.0 - below) if below < 0.999999 else _upper_sum(count, mean)


def _upper_sum(count: int, mean: float) -> float:
    # 1 - Σ below loses every digit when the tail is tiny: sum the tail itself (it shrinks fast).
    term = math.exp(-mean + count * math.log(mean) - math.lgamma(count + 1))
    total, k = 0.0, count
    while term > 1e-300 and k < count + 1000:
        total += term
        k += 1
        term *= mean / k
    return total


def _cause(failure: Failure) -> str:
    return {"nccl": "NCCL timeout", "cuda": "CUDA error", "ecc": "ECC error", "node_fail": "NODE_FAIL",
            "exit": "non-zero exit"}.get(failure.cause, failure.cause)


def trials_within(started: Iterable[datetime], now: datetime, span: timedelta = timedelta(hours=1)) -> int:
    return sum(1 for at in started if at > now - span)
