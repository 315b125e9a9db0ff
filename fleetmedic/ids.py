"""Workflow IDs and search attributes: the contracts operators and the webhook rely on."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

NODE_RUNBOOKS = ("xid-recovery", "hot-gpu-pull", "nvlink-fault-replace")
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
