"""Slurm activities against a real Slurm 22.05 (Debian's packages), CLI and slurmrestd reads."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.jobs import JobActivities
from activities.shared_reads import SharedReads
from activities.slurm import SlurmActivities, SlurmCli, SlurmRest, by_id
from devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from fleetmedic.models import ActionResult, RequeueJob, SetSlurmNodeState, SlurmNode, SlurmNodeState
from tests.conftest import require
from tests.harness import job_on
from tests.harness import run_activity as run

SLEEPER = "#!/bin/bash\nwhile true; do sleep 0.2; done\n"
REASON = "fleetmedic: XID 79 on GPU 3 (xid-recovery/test/gpu-node-0)"



@pytest.fixture
def slurm_acts(slurm: LocalSlurmCluster) -> SlurmActivities:
    return SlurmActivities(SlurmCli(str(slurm.conf), timeout_s=10))


def test_down_with_reason_is_idempotent_and_resume_clears_it(slurm: LocalSlurmCluster,
                                                             slurm_acts: SlurmActivities) -> None:
    down = SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.DOWN, reason=REASON)
    assert run(slurm_acts.set_node_state, down).changed
    assert slurm.node_state("gpu-node-0") == ("down", REASON)
    assert not run(slurm_acts.set_node_state, down).changed  # already so
    node = run(slurm_acts.get_node, "gpu-node-0")
    assert node.out_of_service and node.reason == REASON
    assert run(slurm_acts.set_node_state, SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.RESUME)).changed
    assert slurm.node_state("gpu-node-0")[0].rstrip("*") == "idle"  # "*": not pinged since it was DOWN
    assert not run(slurm_acts.set_node_state,
                   SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.RESUME)).changed


def test_drain(slurm: LocalSlurmCluster, slurm_acts: SlurmActivities) -> None:
    drain = SetSlurmNodeState(node="gpu-node-1", state=SlurmNodeState.DRAIN, reason="fleetmedic: hot GPU 2")
    assert run(slurm_acts.set_node_state, drain).changed
    assert slurm.node_state("gpu-node-1")[0] in ("drain", "drng")


def test_reasons_fleetmedic_does_not_own_are_left_alone(slurm: LocalSlurmCluster,
                                                       slurm_acts: SlurmActivities) -> None:
    slurm.run("scontrol", "update", "nodename=gpu-node-2", "state=DRAIN", "reason=slurm-operator: pod deleted")
    with pytest.raises(ApplicationError) as down:
        run(slurm_acts.set_node_state, SetSlurmNodeState(node="gpu-node-2", state=SlurmNodeState.DOWN, reason=REASON))
    assert down.value.type == "NotOwned" and down.value.non_retryable
    with pytest.raises(ApplicationError) as resume:
        run(slurm_acts.set_node_state, SetSlurmNodeState(node="gpu-node-2", state=SlurmNodeState.RESUME))
    assert resume.value.type == "NotOwned"
    assert slurm.node_state("gpu-node-2")[1] == "slurm-operator: pod deleted"


def test_a_reason_must_be_ours(slurm_acts: SlurmActivities) -> None:
    with pytest.raises(ApplicationError) as err:
        run(slurm_acts.set_node_state, SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.DOWN, reason="x"))
    assert err.value.type == "Invalid"


def test_unknown_node_and_job_are_not_found(slurm_acts: SlurmActivities) -> None:
    for fn, arg in ((slurm_acts.get_node, "nope"), (slurm_acts.get_job, 424242)):
        with pytest.raises(ApplicationError) as err:
            run(fn, arg)
        assert err.value.type == "NotFound" and err.value.non_retryable


def test_jobs_on_node_and_requeue(slurm: LocalSlurmCluster, slurm_acts: SlurmActivities) -> None:
    job = slurm.submit(SLEEPER)
    node = job_on(slurm, job)
    jobs = run(slurm_acts.jobs_on_node, node)
    assert [j.job_id for j in jobs] == [job] and jobs[0].state == "RUNNING" and jobs[0].requeue
    assert run(slurm_acts.jobs_on_node, "gpu-node-2" if node != "gpu-node-2" else "gpu-node-1") == []
    assert run(slurm_acts.requeue_job, RequeueJob(job_id=job)).changed
    again = run(slurm_acts.requeue_job, RequeueJob(job_id=job))
    assert not again.changed and "already" in again.detail
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        current = run(slurm_acts.get_job, job)
        if current.state == "RUNNING" and current.restart_count == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"job {job} did not run again: {current}")
    # The runbook's requeue names the bad node: a job that already runs again elsewhere is not killed again.
    elsewhere = next(n for n in slurm.nodes if n not in current.nodes)
    late = run(slurm_acts.requeue_job, RequeueJob(job_id=job, node=elsewhere))
    assert not late.changed and "left alone" in late.detail
    assert run(slurm_acts.get_job, job).restart_count == 1


def test_dry_run_changes_nothing(slurm: LocalSlurmCluster, slurm_acts: SlurmActivities) -> None:
    job = slurm.submit(SLEEPER)
    job_on(slurm, job)
    result = run(slurm_acts.set_node_state, SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.DOWN,
                                                              reason=REASON, dry_run=True))
    assert result.dry_run and result.summary.startswith("would set DOWN")
    assert run(slurm_acts.requeue_job, RequeueJob(job_id=job, dry_run=True)).dry_run
    assert slurm.node_state("gpu-node-0")[0] != "down"
    assert run(slurm_acts.get_job, job).restart_count == 0


class HeldReads:
    """Spies on the commands the activities run (the real slurmctld answers them) and holds the first
    `held` command, after it has run, until `release`: the reads asked meanwhile queue behind it."""

    def __init__(self, cli: SlurmCli, held: tuple[str, ...]) -> None:
        self.commands: list[tuple[str, ...]] = []
        self.stdins: list[str | None] = []  # what each command read on its stdin
        self.read_done = threading.Event()
        self.release = threading.Event()
        real = cli._run

        def spy(argv: Sequence[str], stdin: str | None = None,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            self.commands.append(tuple(argv))
            self.stdins.append(stdin)
            done = real(argv, stdin, env)
            if tuple(argv[:len(held)]) == held and not self.read_done.is_set():
                self.read_done.set()
                self.release.wait(30)
            return done

        cli._run = spy  # type: ignore[method-assign]

    def runs_of(self, *command: str) -> list[tuple[str, ...]]:
        return [argv for argv in self.commands if argv[:len(command)] == command]


def behind_held_read(spy: HeldReads, shared: SharedReads[Any, Any], calls: list[Callable[[], Any]],
                     first: Callable[[], Any], between: Callable[[], None] = lambda: None) -> tuple[Any, list[Any]]:
    """`first` runs and its read is held; `between` runs; then `calls`, each on its own thread, queue
    behind it; once they all do, the read is released. Each call's answer, or the error it raised."""
    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ApplicationError as exc:
            return exc
    with ThreadPoolExecutor(len(calls) + 1) as pool:
        held = pool.submit(first)
        assert spy.read_done.wait(20)
        between()
        futures = [pool.submit(outcome, call) for call in calls]
        deadline = time.monotonic() + 20
        while shared.queued() < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.queued() == len(calls), "the calls never queued behind the held read"
        spy.release.set()
        return held.result(), [f.result() for f in futures]


