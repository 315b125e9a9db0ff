"""Temporal itself as a system: which workflows still run, and how often a node was remediated
(visibility). Async activities on the worker's own client (no thread)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.shared_reads import AsyncSharedReads
from activities.slurm_names import SameName, SlurmNames
from activities.start import RUNBOOK_TASK_TIMEOUT, start_or_attach
from fleetmedic.ids import FLEET_NODE, node_workflow_id, run_summary, start_attributes
from fleetmedic.job_failures import SuspectNodeInput, SuspectRequest
from fleetmedic.trust import UntrustedValue, visibility_literal

log = logging.getLogger(__name__)

# A visibility query's own deadline (a shared lemon count, the guard's look at its holders: the
# callers' activities have theirs), and at most this many past runs read by a lemon count (a lemon
# threshold is a few remediations; a fleet's worth is plenty).
COUNT_TIMEOUT_S = 20
COUNT_LIMIT = 5000
# The guard's look at which lease holders still run: IDs in one visibility query (a query's text
# stays well under what the servers take: SQL, and Elasticsearch's 65,536 terms), and describes sent
# at once for those it does not list.
RUNNING_IDS_PER_QUERY = 1000
DESCRIBES_AT_ONCE = 20
# The runbooks whose run on a node explains a job's failure there (a known hardware cause).
HARDWARE_RUNBOOKS = ("xid-recovery", "hot-gpu-pull", "nvlink-fault-replace", "suspect-node")


class TemporalActivities:
    def __init__(self, client: Client, task_queue: str, names: SlurmNames | None = None) -> None:
        self.client = client
        self.task_queue = task_queue
        # Job failures name Slurm nodes; runbooks run on Kubernetes nodes (Slinky: not the same names).
        self.names: SlurmNames = names or SameName()
        self.remediation_counts: AsyncSharedReads[tuple[str, str, datetime], int] = AsyncSharedReads(
            self._count_batch, max_keys=200)

    async def kube_nodes(self, slurm: list[str]) -> dict[str, str]:
        """Slurm node → the Kubernetes node it runs on."""
        if self.names.mapping == "same-name":
            return {n: n for n in slurm}
        return await asyncio.to_thread(self.names.kube_nodes, slurm)

    @activity.defn(name="temporal.running")
    async def running(self, workflow_ids: list[str]) -> list[str]:
        """Which of these workflows still run: the fleet guard asks it of every lease holder at each
        reclaim (once a minute), to give back the leases of runbooks that closed without releasing.

        Visibility answers for all of them at once, a list query per RUNNING_IDS_PER_QUERY. It is
        written a moment after a run starts or closes, so it only ever keeps a lease: an ID it lists
        as running is alive (one that closed just now is reclaimed at the next look); every other ID
        is asked of the server itself (describe), which decides. One describe per holder, as every
        holder was asked before, made 1,000 holders 1,000 calls a minute: 2 s and 1.7-2.0 CPU-s of
        the server's each time, on the same cores as the runbooks' tasks. 5,000 took 10.5-14.2 s
        (bench/guard_throughput.py --reclaim), so 10,000-15,000 would outlast the reclaim's 30 s
        deadline, and no lease would ever be reclaimed."""
        listed = await self.listed_running(workflow_ids)
        unlisted = [w for w in dict.fromkeys(workflow_ids) if w not in listed]
        described: set[str] = set()
        for start in range(0, len(unlisted), DESCRIBES_AT_ONCE):
            batch = unlisted[start:start + DESCRIBES_AT_ONCE]
            runs = await asyncio.gather(*(self._describes_running(w) for w in batch))
            described.update(w for w, alive in zip(batch, runs, strict=True) if alive)
        return [w for w in workflow_ids if w in listed or w in described]

    async def listed_running(self, workflow_ids: list[str]) -> set[str]:
        """The IDs that visibility lists with a running run (the first step of `running`; alone, the
        floor of bench/guard_throughput.py --reclaim). An ID that cannot be quoted into a query,
        and those of a query the server did not answer, are left out: they are described instead."""
        quoted = []
        for workflow_id in dict.fromkeys(workflow_ids):
            try:
                quoted.append(visibility_literal(workflow_id))
            except UntrustedValue:
                continue
        listed: set[str] = set()
        for start in range(0, len(quoted), RUNNING_IDS_PER_QUERY):
            ids = ", ".join(quoted[start:start + RUNNING_IDS_PER_QUERY])
            query = f'WorkflowId IN ({ids}) AND ExecutionStatus = "Running"'
            try:
                async with asyncio.timeout(COUNT_TIMEOUT_S):
                    async for run in self.client.list_workflows(query, page_size=RUNNING_IDS_PER_QUERY):
                        listed.add(run.id)
            except (RPCError, TimeoutError) as exc:
                log.warning("Temporal at %s did not list which lease holders run (%s): asking each of them",
                            self.client.service_client.config.target_host,
                            getattr(exc, "message", None) or f"no answer within {COUNT_TIMEOUT_S} s")
        return listed

    async def _describes_running(self, workflow_id: str) -> bool:
        try:
            description = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return description.status == WorkflowExecutionStatus.RUNNING

    @activity.defn(name="temporal.count_remediations")
    async def count_remediations(self, cluster: str, node: str, since: datetime) -> int:
        """Live runs that took this node out of service since `since`: the lemon-node rule counts
        them. Shadow (dry-run) runs never count: rolling a policy out in shadow first must not send
        a node to RMA on its first live failure.

        Runs asking at once share one visibility query (activities/shared_reads.py): every node
        runbook asks at its start, and a storm's 500 counts, one each, met the production server's
        visibility rate limit (`frontend.namespaceRPS.visibility`, 10/s by default)."""
        try:
            visibility_literal(cluster), visibility_literal(node)  # refused alone, not with its batch
            return await self.remediation_counts.get((cluster, node, since)) or 0
        except UntrustedValue as exc:
            raise ApplicationError(str(exc), type="InvalidInput", non_retryable=True) from None
        except RPCError as exc:
            if exc.status == RPCStatusCode.INVALID_ARGUMENT:
                # Retrying a query the server refuses cannot succeed: fail the step so it escalates.
                raise ApplicationError(f"visibility refused the query: {exc.message}", type="InvalidInput",
                                       non_retryable=True) from None
            raise

    async def _count_batch(self, keys: frozenset[tuple[str, str, datetime]]) -> dict[tuple[str, str, datetime], int]:
        """Each (cluster, node, since)'s count, from one list query per cluster over all its nodes
        since the earliest `since` asked (the per-node windows are applied to the runs it returns)."""
        counts = dict.fromkeys(keys, 0)
        for cluster in {c for c, _, _ in keys}:
            asked = [(node, since) for c, node, since in keys if c == cluster]
            names = ", ".join(visibility_literal(n) for n in sorted({n for n, _ in asked}))
            after = min(since for _, since in asked).isoformat().replace("+00:00", "Z")
            query = (f"FleetCluster = {visibility_literal(cluster)} AND FleetNode IN ({names}) "
                     'AND ExecutionStatus != "Running" AND FleetOutcome IN ("remediated", "quarantined", "lemon") '
                     f'AND FleetDryRun = false AND StartTime > "{after}"')
            async with asyncio.timeout(COUNT_TIMEOUT_S):
                async for run in self.client.list_workflows(query, limit=COUNT_LIMIT, page_size=1000):
                    ran_on = run.typed_search_attributes.get(FLEET_NODE)
                    for node, since in asked:
                        if node == ran_on and run.start_time > since:
                            counts[(cluster, node, since)] += 1
        return counts

    @activity.defn(name="temporal.hardware_runbooks")
    async def hardware_runbooks(self, cluster: str, nodes: list[str], since: datetime) -> dict[str, str]:
        """Node → the hardware runbook that ran there since `since` (open, or closed after it): a job
        that failed on such a node has a known cause. One query for the whole allocation."""
        if not nodes:
            return {}
        kube = await self.kube_nodes(nodes)
        slurm_of = {k: s for s, k in kube.items()}
        try:
            names = ", ".join(visibility_literal(n) for n in sorted(set(kube.values()))[:500])
            kinds = ", ".join(visibility_literal(r) for r in HARDWARE_RUNBOOKS)
            after = since.isoformat().replace("+00:00", "Z")
            query = (f"FleetCluster = {visibility_literal(cluster)} AND FleetNode IN ({names}) AND FleetRunbook IN "
                     f'({kinds}) AND FleetDryRun = false AND (ExecutionStatus = "Running" OR CloseTime > "{after}")')
            found: dict[str, str] = {}
            async for run in self.client.list_workflows(query, limit=200):
                node = run.typed_search_attributes.get(FLEET_NODE)
                if node and slurm_of.get(node, node) not in found:
                    found[slurm_of.get(node, node)] = run.id
            return found
        except UntrustedValue as exc:
            raise ApplicationError(str(exc), type="InvalidInput", non_retryable=True) from None

    @activity.defn(name="jobs.start_suspect")
    async def start_suspect(self, request: SuspectRequest) -> str:
        """The suspect's trial: a suspect-node run for the node (attached to, when one is open) —
        the Kubernetes node that the Slurm node runs on, where they differ (Slinky)."""
        node = (await self.kube_nodes([request.node]))[request.node]
        request = request.model_copy(update={"node": node})
        workflow_id = node_workflow_id("suspect-node", request.cluster, request.node)
        arg = SuspectNodeInput(cluster=request.cluster, node=request.node, evidence=request.evidence,
                               dry_run=request.dry_run)
        await start_or_attach(
            self.client, "suspect-node", arg.model_dump(mode="json"), workflow_id=workflow_id,
            task_queue=self.task_queue,
            search_attributes=start_attributes("suspect-node", request.cluster, request.node, dry_run=request.dry_run),
            summary=run_summary("suspect-node", request.cluster, request.node, why=request.evidence[:200]),
            details=request.evidence, task_timeout=RUNBOOK_TASK_TIMEOUT)
        return workflow_id

    def activities(self) -> list[Callable[..., Any]]:
        return [self.running, self.count_remediations, self.hardware_runbooks, self.start_suspect]
