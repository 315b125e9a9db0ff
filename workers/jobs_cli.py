"""`fleetmedic jobs`: training jobs as the job-failures runbook saw them — failures, restarts, the
training time they lost and their ETTR — with the suspects it sent to trial and those it holds."""

from __future__ import annotations

import json
from datetime import timedelta

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from fleetmedic.durations import format_duration
from fleetmedic.ids import cluster_workflow_id
from workflows.job_failures import JobsReport


async def jobs_command(client: Client, cluster: str, output: str = "table") -> int:
    handle = client.get_workflow_handle(cluster_workflow_id("job-failures", cluster))
    try:
        report = await handle.query("jobs", result_type=JobsReport, rpc_timeout=timedelta(seconds=5))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            print(f"no job end has reached FleetMedic in cluster {cluster} yet (job-failures/{cluster} has not run)")
            return 0
        raise
    if output == "json":
        print(json.dumps(report.model_dump(mode="json"), indent=2))
        return 0
    ettr = "-" if report.ettr is None else f"{report.ettr:.4f}"
    print(f"cluster {cluster}: {len(report.jobs)} job(s), ETTR {ettr} (Σ(wall − lost) / Σ wall)")
    if report.jobs:
        width = max(len("JOB"), *(len(j["job"]) for j in report.jobs))
        print(f"{'JOB':<{width}}  {'STATE':<9} {'FAILED':>6} {'RESTARTS':>8} {'LOST':>9} {'ETTR':>7}  CAUSES")
        for job in report.jobs:
            causes = ", ".join(f"{k} ×{v}" for k, v in sorted(job["by_cause"].items()))
            job_ettr = "-" if job["ettr"] is None else f"{job['ettr']:.4f}"
            print(f"{job['job']:<{width}}  {job['state']:<9} {job['failures']:>6} {job['restarts']:>8} "
                  f"{format_duration(timedelta(seconds=round(job['lost_s']))):>9} {job_ettr:>7}  {causes}"
                  + (f"  [{job['stopped']}]" if job["stopped"] else ""))
    for trial in report.trials:
        print(f"trial  {trial.node}  {trial.at:%Y-%m-%d %H:%M}Z  {trial.workflow_id}: {trial.why}")
    for held in report.held:
        print(f"held   {held.node}: {held.why}")
    return 0