def test_runs_asking_at_once_share_one_read_each_read_after_they_asked(slurm: LocalSlurmCluster) -> None:
    """50 nodes failing together must not queue 100 reads on slurmctld (one request at a time), and
    no run may act on a read taken before it asked: a DRAIN written while a read was in flight is
    seen by every caller who asked after it."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    spy = HeldReads(cli, ("sinfo",))  # a node alone: sinfo; the 20 after it, together: one scontrol
    asked = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "no-such-node"] * 5
    first, answers = behind_held_read(
        spy, acts.shared_nodes, [lambda n=n: acts.get_node(n) for n in asked], lambda: acts.get_node("gpu-node-1"),
        lambda: slurm.run("scontrol", "update", "nodename=gpu-node-1", "state=DRAIN", f"reason={REASON}"))
    assert first.state == "idle" and not first.reason  # read before the DRAIN, as it asked before it
    assert [argv[4] for argv in spy.runs_of("sinfo")] == ["--nodes=gpu-node-1"]  # two reads for 21 callers
    assert [argv[4] for argv in spy.runs_of("scontrol", "show", "node")] == [
        "gpu-node-0,gpu-node-1,gpu-node-2,no-such-node"]
    for name, answer in zip(asked, answers, strict=True):
        if name == "no-such-node":  # unknown to Slurm: that caller's NotFound, the others' nodes
            assert isinstance(answer, ApplicationError) and answer.type == "NotFound"
        else:
            assert isinstance(answer, SlurmNode) and answer.name == name
            assert (answer.reason == REASON) is (name == "gpu-node-1")  # the DRAIN, read after they asked


def test_node_updates_asked_at_once_go_through_one_scontrol(slurm: LocalSlurmCluster) -> None:
    """A storm's DRAINs: the callers who asked while an update ran share one `scontrol` reading their
    updates from its stdin (a process each costs more than slurmctld's answer), each with its own
    reason exactly as asked; a lone caller runs `scontrol update` as before."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    spy = HeldReads(cli, ("scontrol", "update"))
    reasons = {n: f"fleetmedic: XID 79 on GPU 3 (xid-recovery/test/{n})" for n in ("gpu-node-1", "gpu-node-2")}

    def drain(node: str, reason: str) -> ActionResult:
        return acts.set_state(SetSlurmNodeState(node=node, state=SlurmNodeState.DRAIN, reason=reason),
                              SlurmNode(name=node, state="idle"))

    first, answers = behind_held_read(spy, acts.shared_updates, [lambda n=n: drain(n, reasons[n]) for n in reasons],
                                      lambda: drain("gpu-node-0", REASON))
    assert first.changed and all(isinstance(a, ActionResult) and a.changed for a in answers), answers
    assert spy.commands == [("scontrol", "update", "nodename=gpu-node-0", "state=DRAIN", f"reason={REASON}"),
                            ("scontrol",)]  # the held one alone, then one process for the two asking meanwhile
    assert spy.stdins[1] is not None and spy.stdins[1].count("update nodename=") == 2
    for node, reason in {"gpu-node-0": REASON, **reasons}.items():  # as slurmctld has them
        assert slurm.node_states(node) >= {"DRAIN"} and slurm.node_state(node)[1] == reason


def test_a_failed_update_among_others_fails_only_its_caller(slurm: LocalSlurmCluster) -> None:
    """Any failure in a shared scontrol and each update is done on its own: the others succeed, the
    bad one gets its own error. A reason scontrol's line parser cannot quote never shares one."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    spy = HeldReads(cli, ("never",))
    quoted = 'fleetmedic: "quoted" = kept as is'
    updates = [("gpu-node-1", "DRAIN", REASON), ("no-such-node", "DRAIN", REASON), ("gpu-node-2", "DRAIN", quoted),
               ("gpu-node-0", "DOWN", REASON)]
    errors = cli.update_nodes(updates)
    assert list(errors) == [("no-such-node", "DRAIN", REASON)]
    assert isinstance(errors[updates[1]], ApplicationError) and errors[updates[1]].type == "NotFound"
    assert spy.commands[0] == ("scontrol",) and spy.stdins[0] is not None and quoted not in spy.stdins[0]
    assert sorted(argv[2] for argv in spy.commands[1:]) == [  # each again on its own, the quoted one too
        "nodename=gpu-node-0", "nodename=gpu-node-1", "nodename=gpu-node-2", "nodename=no-such-node"]
    assert slurm.node_state("gpu-node-2")[1] == quoted and slurm.node_state("gpu-node-1")[1] == REASON
    assert "DOWN" in slurm.node_states("gpu-node-0")


def test_a_job_on_several_nodes_is_on_each_of_them(slurm: LocalSlurmCluster) -> None:
    """A training job spans nodes, which Slurm names by a hostlist expression (`gpu-node-[1-2]`): the
    job is on each of them, so a bad node's runbook finds it there and its requeue is not skipped
    as "runs elsewhere". And reading the jobs starts no `scontrol` per job to expand its hostlist:
    squeue --json names each node already, and a fleet has thousands of multi-node jobs."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    job = slurm.submit(SLEEPER, "-N", "2", "-w", "gpu-node-1,gpu-node-2")
    assert job_on(slurm, job) == "gpu-node-[1-2]"
    spy = HeldReads(cli, ("none held",))
    for node in ("gpu-node-1", "gpu-node-2"):
        jobs = run(acts.jobs_on_node, node)
        assert [(j.job_id, j.nodes) for j in jobs] == [(job, ["gpu-node-1", "gpu-node-2"])]
    assert run(acts.jobs_on_node, "gpu-node-0") == []
    assert run(acts.get_job, job).nodes == ["gpu-node-1", "gpu-node-2"]
    assert spy.runs_of("squeue") and not spy.runs_of("scontrol", "show", "hostnames")
    requeued = run(acts.requeue_job, RequeueJob(job_id=job, node="gpu-node-2"))
    assert requeued.changed, requeued.detail
    assert "Restarts=1" in slurm.run("scontrol", "show", "job", "-o", str(job)).stdout


class JobList:
    """A job list as read (squeue --json's `jobs`), for the reads that lack Slurm's own list of a
    job's nodes (`job_resources.allocated_nodes`): no running job here lacks it."""

    def __init__(self, jobs: list[dict[str, Any]]) -> None:
        self.listed = jobs

    def nodes(self, names: Any) -> dict[str, SlurmNode]:
        return {}

    def active_jobs(self) -> list[dict[str, Any]]:
        return self.listed

    def jobs_by_id(self, ids: Collection[int]) -> dict[int, dict[str, Any]]:
        return by_id(self.listed, ids)


def test_a_hostlist_is_expanded_as_slurm_does(slurm: LocalSlurmCluster) -> None:
    """A job read without its nodes by name: its hostlist is expanded here as Slurm's own
    `scontrol show hostnames` does, and by scontrol itself for a form the worker does not read
    (two bracket groups), once per expression."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    forms = {"gpu-node-[1-2]": "gpu-node-2", "n[008-011],cpu1": "n010", "r[1-2]n[1-2]": "r2n1"}
    acts = SlurmActivities(cli, JobList([{"job_id": i, "job_state": "RUNNING", "nodes": expression}
                                         for i, expression in enumerate(forms)]))
    spy = HeldReads(cli, ("none held",))
    for i, (expression, node) in enumerate(forms.items()):
        assert acts._expand([expression]) == slurm.run("scontrol", "show", "hostnames", expression).stdout.split()
        assert [j.job_id for j in run(acts.jobs_on_node, node)] == [i]
        assert [j.job_id for j in run(acts.jobs_on_node, node)] == [i]  # the expression is known now
    assert spy.runs_of("scontrol", "show", "hostnames") == [("scontrol", "show", "hostnames", "r[1-2]n[1-2]")]


def test_jobs_are_read_once_for_the_runs_asking_together(slurm: LocalSlurmCluster) -> None:
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    job = slurm.submit(SLEEPER, "-w", "gpu-node-2")
    assert job_on(slurm, job) == "gpu-node-2"
    spy = HeldReads(cli, ("squeue",))
    asked = ["gpu-node-0", "gpu-node-1", "gpu-node-2"] * 4
    first, answers = behind_held_read(spy, acts.shared_jobs, [lambda n=n: acts.jobs_on_node(n) for n in asked],
                                      lambda: acts.jobs_on_node("gpu-node-2"))
    assert [j.job_id for j in first] == [job]
    assert len(spy.runs_of("squeue")) == 2  # the held read, and one for the 12 that asked meanwhile
    for name, jobs in zip(asked, answers, strict=True):
        assert [j.job_id for j in jobs] == ([job] if name == "gpu-node-2" else [])


def test_jobs_asked_by_id_at_once_are_read_together(slurm: LocalSlurmCluster) -> None:
    """A runbook's grace reads each of its node's jobs by ID, again and again: one job alone is
    squeue's read of that job (slurmctld sends it alone), the jobs asked meanwhile one read for them
    all; a job Slurm no longer has is NotFound, beside the others."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    jobs = [slurm.submit(SLEEPER, "--hold") for _ in range(3)]
    spy = HeldReads(cli, ("squeue",))
    asked = [*jobs, 424242] * 4
    first, answers = behind_held_read(spy, acts.shared_job_ids, [lambda j=j: acts.get_job(j) for j in asked],
                                      lambda: acts.get_job(jobs[0]))
    assert first.job_id == jobs[0]
    for job, answer in zip(asked, answers, strict=True):
        assert answer.type == "NotFound" if job == 424242 else answer.job_id == job
    assert [argv[4] for argv in spy.runs_of("squeue")] == [
        f"--jobs={jobs[0]}", "--jobs=" + ",".join(map(str, sorted([*jobs, 424242])))]


def as_decided(node: SlurmNode) -> tuple[object, ...]:
    """What FleetMedic decides on. A partly used node is "allocated" to sinfo and slurmrestd 0.0.38
    and "mixed" to scontrol: busy either way, neither out of service."""
    return (node.name, node.out_of_service, sorted(node.flags), node.reason,
            "busy" if node.state in ("mixed", "allocated") else node.state)


def test_a_node_alone_is_read_through_sinfo_as_scontrol_reads_it(slurm: LocalSlurmCluster) -> None:
    """One node is read through sinfo, which asks slurmctld for that node alone (3 ms of CPU with
    8,000 nodes, where scontrol loads all of them: 15 ms). It is the node scontrol reads, busy and
    DRAINed, DOWN, not responding and DRAINed, each with its reason; a reason sinfo's text cannot
    carry (the separator) is read by scontrol. Several nodes asked together: one scontrol."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    acts = SlurmActivities(cli)
    assert job_on(slurm, slurm.submit(SLEEPER, "-w", "gpu-node-0")) == "gpu-node-0"
    slurm.run("scontrol", "update", "nodename=gpu-node-0", "state=DRAIN", "reason=fleetmedic: x | y")
    slurm.run("scontrol", "update", "nodename=gpu-node-1", "state=DOWN", "reason=dead  ")
    slurm.stop_slurmd("gpu-node-2")
    slurm.run("scontrol", "update", "nodename=gpu-node-2", "state=DRAIN", "reason=gone")
    deadline = time.monotonic() + 120  # SlurmdTimeout (30 s) and the next ping
    while "NOT_RESPONDING" not in cli.run("scontrol", "show", "node", "-o", "gpu-node-2"):
        assert time.monotonic() < deadline, "gpu-node-2's slurmd stopped and it still responds"
        time.sleep(1)
    spy = HeldReads(cli, ("none held",))
    alone = {name: run(acts.get_node, name) for name in slurm.nodes}
    assert [argv[0] for argv in spy.commands] == ["sinfo"] * 3
    together = cli.nodes(slurm.nodes)
    assert spy.runs_of("scontrol") == [("scontrol", "show", "node", "-o", "gpu-node-0,gpu-node-1,gpu-node-2")]
    assert [as_decided(alone[n]) for n in slurm.nodes] == [as_decided(together[n]) for n in slurm.nodes] == [
        ("gpu-node-0", True, ["DRAIN"], "fleetmedic: x | y", "busy"), ("gpu-node-1", True, [], "dead", "down"),
        ("gpu-node-2", True, ["DRAIN", "NOT_RESPONDING"], "gone", "idle")]
    slurm.run("scontrol", "update", "nodename=gpu-node-1", "reason=dead\x1fagain")
    assert run(acts.get_node, "gpu-node-1").reason == "dead\x1fagain"
    assert [argv[0] for argv in spy.commands[-2:]] == ["sinfo", "scontrol"]


class JsonJobs:
    """The jobs as `squeue --json` gives them, every job, the read squeue's text stands in for (nodes
    as the CLI reads them)."""

    def __init__(self, cli: SlurmCli) -> None:
        self.cli = cli

    def nodes(self, names: Any) -> dict[str, SlurmNode]:
        return self.cli.nodes(names)

    def active_jobs(self) -> list[dict[str, Any]]:
        return list(self.cli._json("squeue", "--json").get("jobs", []))

    def jobs_by_id(self, ids: Collection[int]) -> dict[int, dict[str, Any]]:
        return by_id(self.active_jobs(), ids)


def until_state(slurm: LocalSlurmCluster, job: int, state: str) -> None:
    deadline = time.monotonic() + 30
    while f"JobState={state}" not in (shown := slurm.run("scontrol", "show", "job", "-o", str(job)).stdout):
        assert time.monotonic() < deadline, f"job {job} never {state}: {shown}"
        time.sleep(0.2)


def test_jobs_read_from_squeues_text_are_the_jobs_of_its_json(slurm: LocalSlurmCluster, tmp_path: Path) -> None:
    """The jobs are read from squeue's text, not its --json (every field of every job: 6 MB and 260 ms
    of CPU a read with 2,000 jobs, against 100 KB and 16 ms): a node's jobs from the jobs that hold
    nodes, printed alone; a job by its ID alone. Each job FleetMedic reads is the same from both:
    one that ended, one requeued, one held, one on two nodes (each by name), and one whose name and
    directory hold spaces, `|` and non-ASCII. A name the text cannot be split around (a line break)
    sends the reads that print it to JSON, counted, and the jobs are the same still."""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    from_text, from_json = SlurmActivities(cli), SlurmActivities(cli, JsonJobs(cli))
    ended = slurm.submit("#!/bin/bash\nexit 3\n")
    until_state(slurm, ended, "FAILED")
    odd = tmp_path / "runs | 70B" / ("ü" * 40)
    odd.mkdir(parents=True)
    one = slurm.submit(SLEEPER, "-J", "train | llama 70B ✓", "-D", str(odd), "-w", "gpu-node-0")
    two = slurm.submit(SLEEPER, "-N", "2", "-w", "gpu-node-[1-2]")
    assert job_on(slurm, one) == "gpu-node-0" and job_on(slurm, two) == "gpu-node-[1-2]"
    held = slurm.submit(SLEEPER, "--hold")
    run(from_text.requeue_job, RequeueJob(job_id=one))
    until_state(slurm, one, "PENDING")
    slurm.run("scontrol", "hold", str(one))  # it stays as it is between the two reads
    ids = (ended, one, two, held)
    spy = HeldReads(cli, ("none held",))

    def read(acts: SlurmActivities) -> list[object]:
        return [run(acts.get_job, job) for job in ids] + [run(acts.jobs_on_node, n) for n in slurm.nodes]

    as_text = read(from_text)
    assert as_text == read(from_json)
    jobs = {job.job_id: job for job in as_text[:len(ids)]}  # type: ignore[attr-defined]
    assert (jobs[ended].state, jobs[held].state, jobs[one].restart_count) == ("FAILED", "PENDING", 1)
    assert (jobs[one].name, jobs[one].work_dir) == ("train | llama 70B ✓", str(odd))
    assert jobs[two].nodes == ["gpu-node-1", "gpu-node-2"] and jobs[two].state == "RUNNING"
    texts = [argv for argv in spy.runs_of("squeue") if "--json" not in argv]
    assert [argv[3:-1] for argv in texts] == [("--states=all", f"--jobs={job}") for job in ids] + [
        ("--states=RUNNING,COMPLETING,CONFIGURING,SUSPENDED",)] * 3
    assert cli.jobs_read_as_json == 0
    broken = slurm.submit(SLEEPER, "-J", "line\nbreak", "-w", "gpu-node-0")
    assert job_on(slurm, broken) == "gpu-node-0"
    assert read(from_text) == read(from_json)
    assert cli.jobs_read_as_json == 3  # each node's read printed it, then read JSON; the jobs by ID did not
    assert run(from_text.get_job, broken).name == "line\nbreak" and cli.jobs_read_as_json == 4


class JsonEnds(SlurmCli):
    """The ended jobs as the reconciliation read them before squeue's text: every job of `squeue --json`."""

    def ended_jobs(self) -> list[dict[str, Any]]:
        return list(self._json("squeue", "--json", "--states=all").get("jobs", []))


