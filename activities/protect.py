"""The protective step: a bad node stops receiving work within a second of its alert.

Protective means reversible and killing nothing: the Kubernetes cordon (or the runbook's taint)
and Slurm DRAIN — no new pod or job lands there, whatever already runs keeps running. So it runs
before the disruption lease, right after one read of the node: the Kubernetes node, its opt-out
(its label, or a label of a pod on it), the Slurm node and its jobs, read at the same time. The
steps that kill work (Slurm DOWN, requeue, drain, replace, reset) still wait for the lease.

In a storm the reads that are the same for every node (the opted-out pods, Slurm's jobs on nodes) and
the Slurm node reads are shared by the runs asking at once (activities/shared_reads.py): slurmctld
answers one request at a time, and 50 nodes failing together would otherwise queue 150 of them.

One activity for read and write. Runbooks run it as a local activity inside their workflow task,
on the worker that holds the run: no round trip through the server, no task queue to wait in.
It runs on threads of its own (`slots` of them, and CALLS_PER_STEP times that for the calls they
make side by side), never the worker's activity pool: no backlog of
drains, evictions or watches can hold a new alert's cordon up.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from temporalio import activity

from activities.breaker import CordonBreaker, GuardViews
from activities.kube_client import protective_lane
from activities.kubernetes import KubernetesActivities, node_info_from_json
from activities.slurm import SlurmActivities
from fleetmedic.models import (
    ActionResult,
    NodeTarget,
    Protection,
    ProtectRequest,
    SetSlurmNodeState,
    SlurmJob,
    SlurmNode,
    SlurmNodeState,
    TaintRequest,
)

T = TypeVar("T")
# A step's reads at once: the node, the opted-out pods, the Slurm node and its jobs (the two writes
# come after the reads they need). Three of them may wait on a read shared with other steps
# (activities/shared_reads.py), holding their thread meanwhile.
CALLS_PER_STEP = 4


class ProtectiveActivities:
    def __init__(self, kubernetes: KubernetesActivities, slurm: SlurmActivities, *, slots: int = 8,
                 breaker: CordonBreaker | None = None, views: GuardViews | None = None) -> None:
        self.kubernetes = kubernetes
        self.slurm = slurm
        # The cordon breaker and the fleet pause (activities/breaker.py); None: no bound (unit tests).
        self.breaker, self.views = breaker, views
        # One thread per protective step at once, and threads for the calls each makes side by side
        # (Kubernetes and Slurm are asked together; each call keeps its own timeout).
        self.steps = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="fleetmedic-protective")
        self.pool = ThreadPoolExecutor(max_workers=CALLS_PER_STEP * slots, thread_name_prefix="fleetmedic-protect")

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        # The activity's context (its info, for the remediation record) goes with the call.
        return self.pool.submit(contextvars.copy_context().run, fn, *args)

    @activity.defn(name="protect.node")
    async def protect_node(self, request: ProtectRequest) -> Protection:
        """Read the node, its opt-out and its Slurm jobs; unless it is opted out (or missing), cordon
        or taint it and set it DRAIN in Slurm, together. Idempotent: a retry finds it done.
        The writes wait for the opt-out only: the jobs (a slower read) are collected after them.
        Its Kubernetes requests take the protective rate-limit bucket (activities/kube_client.py).
        A coroutine whose work runs on the step's own threads: as a local activity it never
        waits for a thread of the worker's activity pool, which the runs' other steps hold."""
        if self.views is not None and request.cluster:
            self.views.start()
            if self.views.get(request.cluster).read_at == 0:  # the worker's first step: read the guard now
                await self.views.read(request.cluster)
        return await asyncio.get_running_loop().run_in_executor(
            self.steps, contextvars.copy_context().run, self._in_lane, request)

    def _in_lane(self, request: ProtectRequest) -> Protection:
        with protective_lane():
            return self._protect(request)

    def _protect(self, request: ProtectRequest) -> Protection:
        # The opted-out pods (a list, shared in a storm) and the node are read side by side. Each
        # waits only on what was submitted before it: the pool is first in, first out. The pods
        # come from the API server's watch cache, without waiting for its consistency
        # (KubernetesActivities.opted_out_pods_cached); every destructive step reads them consistently.
        opted_out = self._submit(self.kubernetes.opted_out_pods_cached)
        looked = self._submit(self.kubernetes.look, request.node, opted_out.result)
        jobs: Future[list[SlurmJob]] | None = None
        slurm_node: Future[SlurmNode | None] | None = None
        if request.slurm:
            jobs = self._submit(self.slurm.jobs_on_node, request.node)
            slurm_node = self._submit(self.slurm.node_now, request.node)
        raw, opt_out = looked.result()
        node = node_info_from_json(raw, self.kubernetes.policy.labels.gpu_resource) if raw is not None else None
        if raw is None or opt_out.opted_out:
            return Protection(node=node, opt_out=opt_out, jobs=jobs.result() if jobs is not None else None)
        if self.breaker is not None and request.cluster and not request.dry_run:
            decision = self.breaker.decide(request.cluster, request.node)
            if decision.held is not None:  # nothing written: the run waits for its lease
                return Protection(node=node, opt_out=opt_out, jobs=jobs.result() if jobs is not None else None,
                                  held=decision.held, held_by=decision.held_by, trip=decision.trip)
        writes: list[Future[ActionResult]] = []
        if request.taint is None:
            writes.append(self._submit(self.kubernetes.cordon, NodeTarget(
                node=request.node, workflow_id=request.workflow_id, reason=request.reason, dry_run=request.dry_run),
                raw))
        else:
            writes.append(self._submit(self.kubernetes.taint, TaintRequest(
                node=request.node, taint=request.taint, dry_run=request.dry_run, workflow_id=request.workflow_id,
                reason=request.reason), raw))
        if slurm_node is not None:
            writes.append(self._submit(self._drain, request, slurm_node))
        # Every write and read is waited for before a failure is raised: a retry redoes only what is missing.
        errors = [w.exception() for w in writes] + ([jobs.exception()] if jobs is not None else [])
        if (error := next((e for e in errors if e is not None), None)) is not None:
            raise error
        return Protection(node=node, opt_out=opt_out, jobs=jobs.result() if jobs is not None else None,
                          actions=[w.result() for w in writes])

    def _drain(self, request: ProtectRequest, read: Future[SlurmNode | None]) -> ActionResult:
        # `read` was submitted first, so it runs before this waits on it (the pool is first in, first out).
        drain = SetSlurmNodeState(node=request.node, state=SlurmNodeState.DRAIN, reason=request.reason,
                                  dry_run=request.dry_run)
        return self.slurm.set_state(drain, read.result())

    def activities(self) -> list[Callable[..., Any]]:
        return [self.protect_node]
