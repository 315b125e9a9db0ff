"""Workflow IDs and search attributes: the contracts operators and the webhook rely on."""

from __future__ import annotations

from typing import Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

NODE_RUNBOOKS = ("xid-recovery", "hot-gpu-pull", "nvlink-fault-replace", "suspect-node")
TRAFFIC_RUNBOOKS = ("traffic-flip", "migrate-back", "kueue-quota-sync")


def node_workflow_id(runbook: str, cluster: str, node: str) -> str:
    return f"{runbook}/{cluster}/{node}"


def cluster_workflow_id(runbook: str, cluster: str) -> str:
    return f"{runbook}/{cluster}"


def guard_workflow_id(cluster: str) -> str:
    return f"fleet-guard/{cluster}"


FLEET_RUNBOOK = SearchAttributeKey.for_keyword("FleetRunbook")
FLEET_CLUSTER = SearchAttributeKey.for_keyword("FleetCluster")
FLEET_NODE = SearchAttributeKey.for_keyword("FleetNode")
FLEET_STEP = SearchAttributeKey.for_keyword("FleetStep")
FLEET_OUTCOME = SearchAttributeKey.for_keyword("FleetOutcome")
FLEET_XID = SearchAttributeKey.for_int("FleetXid")
FLEET_DRY_RUN = SearchAttributeKey.for_bool("FleetDryRun")

SEARCH_ATTRIBUTES = (FLEET_RUNBOOK, FLEET_CLUSTER, FLEET_NODE, FLEET_STEP, FLEET_OUTCOME, FLEET_XID,
                     FLEET_DRY_RUN)


def start_attributes(runbook: str, cluster: str, node: str = "", xid: int | None = None,
                     dry_run: bool = False) -> TypedSearchAttributes:
    """Set by whoever starts a runbook, so `fleetmedic status` and the UI find it before its first step."""
    pairs: list[SearchAttributePair[Any]] = [SearchAttributePair(FLEET_RUNBOOK, runbook),
                                             SearchAttributePair(FLEET_CLUSTER, cluster),
                                             SearchAttributePair(FLEET_DRY_RUN, dry_run),
                                             SearchAttributePair(FLEET_STEP, "queued")]
    if node:
        pairs.append(SearchAttributePair(FLEET_NODE, node))
    if xid is not None:
        pairs.append(SearchAttributePair(FLEET_XID, xid))
    return TypedSearchAttributes(pairs)


def run_summary(runbook: str, cluster: str, node: str = "", xid: int | None = None, gpu: int | None = None,
                why: str = "") -> str:
    """The run's one line in the Temporal UI: `xid-recovery gpu-node-7 (XID 79, GPU 3) — alert …`."""
    facts = ", ".join(part for part in (f"XID {xid}" if xid is not None else "",
                                        f"GPU {gpu}" if gpu is not None else "") if part)
    where = f"{node} in {cluster}" if node else cluster
    return f"{runbook} {where}" + (f" ({facts})" if facts else "") + (f" — {why}" if why else "")


def guard_queue(task_queue: str) -> str:
    """The fleet guards' queue beside a worker's task queue: every run's lease goes through its
    cluster's guard, so the guard's steps never wait behind the runs' own."""
    return f"{task_queue}-guard"


def waits_queue(task_queue: str) -> str:
    """The queue of the activities that wait (activities/waits.py) beside a worker's task queue."""
    return f"{task_queue}-waits"