def test_ended_jobs_read_from_squeues_text_are_those_of_its_json(slurm: LocalSlurmCluster) -> None:
    """The job-failures runbook's reconciliation reads the jobs that ended from squeue's text of
    those jobs alone, not --json (every field of every job: 25 MB and 1 s of CPU with 8,000). Each
    end is the one --json gives: exit 3 (wait status 768), killed by SIGKILL, completed on two
    nodes, cancelled running and cancelled held, each with its times; running and held jobs are no
    end. The times are the epoch's seconds whatever the worker's zone or SLURM_TIME_FORMAT; a name
    the text cannot carry (a line break) sends the read to JSON, counted, with the same ends. (A job
    cancelled before it ran ended on no node: no end, either way.)"""
    cli = SlurmCli(str(slurm.conf), timeout_s=10)
    cli.env.update(TZ="America/St_Johns", SLURM_TIME_FORMAT="relative")  # UTC-3:30, and "Ystday 17:05"
    as_json = JsonEnds(str(slurm.conf), timeout_s=10)
    from_text, from_json = JobActivities(SlurmActivities(cli)), JobActivities(SlurmActivities(as_json))
    failed = slurm.submit("#!/bin/bash\nexit 3\n", "-w", "gpu-node-0")
    killed = slurm.submit("#!/bin/bash\nkill -9 $$\n", "-w", "gpu-node-0")
    done = slurm.submit("#!/bin/bash\ntrue\n", "-N", "2", "-w", "gpu-node-[1-2]", "-J", "train | llama 70B ✓")
    running, _ = slurm.submit(SLEEPER, "-w", "gpu-node-2"), slurm.submit(SLEEPER, "--hold")
    cancelled, cancelled_held = slurm.submit(SLEEPER, "-w", "gpu-node-1"), slurm.submit(SLEEPER, "--hold")
    assert job_on(slurm, cancelled) == "gpu-node-1" and job_on(slurm, running) == "gpu-node-2"
    time.sleep(1.1)  # its end a second after its start, at least: the times are Slurm's seconds
    slurm.run("scancel", str(cancelled), str(cancelled_held))
    for job, state in ((failed, "FAILED"), (killed, "FAILED"), (done, "COMPLETED"), (cancelled, "CANCELLED")):
        until_state(slurm, job, state)
    spy = HeldReads(cli, ("none held",))
    since = datetime(2000, 1, 1, tzinfo=UTC)
    ends = run(from_text.ended_jobs, since)
    by_id = {int(end.job): end for end in ends}
    assert by_id == {int(end.job): end for end in run(from_json.ended_jobs, since)}  # each end, in any order
    # Running and held jobs have not ended; one cancelled before it ran ended on no node: nothing to count.
    assert sorted(by_id) == sorted((failed, killed, done, cancelled))
    assert [(by_id[j].state, by_id[j].exit_code) for j in (failed, killed, done, cancelled)] == [
        ("FAILED", 3), ("FAILED", -9), ("COMPLETED", 0), ("CANCELLED", -15)]
    assert by_id[done].nodes == ["gpu-node-1", "gpu-node-2"] and by_id[done].name == "train | llama 70B ✓"
    now = datetime.now(UTC)
    assert all(now - timedelta(minutes=2) < end.ended_at <= now for end in ends)
    assert by_id[cancelled].started_at is not None and by_id[cancelled].started_at < by_id[cancelled].ended_at
    [read] = spy.runs_of("squeue")
    assert "--json" not in read and cli.jobs_read_as_json == 0
    assert run(from_text.ended_jobs, max(end.ended_at for end in ends)) == []
    broken = slurm.submit(SLEEPER, "--hold", "-J", "line\nbreak")
    slurm.run("scancel", str(broken))
    until_state(slurm, broken, "CANCELLED")
    again = {int(end.job): end for end in run(from_text.ended_jobs, since)}
    assert again == {int(end.job): end for end in run(from_json.ended_jobs, since)} and cli.jobs_read_as_json == 1
    assert set(again) == set(by_id)  # and the job that broke the text, cancelled before it ran, is none


