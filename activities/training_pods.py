"""Kubernetes' side of the job-failures runbook: the failed pods of training workloads, read from
the API with the nodes they ran on (no new permission: the worker lists pods already).

Training workloads are the pods of Indexed batch/v1 Jobs (label `batch.kubernetes.io/job-completion-
index`), which is what distributed training runs as — JobSet's Jobs are Indexed too, and its pods
name their JobSet (`jobset.sigs.k8s.io/jobset-name`), which is then the job FleetMedic tracks. A pod
fails two ways: it ends `Failed` (restartPolicy Never: the Job's backoffLimit makes a new pod), or its
container restarts in place (OnFailure: `lastState.terminated`). Pods of one attempt that fail within
a minute of each other are one failure of the job, on the nodes of every pod of that attempt.
The Job's own restart policy restarts it: FleetMedic counts, attributes, and never deletes a pod.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import activity

from activities.kubernetes import KubernetesActivities
from fleetmedic.job_failures import MAX_LINES, JobEnd

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name")
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ATTEMPT = timedelta(minutes=1)  # pods of one attempt fail together (the collective breaks for all)


def _time(raw: object) -> datetime | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def job_of(pod: dict[str, Any]) -> str | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    name = labels.get(JOBSET_LABEL) or next((labels[k] for k in JOB_LABELS if labels.get(k)), None)
    return f"{meta.get('namespace', 'default')}/{name}" if name else None


def terminations(pod: dict[str, Any]) -> list[tuple[datetime, dict[str, Any]]]:
    """(when, the container's terminated state) of each failed end this pod shows."""
    found = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            ended = state.get("terminated") or {}
            at = _time(ended.get("finishedAt"))
            if at is not None and int(ended.get("exitCode") or 0) != 0:
                found.append((at, ended))
    return found


def _state(pod: dict[str, Any], ended: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    if ended.get("reason") == "OOMKilled":
        return "OUT_OF_MEMORY"
    if status.get("reason") == "DeadlineExceeded":
        return "TIMEOUT"
    # Evicted, preempted, drained (by FleetMedic too): the pod was taken, it did not fail.
    if any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in status.get("conditions") or []):
        return "PREEMPTED"
    return "FAILED"


def failed_attempts(pods: list[dict[str, Any]], since: datetime) -> list[JobEnd]:
    """One JobEnd per failed attempt of each training job whose first failure came after `since`."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        if (job := job_of(pod)) is not None:
            by_job.setdefault(job, []).append(pod)
    ends = []
    for job, mine in sorted(by_job.items()):
        failures = sorted(((at, pod, ended) for pod in mine for at, ended in terminations(pod)), key=lambda f: f[0])
        while failures:
            first = failures[0][0]
            group = [f for f in failures if f[0] - first <= ATTEMPT]
            failures = failures[len(group):]
            if first <= since:
                continue
            at, pod, ended = group[0]
            # The attempt: every pod of the job that had started by the failure and was not long over.
            nodes = sorted({n for p in mine if (n := (p.get("spec") or {}).get("nodeName"))
                            and (_time((p.get("metadata") or {}).get("creationTimestamp")) or first) <= first + ATTEMPT
                            and not _ended_before(p, first - ATTEMPT)})
            lines = [line for _, _, e in group for line in str(e.get("message") or "").splitlines() if line.strip()]
            try:
                ends.append(JobEnd(
                    source="kubernetes", job=job[:128], name=str((pod.get("metadata") or {}).get("name", ""))[:200],
                    state=_state(pod, ended), exit_code=max(-255, min(255, int(ended.get("exitCode") or 1))),
                    nodes=nodes or [pod["spec"]["nodeName"]], started_at=_time(ended.get("startedAt")),
                    ended_at=first, output_lines=lines[-MAX_LINES:]))
            except (ValidationError, KeyError):
                continue  # a name FleetMedic does not act on; counted by the caller as skipped
    return ends


def _ended_before(pod: dict[str, Any], moment: datetime) -> bool:
    ends = [at for at, _ in terminations(pod)]
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Failed", "Succeeded") and bool(ends) and max(ends) < moment


class TrainingPodActivities:
    def __init__(self, kubernetes: KubernetesActivities) -> None:
        self.kubernetes = kubernetes

    @activity.defn(name="k8s.failed_training_pods")
    def failed_training_pods(self, since: datetime) -> list[JobEnd]:
        """Failed attempts of Indexed Jobs and JobSets since `since` (the pods the API still has)."""
        pods = self.kubernetes.raw_list("list training pods", self.kubernetes.core.list_pod_for_all_namespaces,
                                        label_selector=INDEX_LABEL)
        return failed_attempts(pods, since)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.failed_training_pods]
