"""Attribution, the job-end contract and training-time accounting: the pure parts of the
job-failures runbook (the workflow runs the same functions; tests/test_job_failures.py end to end)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleetmedic.attribution import Failure, Verdict, assess, classify, poisson_tail
from fleetmedic.job_failures import JobEnd, expand_hostlist, from_jobcomp, from_squeue, slurm_exit_code
from fleetmedic.policy import CrashPolicy
from fleetmedic.training_time import JobTrack, account

T0 = datetime(2026, 12, 1, tzinfo=UTC)
POLICY = CrashPolicy()


def failure(job: str, nodes: list[str], minutes: float, cause: str = "nccl", explained: str = "") -> Failure:
    at = T0 + timedelta(minutes=minutes)
    return Failure(key=f"x:{job}:{at.timestamp()}", job=job, nodes=tuple(nodes), at=at, cause=cause,
                   explained=explained)


def verdict_after(failures: list[Failure], fleet: int = 100, cleared: dict[str, datetime] | None = None) -> Verdict:
    return assess(failures, failures[-1], POLICY, fleet_size=fleet, cleared=cleared or {},
                  now=failures[-1].at)


def test_a_node_in_every_failed_allocation_of_a_job_whose_allocations_varied_is_named() -> None:
    runs = [failure("4412", ["n1", "n2", "n7"], 0), failure("4412", ["n3", "n7", "n9"], 60),
            failure("4412", ["n4", "n5", "n7"], 120)]
    assert verdict_after(runs[:2]).suspects == []  # two failures are not yet a pattern
    [suspect] = verdict_after(runs).suspects
    assert suspect.node == "n7" and suspect.rule == "same-job"
    assert suspect.why == ("n7 was in 3 of the last 3 failed allocations of job 4412 (NCCL timeout); "
                           "the other 6 node(s) varied")


def test_identical_allocations_cannot_tell_the_node_from_the_code() -> None:
    runs = [failure("7", ["n1", "n2"], m) for m in (0, 10, 20)]
    verdict = verdict_after(runs)
    assert verdict.suspects == [] and "cannot be told from a node" in verdict.notes[0]


def test_too_many_common_nodes_are_not_guessed_at() -> None:
    runs = [failure("7", ["n1", "n2", "n3", "n4"], 0), failure("7", ["n1", "n2", "n3", "n5"], 10),
            failure("7", ["n1", "n2", "n3", "n6"], 20)]
    verdict = verdict_after(runs)
    assert verdict.suspects == [] and "3 nodes were in each" in verdict.notes[0]


def test_a_node_failing_several_jobs_far_above_chance_is_named_with_its_statistic() -> None:
    # Background: 5 jobs failing on their own nodes, spread over a 2,000-node fleet.
    runs = [failure(f"bg{i}", [f"b{i}-{k}" for k in range(8)], i * 60) for i in range(5)]
    runs += [failure(f"j{i}", ["bad", f"o{i}a", f"o{i}b"], 300 + i * 30) for i in range(5)]
    verdict = verdict_after(runs, fleet=2000)
    [suspect] = verdict.suspects
    assert suspect.node == "bad" and suspect.rule == "many-jobs"
    assert "failed allocations of 5 different jobs within 1d (NCCL timeout)" in suspect.why and "P = " in suspect.why
    # Two jobs only: not enough different jobs, however unlikely by chance.
    assert verdict_after(runs[:7], fleet=2000).suspects == []


def test_failures_spread_over_many_jobs_read_as_software_and_take_nobody_out() -> None:
    runs = [failure(f"job{i}", ["n7", f"x{i}"], i) for i in range(POLICY.widespread_jobs)]
    verdict = verdict_after(runs)
    assert verdict.suspects == [] and verdict.widespread.startswith("widespread failures: 6 jobs failed within 30m")


def test_explained_failures_are_not_evidence() -> None:
    runs = [failure("4412", ["n1", "n7"], 0), failure("4412", ["n3", "n7"], 60),
            failure("4412", ["n4", "n7"], 120, explained="xid-recovery/prod/n4 ran on n4")]
    verdict = verdict_after(runs)
    assert verdict.suspects == []
    assert verdict.notes == ["not evidence against its nodes: xid-recovery/prod/n4 ran on n4"]


def test_a_node_whose_trial_started_starts_again_with_a_clean_record() -> None:
    runs = [failure("4412", ["n1", "n7"], 0), failure("4412", ["n3", "n7"], 60), failure("4412", ["n4", "n7"], 120)]
    assert verdict_after(runs, cleared={"n7": T0 + timedelta(minutes=90)}).suspects == []


def end(**fields: object) -> JobEnd:
    return JobEnd.model_validate({"job": "4412", "nodes": ["n1"], "ended_at": T0, **fields})


@pytest.mark.parametrize(("fields", "lines", "hardware", "cause", "explained"), [
    ({}, ["[rank3] NCCL WARN Timeout: watchdog caught collective operation timeout"], {}, "nccl", ""),
    ({"state": "TIMEOUT"}, [], {}, "timeout", "the job ran into its own time limit"),
    ({"exit_code": 3}, [], {}, "exit", ""),
    ({"state": "NODE_FAIL"}, [], {}, "node_fail", ""),
    ({}, ["ValueError: bad shape"], {}, "python", "its output says the code failed"),
    ({}, ["CUDA error: an illegal memory access"], {"n1": "xid-recovery/p/n1"}, "cuda", "xid-recovery/p/n1 ran on n1"),
])
def test_classify_names_the_cause_and_what_explains_it(fields: dict[str, object], lines: list[str],
                                                       hardware: dict[str, str], cause: str, explained: str) -> None:
    result = classify(end(**fields), POLICY, lines, hardware)
    assert result.cause == cause and result.explained.startswith(explained)
    assert result.evidence == (explained == "")


def test_application_exit_codes_are_the_jobs_own() -> None:
    policy = CrashPolicy(application_exit_codes=[3])
    assert classify(end(exit_code=3), policy, [], {}).explained.startswith("exit code 3 is the job's own error")


def test_slurm_hostlists_expand_and_refuse_what_is_not_one() -> None:
    assert expand_hostlist("gpu-[01-03,07],cpu1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu1"]
    assert expand_hostlist("n[1-2]") == ["n1", "n2"]
    for bad in ("gpu-[3-1]", "gpu-[1-99999999]", "gpu-[a-b]", "gpu-[1"):
        with pytest.raises(ValueError):
            expand_hostlist(bad)


def test_what_jobcomp_and_squeue_give_becomes_one_end_with_one_key() -> None:
    pushed = from_jobcomp({"JOBID": "12", "JOBSTATE": "FAILED", "NODES": "n[1-2]", "EXITCODE": "3:0",
                           "START": "1796357001", "END": "1796357004", "JOBNAME": "train"})
    read = from_squeue({"job_id": 12, "job_state": "FAILED", "nodes": "n[1-2]", "exit_code": 768,
                        "start_time": 1796357001, "end_time": 1796357004, "name": "train"})
    assert read is not None and pushed.key == read.key == "slurm:12:1796357004"
    assert pushed.nodes == read.nodes == ["n1", "n2"] and pushed.exit_code == read.exit_code == 3
    assert slurm_exit_code(9) == -9  # killed by a signal
    assert from_squeue({"job_id": 1, "job_state": "RUNNING", "nodes": "n1", "end_time": 0}) is None


@pytest.mark.parametrize("fields", [
    {"nodes": ["../etc/passwd"]}, {"nodes": []}, {"job": "a b"}, {"job": "x" * 200}, {"state": "EXPLODED"},
    {"nodes": ["n1"] * 5000}, {"exit_code": 999}, {"extra": 1}, {"output_lines": ["x"] * 50},
])
def test_untrusted_job_ends_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        end(**fields)


def test_ettr_counts_recompute_and_the_wait_for_the_restart() -> None:
    track = JobTrack(job="1")
    start = T0
    # Failed 10 h in, its last checkpoint 30 min before; restarted 15 min later; done 10 h after.
    track = account(track, end(started_at=start, ended_at=start + timedelta(hours=10),
                               last_checkpoint_at=start + timedelta(hours=9, minutes=30)), "nccl")
    assert track.waiting_since == start + timedelta(hours=10) and track.failures == 1
    done = start + timedelta(hours=20, minutes=15)
    track = account(track, end(state="COMPLETED", started_at=start + timedelta(hours=10, minutes=15),
                               ended_at=done), None)
    assert track.completed and track.lost_s == 45 * 60
    assert track.ettr(done) == pytest.approx(1 - 45 / (20 * 60 + 15))


def test_poisson_tail_is_exact_where_it_matters() -> None:
    assert poisson_tail(0, 0.5) == 1.0
    assert poisson_tail(1, 0.5) == pytest.approx(1 - 2.718281828 ** -0.5)
    assert 0 < poisson_tail(12, 0.01) < 1e-30  # the tiny tail is summed, not 1 minus almost 1


def test_the_pods_of_one_failed_attempt_are_one_failure_on_every_node_of_the_attempt() -> None:
    from activities.training_pods import failed_attempts

    def pod(name: str, node: str, *, failed_at: str | None = None, reason: str = "Error", jobset: bool = False,
            disrupted: bool = False) -> dict[str, object]:
        labels = {"batch.kubernetes.io/job-name": "llm-b-0", "batch.kubernetes.io/job-completion-index": "0"}
        if jobset:
            labels["jobset.sigs.k8s.io/jobset-name"] = "llm-b"
        terminated = {"exitCode": 137 if reason == "OOMKilled" else 1, "reason": reason, "finishedAt": failed_at,
                      "message": "CUDA error: an illegal memory access was encountered"} if failed_at else None
        return {"metadata": {"name": name, "namespace": "ml", "labels": labels,
                             "creationTimestamp": "2026-12-01T00:00:00Z"},
                "spec": {"nodeName": node},
                "status": {"phase": "Failed" if failed_at else "Running",
                           "conditions": [{"type": "DisruptionTarget", "status": "True"}] if disrupted else [],
                           "containerStatuses": [
                               {"state": {"terminated": terminated} if terminated else {"running": {}}}]}}

    pods = [pod("a", "n1", failed_at="2026-12-01T01:00:00Z", jobset=True),
            pod("b", "n2", failed_at="2026-12-01T01:00:20Z", jobset=True), pod("c", "n3", jobset=True)]
    [end] = failed_attempts(pods, since=T0)
    assert (end.job, end.nodes, end.state, end.ended_at) == ("ml/llm-b", ["n1", "n2", "n3"], "FAILED",
                                                              datetime(2026, 12, 1, 1, tzinfo=UTC))
    assert end.output_lines == ["CUDA error: an illegal memory access was encountered"] * 2
    assert failed_attempts(pods, since=datetime(2026, 12, 1, 2, tzinfo=UTC)) == []
    [oom] = failed_attempts([pod("a", "n1", failed_at="2026-12-01T01:00:00Z", reason="OOMKilled")], since=T0)
    [drained] = failed_attempts([pod("a", "n1", failed_at="2026-12-01T01:00:00Z", disrupted=True)], since=T0)
    assert (oom.job, oom.state, drained.state) == ("ml/llm-b-0", "OUT_OF_MEMORY", "PREEMPTED")