def test_controller_down_is_retryable_and_back_works(slurm: LocalSlurmCluster, slurm_acts: SlurmActivities) -> None:
    ctld = slurm.procs["slurmctld"]
    ctld.kill()
    ctld.wait()
    slow = SlurmActivities(SlurmCli(str(slurm.conf), timeout_s=3))
    # squeue/sinfo --json give up after about 9 s and exit 0 with an `errors` list: an error, not
    # "no jobs" (no grace, drain at once) or "no such node". A timeout long enough to see it:
    patient = SlurmActivities(SlurmCli(str(slurm.conf), timeout_s=30))
    for read, arg in ((patient.jobs_on_node, "gpu-node-0"), (patient.get_node, "gpu-node-0")):
        with pytest.raises(ApplicationError) as unreadable:
            run(read, arg)
        assert unreadable.value.type == "Unavailable" and not unreadable.value.non_retryable
        # the CLI's own error (squeue's text read of the jobs, scontrol's of the node), or the
        # `errors` list of squeue --json (the jobs' read when the text cannot give them)
        assert "--json" in str(unreadable.value) or "Unable to contact slurm controller" in str(unreadable.value)
    with pytest.raises(ApplicationError) as err:
        run(slow.set_node_state, SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.DOWN, reason=REASON))
    assert err.value.type in ("Unavailable", "Timeout") and not err.value.non_retryable
    slurm._spawn("slurmctld", ["slurmctld", "-D", "-f", str(slurm.conf)])  # state recovered from StateSaveLocation
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            assert run(slow.set_node_state, SetSlurmNodeState(node="gpu-node-0", state=SlurmNodeState.DOWN,
                                                              reason=REASON)).changed
            break
        except ApplicationError:
            time.sleep(0.5)
    assert slurm.node_state("gpu-node-0")[0] == "down"


