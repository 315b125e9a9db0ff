"""The dashboard and the alert rules tell the truth: Debian's Prometheus scrapes a live worker, the
webhook and the node agents (on the fake NVML) while alerts posted to the webhook run two real
repairs of a minute each; then every metric the dashboard and the rules read is there, every panel's
expression evaluates (and shows data where a healthy fleet has some), the time-to-repair panel
shows a finite p50, and the shipped rules evaluate without error on that data."""

from __future__ import annotations

import asyncio
import json
import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from devstack.agent_server import ServedAgents
from devstack.controllers import provider_controller
from devstack.slurm_cluster import free_port
from devstack.webhook_thread import WebhookThread
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import RunbookStatus
from tests.alerts import payload, xid_alert
from tests.harness import settings_for, worker_for
from tests.prometheus_server import LocalPrometheus
from tests.runbook_stack import Stack
from workers.temporal_client import connect
from workers.worker import metrics_runtime

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/kubernetes/base/dashboards/fleetmedic.json"
RULES = ROOT / "deploy/prometheus/fleetmedic-rules.yaml"
TOKEN = "webhook-secret"
REPLACE_S = 40  # the provider's replacement: each repair takes about a minute, as real ones take minutes
# Panels that are empty on a healthy fleet by design (they count what is broken).
EMPTY_WHEN_HEALTHY = ("fleetmedic_infiniband_port_state != 4",)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target, with the `$cluster` variable set to all."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$cluster", ".*"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bfleetmedic_[a-z_]+", text))


def post(webhook: str, token: str, alert: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{webhook}/v1/alerts/alertmanager", json=payload(alert), timeout=30,
                      headers={"Authorization": f"Bearer {token}"})


def post_job_ends(webhook: str, cluster: str) -> httpx.Response:
    now = datetime.now(UTC)
    failed = {"job": "team/llm-1", "nodes": ["gpu-node-0", "gpu-node-1"], "state": "FAILED", "cluster": cluster,
              "started_at": (now - timedelta(hours=2)).isoformat(), "ended_at": (now - timedelta(hours=1)).isoformat(),
              "output_lines": ["NCCL WARN Timeout: collective operation timeout"]}
    done = {**failed, "state": "COMPLETED", "output_lines": [], "started_at": (now - timedelta(minutes=50)).isoformat(),
            "ended_at": now.isoformat()}
    return httpx.post(f"{webhook}/v1/jobs/ended", json={"jobs": [failed, done]}, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"})


async def test_every_panel_and_rule_reads_live_metrics_in_a_real_prometheus(stack: Stack, tmp_path: Path) -> None:
    nodes = ["gpu-node-0", "gpu-node-1"]
    address = stack.client.service_client.config.target_host
    port = free_port()
    metered = await connect(runtime=metrics_runtime(port, "127.0.0.1"), target_host=address)
    with ServedAgents(nodes, tmp_path / "agents") as agents, \
            WebhookThread(address, stack.task_queue, TOKEN) as webhook:
        targets = {"worker": f"http://127.0.0.1:{port}", "webhook": webhook.url,
                   **{f"agent-{node}": f"{agents.url}/{node}/metrics" for node in nodes}}
        settings = settings_for(stack.task_queue, stack.kube, slurm=stack.slurm, slack=stack.slack,
                                provider=stack.provider, agent_url=agents.url_template, agent_token=agents.token)
        with LocalPrometheus(tmp_path / "prometheus", targets, [RULES]) as prometheus, \
                provider_controller(stack.kube, stack.provider, REPLACE_S):
            async with worker_for(metered, settings, stack.policy()):
                # Two repairs of the same runbook, apart: Prometheus sees the first one's histogram
                # before the second lands, so `rate` over the window counts a repair (a series'
                # first sample alone is no increase).
                handles = []
                for node in nodes:
                    alert = xid_alert(node, stack.cluster, fingerprint=f"fp-{node}")
                    answer = await asyncio.to_thread(post, webhook.url, TOKEN, alert)
                    assert answer.status_code == 202, answer.text
                    handles.append(stack.client.get_workflow_handle(
                        node_workflow_id("xid-recovery", stack.cluster, node), result_type=RunbookStatus))
                    if node == nodes[0]:
                        await asyncio.sleep(REPLACE_S / 2)
                # Two training jobs end (a framework's hook): one failed, one completed after a restart.
                ended = await asyncio.to_thread(post_job_ends, webhook.url, stack.cluster)
                assert [a["action"] for a in ended.json()["jobs"]] == ["recorded"] * 2, ended.text
                refused = await asyncio.to_thread(post, webhook.url, "wrong-token", xid_alert("gpu-node-2", "x"))
                assert refused.status_code == 401
                for handle in handles:
                    report = await asyncio.wait_for(handle.result(), REPLACE_S * 6)
                    assert report.outcome == "remediated", report.decisions
                    # The node agent was asked: validation passed on the fake NVML.
                    assert any(d.step == "validate" and "passed" in d.result for d in report.decisions), \
                        report.decisions
                await asyncio.sleep(3)  # a few scrapes after the last repair

                wanted = metric_names(DASHBOARD.read_text()) | metric_names(RULES.read_text())
                missing = sorted(name for name in wanted if not prometheus.query(f"count({name})"))
                assert not missing, f"used by the dashboard or the rules, absent in Prometheus: {missing}"

                empty = []
                for title, expr in panel_queries():
                    result = prometheus.query(expr)  # a bad expression is an error answer: fails here
                    if not result and not any(part in expr for part in EMPTY_WHEN_HEALTHY):
                        empty.append(f"{title}: {expr}")
                assert not empty, f"panels without data after two repairs: {empty}"

                p50 = next(expr for title, expr in panel_queries()
                           if title.startswith("Time to repair") and "0.5" in expr)
                values = [float(sample["value"][1]) for sample in prometheus.query(p50)]
                assert values and all(math.isfinite(v) for v in values), values
                assert all(REPLACE_S / 2 <= v <= 600 for v in values), values  # seconds: about a minute
                lost = prometheus.query('sum(increase(fleetmedic_gpu_hours_lost_sum[1d]))')
                assert lost and float(lost[0]["value"][1]) > 0, lost

                groups = prometheus.api("rules")["groups"]
                rules = [rule for group in groups for rule in group["rules"]]
                assert rules and all(rule["health"] == "ok" for rule in rules), \
                    [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]


def test_promtool_checks_every_panels_expression(tmp_path: Path) -> None:
    """Each panel's PromQL as promtool parses it: one recording rule per target, checked offline."""
    import shutil
    import subprocess

    import yaml

    from tests.conftest import require

    promtool = shutil.which("promtool")
    require(promtool is not None, "Debian's prometheus (promtool)")
    queries = panel_queries()
    rules = {"groups": [{"name": "dashboard-panels", "rules": [
        {"record": f"fleetmedic:panel_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump(rules))
    check = subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(queries)} rules found" in check.stdout, check.stdout
    # And promtool is the judge: a broken expression is refused.
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "fleetmedic:broken", "expr": queries[0][1].replace(")", "", 1)}]}]}))
    assert subprocess.run([str(promtool), "check", "rules", str(path)], capture_output=True,
                          timeout=60).returncode != 0
