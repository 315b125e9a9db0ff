"""On a Temporal as users deploy it (devstack/temporal_production.py: temporal-server from
go.temporal.io/server, PostgreSQL for persistence and SQL visibility, 4 history shards, a namespace
registered through the API), what differs from the dev server: a namespace's search attributes are
added by FleetMedic's worker and usable only once the frontend has seen them; the operator's
commands read SQL visibility; a run's history, read back from PostgreSQL, replays on this code.

The core end-to-end tests (XID, the webhook, Alertmanager, crash safety) run here too: they carry
the `temporal_production` marker and run once on each server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Replayer

from devstack.temporal_production import ProductionTemporal
from fleetmedic.converter import data_converter
from fleetmedic.ids import FLEET_CLUSTER, FLEET_NODE, SEARCH_ATTRIBUTES
from tests.runbook_stack import Stack, status_when
from tests.test_replay import STRICT
from workers.temporal_client import connect, ensure_search_attributes
from workflows.registry import WORKFLOWS

ON_PRODUCTION = pytest.mark.parametrize("temporal_server", ["production"], indirect=True)


@ON_PRODUCTION
async def test_a_run_read_back_from_postgresql_replays_and_the_cli_reads_sql_visibility(stack: Stack) -> None:
    """An operator's `fleetmedic status` finds the open run through SQL visibility (its query names
    FleetMedic's search attributes), `audit` renders its history, and that history, as PostgreSQL
    keeps it, replays on this code in the strict sandbox."""
    seen: dict[str, Any] = {}

    async def operator_looks(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step not in ("", "start"))
        for _ in range(50):  # visibility is written after the run's own transaction, a moment later
            status = await asyncio.to_thread(stack.cli, "status", "-o", "json")
            assert status.returncode == 0, status.stderr
            seen["status"] = json.loads(status.stdout)
            if any(r["workflow_id"] == handle.id for r in seen["status"]["runs"]):
                return
            await asyncio.sleep(0.2)

    report, handle = await stack.run("gpu-node-1", during=operator_looks)
    assert report.outcome == "remediated", report.decisions
    assert handle.id in [r["workflow_id"] for r in seen["status"]["runs"]], seen
    listed = [w async for w in stack.client.list_workflows(
        f'{FLEET_CLUSTER.name} = "{stack.cluster}" AND {FLEET_NODE.name} = "gpu-node-1"')]
    assert [w.id for w in listed] == [handle.id]
    audit = await asyncio.to_thread(stack.cli, "audit", handle.id)
    assert audit.returncode == 0 and "remediated" in audit.stdout, audit.stderr
    history = await handle.fetch_history()
    assert len(history.events) > 20
    await Replayer(workflows=WORKFLOWS, data_converter=data_converter, workflow_runner=STRICT).replay_workflow(history)


async def test_a_new_namespace_gets_its_search_attributes_from_the_worker_usable_at_once(
        production_temporal: ProductionTemporal, task_queue: str) -> None:
    """A namespace just created has none of FleetMedic's search attributes. The worker's start adds
    them through the operator API and returns only once the frontend takes them: the webhook's first
    start after it names them all and is not refused (on this server the frontend learns of new
    attributes at its next namespace-cache refresh, about 2 s later)."""
    namespace = f"site-{task_queue}"
    await production_temporal.register_namespace(namespace)
    client = await connect(target_host=production_temporal.address, namespace=namespace)
    added = await ensure_search_attributes(client)
    assert added == sorted(key.name for key in SEARCH_ATTRIBUTES)
    everything = TypedSearchAttributes([SearchAttributePair(key, _sample(key)) for key in SEARCH_ATTRIBUTES])
    handle = await client.start_workflow("xid-recovery", id=f"first-{task_queue}", task_queue=task_queue,
                                         search_attributes=everything)
    await handle.terminate("test over")
    assert await ensure_search_attributes(client) == []  # a second worker adds nothing


def _sample(key: Any) -> Any:
    return {"KEYWORD": "x", "INT": 79, "BOOL": False}[key.indexed_value_type.name]