@pytest.fixture
def rest_slurm() -> Iterator[LocalSlurmCluster]:
    missing = missing_binaries(with_rest=True)
    require(not missing, f"Debian's slurmrestd ({', '.join(missing)})")
    # slurmrestd runs as nobody: its own temp dir under /tmp, not pytest's private tmp_path.
    with LocalSlurmCluster(("gpu-node-0", "gpu-node-1"), with_rest=True) as cluster:
        yield cluster


def test_reads_through_slurmrestd_match_the_cli(rest_slurm: LocalSlurmCluster) -> None:
    cli = SlurmCli(str(rest_slurm.conf), timeout_s=10)
    rest = SlurmActivities(cli, SlurmRest(rest_slurm.rest_url, rest_slurm.token(), "root", timeout_s=10))
    job = rest_slurm.submit(SLEEPER)
    node = job_on(rest_slurm, job)
    both = rest_slurm.submit(SLEEPER, "-N", "2")  # on gpu-node-[0-1]: each node named by Slurm, in both
    assert job_on(rest_slurm, both) == "gpu-node-[0-1]"
    run(rest.set_node_state, SetSlurmNodeState(node="gpu-node-1" if node == "gpu-node-0" else "gpu-node-0",
                                               state=SlurmNodeState.DRAIN, reason="fleetmedic: test"))
    via_cli = SlurmActivities(cli)
    for name in rest_slurm.nodes:
        on_node = run(rest.jobs_on_node, name)
        assert on_node == run(via_cli.jobs_on_node, name)
        assert [(j.job_id, j.nodes) for j in on_node if j.job_id == both] == [(both, ["gpu-node-0", "gpu-node-1"])]
    assert {j.job_id for j in run(rest.jobs_on_node, node)} == {job, both}
    for name in rest_slurm.nodes:
        assert as_decided(run(rest.get_node, name)) == as_decided(run(via_cli.get_node, name))
    bad = SlurmActivities(cli, SlurmRest(rest_slurm.rest_url, "not-a-jwt", "root", timeout_s=5))
    with pytest.raises(ApplicationError) as err:
        run(bad.get_node, node)
    assert err.value.type in ("Forbidden", "Unavailable")


