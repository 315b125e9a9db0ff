"""job-failures/<cluster>: let it crash; if it persists, find the node.

One entity workflow per cluster hears every training job's end (Slurm's jobcomp script, a
framework's hook, the webhook's `POST /v1/jobs/ended`, and its own reconciliation over the jobs
Slurm ended lately) and, for each failure, in order:

1. classify it: the cause from its output lines, and whether a known cause explains it (the job's
   own limit, an application error, a hardware runbook on one of its nodes);
2. let it crash: restart it from its checkpoint (Slurm requeue, unless Slurm already did; a
   Kubernetes Job or a framework restarts itself), at most `crash.max_restarts` within
   `crash.window`, then ask a person;
3. account for the training time it lost (fleetmedic/training_time.py);
4. attribute: does the evidence point at a node (fleetmedic/attribution.py)? Widespread failures
   read as software and take nobody out; a suspect gets a trial — a `suspect-node` run — at most
   `crash.max_suspects_per_hour`, the rest held until the bound allows.

Every decision is kept (the `jobs` query, `fleetmedic jobs`), said in Slack, and counted on the
worker's /metrics. The workflow continues-as-new with its state before its history grows large.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.attribution import Failure, Suspicion, assess, classify, trials_within
    from fleetmedic.durations import format_duration
    from fleetmedic.job_failures import JobEnd, OutputRequest, RestartJob, SuspectRequest
    from fleetmedic.models import NotifyStart, RunbookStatus, RunContext, StepRecord
    from fleetmedic.policy import Policy
    from fleetmedic.training_time import JobTrack, account

from workflows.runbook import bounded_retry, configuration, describe_failure, execute

# The state is the continue-as-new input, and Temporal refuses a payload past 2 MB: each part is
# bounded to keep the whole well under 1 MB.
KEEP_SEEN = 3000  # ends already handled (their keys), against the push and the reconciliation both
KEEP_FAILURE_NODES = 30000  # node names across the failures kept (the window's evidence)
KEEP_DECISIONS = 200
KEEP_JOBS = 500
HOUR = timedelta(hours=1)
FLEET_SIZE_TTL = timedelta(minutes=10)
NOTIFY_RETRY = RetryPolicy(maximum_attempts=3)


class Decision(BaseModel):
    at: datetime
    job: str = ""
    node: str = ""
    what: str


class Trial(BaseModel):
    node: str
    at: datetime
    workflow_id: str
    why: str


class JobFailuresState(BaseModel):
    cluster: str
    inbox: list[JobEnd] = Field(default_factory=list)
    seen: list[str] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)
    tracks: dict[str, JobTrack] = Field(default_factory=dict)
    restarts: dict[str, list[datetime]] = Field(default_factory=dict)
    trials: list[Trial] = Field(default_factory=list)
    cleared: dict[str, datetime] = Field(default_factory=dict)  # a trial started: older failures no longer count
    held: list[Suspicion] = Field(default_factory=list)
    decisions: list[Decision] = Field(default_factory=list)
    reconciled_until: datetime | None = None
    widespread_said: datetime | None = None


class JobsReport(BaseModel):
    """What `fleetmedic jobs` shows."""

    cluster: str
    now: datetime
    jobs: list[dict[str, Any]]
    ettr: float | None  # the fleet's: Σ(wall − lost) / Σ wall over the jobs tracked
    trials: list[Trial]
    held: list[Suspicion]
    decisions: list[Decision]


@workflow.defn(name="job-failures")
class JobFailures:
    @workflow.init
    def __init__(self, state: JobFailuresState) -> None:
        self.state = state
        self.seen = set(state.seen)
        self.policy: Policy | None = None
        self.context: RunContext | None = None
        self.fleet_size = 0
        self.fleet_size_at: datetime | None = None

    @workflow.signal(description="A training job ended (webhook, jobcomp script, framework hook): a JobEnd")
    def ended(self, end: JobEnd) -> None:
        """Queued once: an end already handled, or already in line, is known by its key."""
        if end.key not in self.seen and all(e.key != end.key for e in self.state.inbox):
            self.state.inbox.append(end)

    @workflow.query(name="jobs", description="Jobs with their failures, restarts and ETTR; trials; decisions")
    def jobs(self) -> JobsReport:
        now = workflow.now()
        rows, wall, kept = [], 0.0, 0.0
        for track in sorted(self.state.tracks.values(), key=lambda t: t.last_end or now, reverse=True):
            ettr = track.ettr(now)
            wall_s = track.wall_s(now)
            wall, kept = wall + wall_s, kept + max(wall_s - track.lost_now(now), 0.0)
            rows.append({"job": track.job, "name": track.name, "source": track.source, "failures": track.failures,
                         "restarts": track.restarts_asked, "by_cause": track.by_cause, "wall_s": round(wall_s, 1),
                         "lost_s": round(track.lost_now(now), 1), "ettr": None if ettr is None else round(ettr, 4),
                         "state": "completed" if track.completed else ("stopped" if track.stopped else
                                                                       "waiting" if track.waiting_since else "running"),
                         "stopped": track.stopped, "nodes": track.nodes})
        return JobsReport(cluster=self.state.cluster, now=now, jobs=rows, ettr=kept / wall if wall else None,
                          trials=self.state.trials[-50:], held=self.state.held, decisions=self.state.decisions[-50:])

    @workflow.query(name="status", description="Its decisions so far, as every runbook reports them "
                                               "(`fleetmedic audit job-failures/<cluster>`)")
    def status(self) -> RunbookStatus:
        return RunbookStatus(
            runbook="job-failures", workflow_id=workflow.info().workflow_id, cluster=self.state.cluster,
            step="listening", waiting_for="training jobs' ends",
            dry_run=self.policy is not None and self._dry_run(),
            decisions=[StepRecord(step=f"job {d.job}" if d.job else (f"node {d.node}" if d.node else "job-failures"),
                                  at=d.at, result=d.what) for d in self.state.decisions])

    # --- the loop -------------------------------------------------------------------------------

    @workflow.run
    async def run(self, state: JobFailuresState) -> None:
        self.policy = await configuration(refs.CONFIG_POLICY)
        self.context = await configuration(refs.CONFIG_CONTEXT)
        crash = self.policy.crash
        while True:
            try:
                await workflow.wait_condition(lambda: bool(self.state.inbox), timeout=crash.reconcile_every,
                                              timeout_summary="read Slurm's recently ended jobs")
            except TimeoutError:
                pass
            if self._reconcile_due():
                await self.reconcile()
            while self.state.inbox:
                end = self.state.inbox.pop(0)
                if end.key not in self.seen:
                    self._remember(end.key)
                    await self.handle(end)
                    self.record_gauges()
            await self.try_held()
            if workflow.info().is_continue_as_new_suggested() or workflow.info().get_current_history_length() > 4000:
                await workflow.wait_condition(workflow.all_handlers_finished)
                self.state.seen = self.state.seen[-KEEP_SEEN:]
                workflow.continue_as_new(self.state)

    def _reconcile_due(self) -> bool:
        assert self.policy is not None and self.context is not None
        crash = self.policy.crash
        if not crash.enabled or not (self.context.slurm_enabled or crash.kubernetes_jobs):
            return False
        last = self.state.reconciled_until
        return last is None or workflow.now() - last >= crash.reconcile_every

    async def reconcile(self) -> None:
        """The jobs Slurm ended since the last look (within MinJobAge), and the failed attempts of
        Kubernetes' training jobs: an end pushed while nobody listened is seen all the same, and one
        already handled is known by its key. The first look reads all each source still has."""
        assert self.policy is not None and self.context is not None
        now = workflow.now()
        since = (self.state.reconciled_until or now - self.policy.crash.window) - timedelta(seconds=5)
        sources = []
        if self.context.slurm_enabled:
            sources.append((refs.ENDED_JOBS, "Slurm's ended jobs"))
        if self.policy.crash.kubernetes_jobs:
            sources.append((refs.FAILED_TRAINING_PODS, "failed training pods"))
        self.state.reconciled_until = now  # a source that failed is read again next time, from here
        for activity, what in sources:
            try:
                ends = await execute(activity, since, start_to_close_timeout=timedelta(seconds=60),
                                     retry_policy=bounded_retry(self.policy), summary=f"reconcile: {what}")
            except ActivityError as exc:
                every = format_duration(self.policy.crash.reconcile_every)
                self.decide(f"could not read {what}, trying again in {every}: {describe_failure(exc)}")
                continue
            for end in ends:
                self.ended(end.model_copy(update={"cluster": self.state.cluster}))

    async def handle(self, end: JobEnd) -> None:
        assert self.policy is not None
        crash = self.policy.crash
        if not crash.enabled or not end.ended or end.fleetmedics_own:
            return  # a burn-in's verdict is its suspect-node run's business
        track = self.state.tracks.get(end.job, JobTrack(job=end.job))
        if not end.failed:
            self.state.tracks[end.job] = account(track, end, None)
            self._count("fleetmedic_job_ends", {"outcome": "completed"})
            return
        failure = classify(end, crash, await self.output_lines(end), await self.hardware_on(end))
        self.state.failures.append(failure)
        self._prune()
        self.state.tracks[end.job] = account(track, end, failure.cause)
        self._trim_jobs()
        self._count("fleetmedic_job_ends", {"outcome": "failed", "cause": _label(failure.cause, crash.patterns,
                                                                                crash.application_patterns),
                                            "evidence": str(failure.evidence).lower()})
        await self.let_it_crash(end, failure)
        verdict = assess(self.state.failures, failure, crash, fleet_size=await self.fleet(),
                         cleared=self.state.cleared, now=workflow.now())
        for note in verdict.notes:
            self.decide(note, job=end.job)
        if verdict.widespread:
            self.decide(verdict.widespread, job=end.job)
            last = self.state.widespread_said
            if last is None or workflow.now() - last > crash.widespread_window:
                self.state.widespread_said = workflow.now()
                await self.say(f":warning: {verdict.widespread}")
            return
        for suspicion in verdict.suspects:
            await self.trial(suspicion)

    # --- let it crash ---------------------------------------------------------------------------

    async def let_it_crash(self, end: JobEnd, failure: Failure) -> None:
        assert self.policy is not None
        crash = self.policy.crash
        track = self.state.tracks[end.job]
        why = f"job {end.job} failed ({end.state}, {failure.cause}" + (f": {failure.line[:120]}" if failure.line
                                                                       else "") + ")"
        if failure.explained:
            why += f"; {failure.explained}"
        now = workflow.now()
        recent = [t for t in self.state.restarts.get(end.job, []) if t > now - crash.window]
        if len(recent) >= crash.max_restarts:
            if not track.stopped:
                track.stopped = f"{len(recent)} restarts within {format_duration(crash.window)}: a person decides"
                self.decide(f"{why}: not restarted, {track.stopped} (crash.max_restarts)", job=end.job)
                await self.say(f":rotating_light: job {end.job} ({end.name}) failed again after {len(recent)} restarts "
                               f"within {format_duration(crash.window)}; FleetMedic stopped restarting it. Causes: "
                               + ", ".join(f"{k} ×{v}" for k, v in sorted(track.by_cause.items()))
                               + f". Last nodes: {', '.join(end.nodes[:16])}",
                               mention=self.policy.escalation.slack_mention)
            return
        track.stopped = ""
        if end.source != "slurm":
            self.decide(f"{why}: left to its own restart ({end.source})", job=end.job)
            return
        if not end.job.isdigit():
            self.decide(f"{why}: not a Slurm job ID, not restarted", job=end.job)
            return
        try:
            result = await execute(refs.RESTART_JOB, RestartJob(job_id=int(end.job), ended_at=end.ended_at,
                                                                dry_run=self._dry_run()),
                                   start_to_close_timeout=timedelta(seconds=60),
                                   retry_policy=bounded_retry(self.policy, "writes"),
                                   summary=f"let it crash: restart job {end.job}")
        except ActivityError as exc:
            self.decide(f"{why}: the restart failed after its retries: {describe_failure(exc)}", job=end.job)
            await self.say(f":rotating_light: job {end.job} failed and FleetMedic could not restart it: "
                           f"{describe_failure(exc)}", mention=self.policy.escalation.slack_mention)
            return
        self.state.restarts[end.job] = [*recent, now]
        track.restarts_asked += 1
        self._count("fleetmedic_job_restarts", {"changed": str(result.changed).lower()})
        self.decide(f"{why}: let it crash — {result.summary}", job=end.job)

    # --- if it persists, find the node ---------------------------------------------------------

    async def trial(self, suspicion: Suspicion) -> None:
        assert self.policy is not None
        now = workflow.now()
        if any(t.node == suspicion.node and t.at > now - HOUR for t in self.state.trials):
            return  # on trial already
        if trials_within((t.at for t in self.state.trials), now) >= self.policy.crash.max_suspects_per_hour:
            if all(h.node != suspicion.node for h in self.state.held):
                self.state.held.append(suspicion)
                self.decide(f"suspect {suspicion.node} held: {self.policy.crash.max_suspects_per_hour} trials started "
                            f"within the hour (crash.max_suspects_per_hour). {suspicion.why}", node=suspicion.node)
                self._count("fleetmedic_suspects", {"rule": suspicion.rule, "action": "held"})
            return
        try:
            workflow_id = await execute(refs.START_SUSPECT, SuspectRequest(
                cluster=self.state.cluster, node=suspicion.node, evidence=suspicion.why, dry_run=self._dry_run()),
                start_to_close_timeout=timedelta(seconds=30), retry_policy=bounded_retry(self.policy, "writes"),
                summary=f"suspect {suspicion.node}: start its trial")
        except ActivityError as exc:
            self.decide(f"suspect {suspicion.node}: its trial could not start: {describe_failure(exc)}",
                        node=suspicion.node)
            return
        self.state.trials.append(Trial(node=suspicion.node, at=now, workflow_id=workflow_id, why=suspicion.why))
        self.state.trials = self.state.trials[-500:]
        self.state.cleared[suspicion.node] = now
        self.state.held = [h for h in self.state.held if h.node != suspicion.node]
        self._count("fleetmedic_suspects", {"rule": suspicion.rule, "action": "trial"})
        self.decide(f"suspect {suspicion.node}: {suspicion.why}; trial started ({workflow_id})", node=suspicion.node)
        await self.say(f":mag: *suspect node* `{suspicion.node}`: {suspicion.why}. Trial: drain and burn-in "
                       f"(`{workflow_id}`); it comes back if it passes, and is replaced if it fails.")

    async def try_held(self) -> None:
        """Suspects held by the hourly bound get their trial when it allows (their evidence stands)."""
        for suspicion in list(self.state.held):
            assert self.policy is not None
            if trials_within((t.at for t in self.state.trials), workflow.now()) >= \
                    self.policy.crash.max_suspects_per_hour:
                return
            self.state.held.remove(suspicion)
            await self.trial(suspicion)

    # --- reads ----------------------------------------------------------------------------------

    async def output_lines(self, end: JobEnd) -> list[str]:
        assert self.policy is not None
        crash = self.policy.crash
        lines = list(end.output_lines)
        if end.source == "slurm" and end.job.isdigit() and crash.output_roots:
            try:
                read: list[str] = await execute(refs.JOB_OUTPUT, OutputRequest(
                    job_id=int(end.job), patterns=[*crash.patterns.values(), *crash.application_patterns.values()],
                    roots=crash.output_roots, tail_bytes=crash.output_tail_bytes),
                    start_to_close_timeout=timedelta(seconds=30), retry_policy=bounded_retry(self.policy),
                    summary=f"read job {end.job}'s output")
                lines.extend(read)
            except ActivityError as exc:
                self.decide(f"job {end.job}'s output could not be read: {describe_failure(exc)}", job=end.job)
        return lines

    async def hardware_on(self, end: JobEnd) -> dict[str, str]:
        assert self.policy is not None
        try:
            return await execute(refs.HARDWARE_RUNBOOKS, (self.state.cluster, list(end.nodes),
                                                          end.ended_at - self.policy.crash.explained_within),
                                 start_to_close_timeout=timedelta(seconds=30), retry_policy=bounded_retry(self.policy),
                                 summary="hardware runbooks on the job's nodes")
        except ActivityError as exc:
            self.decide(f"could not ask Temporal for hardware runbooks on job {end.job}'s nodes: "
                        f"{describe_failure(exc)}", job=end.job)
            return {}

    async def fleet(self) -> int:
        """GPU nodes in the cluster (the statistic's denominator), read at most every 10 minutes."""
        assert self.policy is not None
        now = workflow.now()
        if self.fleet_size_at is None or now - self.fleet_size_at > FLEET_SIZE_TTL:
            self.fleet_size_at = now
            try:
                capacity = await execute(refs.FLEET_CAPACITY, (self.policy.labels.gpu_node_selector, None),
                                         start_to_close_timeout=timedelta(seconds=30),
                                         retry_policy=bounded_retry(self.policy), summary="count the GPU nodes")
                self.fleet_size = capacity.gpu_nodes
            except ActivityError as exc:
                self.decide("could not count the GPU nodes (the nodes seen in failures stand in): "
                            f"{describe_failure(exc)}")
        return self.fleet_size

    # --- bookkeeping ----------------------------------------------------------------------------

    def _dry_run(self) -> bool:
        assert self.policy is not None
        return self.policy.shadow.enabled_for("job-failures")

    def _remember(self, key: str) -> None:
        self.seen.add(key)
        self.state.seen.append(key)
        if len(self.state.seen) > KEEP_SEEN * 2:
            dropped, self.state.seen = self.state.seen[:-KEEP_SEEN], self.state.seen[-KEEP_SEEN:]
            self.seen.difference_update(dropped)

    def _prune(self) -> None:
        assert self.policy is not None
        horizon = workflow.now() - self.policy.crash.window
        kept = [f for f in self.state.failures if f.at > horizon]
        while sum(len(f.nodes) for f in kept) > KEEP_FAILURE_NODES and len(kept) > 1:
            kept = kept[len(kept) // 10 or 1:]  # the oldest tenth goes
        self.state.failures = kept
        self.state.cleared = {n: t for n, t in self.state.cleared.items() if t > horizon}

    def _trim_jobs(self) -> None:
        if len(self.state.tracks) > KEEP_JOBS:
            oldest = sorted(self.state.tracks.values(), key=lambda t: t.last_end or workflow.now())
            for track in oldest[:len(self.state.tracks) - KEEP_JOBS]:
                del self.state.tracks[track.job]
                self.state.restarts.pop(track.job, None)

    def decide(self, what: str, job: str = "", node: str = "") -> None:
        workflow.logger.info("job-failures %s: %s", self.state.cluster, what)
        self.state.decisions.append(Decision(at=workflow.now(), job=job, node=node, what=what))
        self.state.decisions = self.state.decisions[-KEEP_DECISIONS:]

    def record_gauges(self) -> None:
        """The fleet's ETTR and the jobs waiting for a person, on the worker's /metrics (per cluster:
        job IDs are not labels, the table is `fleetmedic jobs`)."""
        report = self.jobs()
        meter = workflow.metric_meter().with_additional_attributes({"cluster": self.state.cluster})
        if report.ettr is not None:
            meter.create_gauge_float("fleetmedic_training_ettr", "effective training time ratio of the jobs "
                                     "FleetMedic tracks: sum(wall - lost) / sum(wall)").set(report.ettr)
        meter.create_gauge("fleetmedic_training_jobs_stopped", "jobs that keep failing and that FleetMedic stopped "
                           "restarting (crash.max_restarts): a person decides").set(
            sum(1 for job in report.jobs if job["state"] == "stopped"))

    def _count(self, name: str, labels: dict[str, str]) -> None:
        meter = workflow.metric_meter().with_additional_attributes({"cluster": self.state.cluster, **labels})
        meter.create_counter(name, name.replace("_", " ")).add(1)

    async def say(self, text: str, mention: str | None = None) -> None:
        """A Slack message of its own (notifications never stop the runbook)."""
        try:
            await execute(refs.NOTIFY_START, NotifyStart(
                workflow_id=workflow.info().workflow_id, runbook="job-failures", text=text + (
                    f" {mention}" if mention else ""), dry_run=self._dry_run()),
                start_to_close_timeout=timedelta(seconds=30), retry_policy=NOTIFY_RETRY, summary="notify")
        except ActivityError:
            workflow.logger.warning("slack message failed; continuing")


def _label(cause: str, *known: dict[str, str]) -> str:
    """Metric labels stay bounded: a policy pattern's name, or one of Slurm's states, else `exit`."""
    if any(cause in names for names in known) or cause in ("node_fail", "exit"):
        return cause
    return cause if cause.upper() in ("TIMEOUT", "DEADLINE", "CANCELLED", "PREEMPTED", "OUT_OF_MEMORY") else "other"