def test_a_cluster_whose_port_is_taken_before_it_binds_starts_on_another(tmp_path: Any) -> None:
    """The test clusters choose their ports before the daemons bind them; another server on the
    machine taking one in between must not fail a CI run (it once did, at slurmctld's bind)."""
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    cluster = LocalSlurmCluster(("gpu-node-0",), workdir=workdir)
    taken = cluster.ctld_port
    with socket.socket() as other:
        other.bind(("127.0.0.1", taken))
        other.listen()
        with cluster:
            assert cluster.ctld_port != taken
            assert f"SlurmctldPort={cluster.ctld_port}" in cluster.conf.read_text()
            assert cluster.node_state("gpu-node-0")[0] == "idle"
            log = (workdir / "log" / "slurmctld.out").read_text(errors="replace")
    assert "Address already in use" not in log  # the daemons of the first try were replaced


def test_a_fleet_of_silent_nodes_is_written_as_ranges_and_slurm_has_every_one(tmp_path: Path) -> None:
    """The benchmarks' fleets (bench/world.py): node lines as hostlist ranges, as sites write them,
    so that a Slurm command starting up does not parse a line per node; slurmctld still has each
    node under its own name, and FleetMedic drains one of them as any other."""
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    names = [f"gpu-f-{i}" for i in range(200)] + [f"gpu-e-{i}" for i in (3, 4, 9)] + ["gpu-007", "login"]
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    with LocalSlurmCluster([], silent_nodes=names, workdir=workdir) as cluster:
        lines = [line for line in cluster.conf.read_text().splitlines() if line.startswith("NodeName=")]
        assert [line.split()[0] for line in lines] == ["NodeName=gpu-f-[0-199]", "NodeName=gpu-e-[3-4,9]",
                                                       "NodeName=gpu-007", "NodeName=login"]
        listed = cluster.run("scontrol", "show", "node", "-o").stdout
        assert sorted(re.findall(r"^NodeName=(\S+)", listed, re.M)) == sorted(names)
        acts = SlurmActivities(SlurmCli(str(cluster.conf), timeout_s=10))
        assert run(acts.set_node_state, SetSlurmNodeState(node="gpu-e-9", state=SlurmNodeState.DRAIN,
                                                          reason=REASON)).changed
        assert cluster.node_state("gpu-e-9")[1] == REASON
        assert cluster.node_state("gpu-e-4")[1] == "none"  # its neighbour in the range untouched
