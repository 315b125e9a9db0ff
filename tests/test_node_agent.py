"""The GPU node agent against a fake NVML and a sysfs tree written by the test: metrics parse with
prometheus-client's parser and carry the right values and labels; validation passes and fails for
the right reasons; the reset endpoint's guards; the worker's client against the real agent."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from prometheus_client.parser import text_string_to_metric_families

from activities.agent import AgentActivities
from devstack import fleet
from devstack.fake_nvml import FakeGpu, FakeNvml
from devstack.fake_sysfs import write_fabric, write_port
from devstack.kube_world import RealKube
from devstack.slurm_cluster import free_port
from fleetmedic.models import GpuResetRequest, Validate
from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from tests.harness import run_activity
from workers.node_agent.app import Agent
from workers.node_agent.metrics import METRICS
from workers.node_agent.serve import build_agent, node_cordon_reader

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "agent-token"


class World:
    def __init__(self, tmp_path: Path, gpus: list[FakeGpu] | None = None, expected: int | None = 8,
                 token: str | None = TOKEN) -> None:
        self.lib = FakeNvml(gpus)
        self.ib_root = write_fabric(tmp_path / "infiniband", 2)
        self.cordoned = False
        self.resets: list[int] = []
        settings = Settings(node_name="gpu-node-4", agent_token=token, agent_expected_gpus=expected,
                            infiniband_root=str(self.ib_root))
        self.agent = build_agent(settings, Policy(), lib=self.lib, resetter=self.resets.append,
                                 node_cordoned=lambda: self.cordoned)

    def close(self) -> None:
        if self.agent.nvml is not None:
            self.agent.nvml.stop()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


@pytest.fixture
async def http(world: World) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.agent.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
        yield client


async def scrape(http: httpx.AsyncClient) -> dict[str, list[Any]]:
    response = await http.get("/metrics")
    assert response.status_code == 200, response.text
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def value(samples: list[Any], name: str | None = None, **labels: str) -> float:
    found = [s.value for s in samples if (name is None or s.name == name)
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, found)
    return float(found[0])


async def test_metrics_carry_gpu_nvlink_xid_and_infiniband_values_with_labels(world: World, http: httpx.AsyncClient
                                                                              ) -> None:
    gpu = world.lib.gpus[3]
    gpu.temperature_c, gpu.ecc, gpu.remapped = 81, (12, 1), (3, 1, 1, 0)
    gpu.throttle = world.lib.nvmlClocksThrottleReasonHwThermalSlowdown
    gpu.link_down, gpu.link_errors = {7}, {(7, "crc_flit"): 40, (7, "replay"): 3, (2, "recovery"): 1}
    write_port(world.ib_root, "mlx5_1", state=1, counters={"symbol_error": 17, "link_downed": 2,
                                                           "port_xmit_data": 1000, "port_xmit_wait": 55},
               hw_counters={"out_of_buffer": 9})
    world.lib.emit_xid(3, 79)
    deadline = time.monotonic() + 5
    while not world.agent.nvml.xid_events and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)

    metrics = await scrape(http)
    node = {"node": "gpu-node-4"}
    assert value(metrics["fleetmedic_gpu_count"], **node) == 8
    assert value(metrics["fleetmedic_gpu_expected"], **node) == 8
    assert value(metrics["fleetmedic_gpu_temperature_celsius"], gpu="3", **node) == 81
    assert value(metrics["fleetmedic_gpu_thermal_margin_celsius"], gpu="3") == 6
    assert value(metrics["fleetmedic_gpu_clock_throttled"], gpu="3", reason="hw_thermal_slowdown") == 1
    assert value(metrics["fleetmedic_gpu_clock_throttled"], gpu="3", reason="sw_power_cap") == 0
    assert value(metrics["fleetmedic_gpu_power_watts"], gpu="0") == 350
    assert value(metrics["fleetmedic_gpu_utilization_ratio"], gpu="0") == 0.9
    assert value(metrics["fleetmedic_gpu_memory_total_bytes"], gpu="0") == 80 * 2**30
    assert value(metrics["fleetmedic_gpu_ecc_errors"], "fleetmedic_gpu_ecc_errors_total", gpu="3",
                 type="corrected") == 12
    assert value(metrics["fleetmedic_gpu_remapped_rows"], "fleetmedic_gpu_remapped_rows_total", gpu="3",
                 cause="uncorrectable") == 1
    assert value(metrics["fleetmedic_gpu_row_remap_pending"], gpu="3") == 1
    # XID: the event counted by GPU and XID; the catalog's other XIDs exported at 0 so `increase()` sees the first.
    xids = metrics["fleetmedic_gpu_xid_errors"]
    assert value(xids, "fleetmedic_gpu_xid_errors_total", gpu="3", xid="79", **node) == 1
    assert value(xids, "fleetmedic_gpu_xid_errors_total", gpu="0", xid="79") == 0
    assert value(xids, "fleetmedic_gpu_xid_errors_total", gpu="3", xid="48") == 0
    # NVLink: 18 links per GPU, state and error counters by type.
    links = metrics["fleetmedic_nvlink_link_up"]
    assert len([s for s in links if s.labels["gpu"] == "3"]) == 18
    assert value(links, gpu="3", link="7") == 0 and value(links, gpu="3", link="6") == 1
    errors = metrics["fleetmedic_nvlink_errors"]
    assert value(errors, "fleetmedic_nvlink_errors_total", gpu="3", link="7", type="crc_flit") == 40
    assert value(errors, "fleetmedic_nvlink_errors_total", gpu="3", link="7", type="replay") == 3
    # InfiniBand from sysfs.
    ib = {"device": "mlx5_1", "port": "1"}
    assert value(metrics["fleetmedic_infiniband_port_state"], **ib) == 1
    assert value(metrics["fleetmedic_infiniband_port_state"], device="mlx5_0", port="1") == 4
    assert value(metrics["fleetmedic_infiniband_symbol_errors"], "fleetmedic_infiniband_symbol_errors_total",
                 **ib) == 17
    assert value(metrics["fleetmedic_infiniband_link_downed"], "fleetmedic_infiniband_link_downed_total", **ib) == 2
    assert value(metrics["fleetmedic_infiniband_transmit_wait"], "fleetmedic_infiniband_transmit_wait_total",
                 **ib) == 55
    assert value(metrics["fleetmedic_infiniband_data_bytes"], "fleetmedic_infiniband_data_bytes_total",
                 direction="transmit", **ib) == 4000  # 4-byte words
    assert value(metrics["fleetmedic_infiniband_hw_counter"], "fleetmedic_infiniband_hw_counter_total",
                 counter="out_of_buffer", **ib) == 9


async def test_tensor_activity_comes_from_gpm_from_the_second_scrape(world: World, http: httpx.AsyncClient) -> None:
    world.lib.gpus[0].tensor_busy = 0.73
    world.lib.gpus[1].gpm = False  # an Ampere card: no GPM
    first = await scrape(http)
    assert "fleetmedic_gpu_tensor_active_ratio" not in first  # GPM needs two samples
    second = await scrape(http)
    tensor = second["fleetmedic_gpu_tensor_active_ratio"]
    assert value(tensor, gpu="0") == pytest.approx(0.73)
    assert not [s for s in tensor if s.labels["gpu"] == "1"]


async def test_an_unsupported_query_leaves_its_metric_absent_and_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gpus = [FakeGpu() for _ in range(2)]
    gpus[1].unsupported = {"nvmlDeviceGetMarginTemperature", "nvmlDeviceGetRemappedRows"}
    gpus[1].nvlinks = 0  # a PCIe card
    world = World(tmp_path, gpus, expected=2)
    try:
        transport = httpx.ASGITransport(app=world.agent.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
            with caplog.at_level(logging.INFO, logger="fleetmedic.agent.nvml"):
                await scrape(http)
                metrics = await scrape(http)
    finally:
        world.close()
    margins = metrics["fleetmedic_gpu_thermal_margin_celsius"]
    assert [s.labels["gpu"] for s in margins] == ["0"]
    assert [s.labels["gpu"] for s in metrics["fleetmedic_gpu_row_remap_failed"]] == ["0"]
    assert {s.labels["gpu"] for s in metrics["fleetmedic_nvlink_link_up"]} == {"0"}
    assert value(metrics["fleetmedic_gpu_temperature_celsius"], gpu="1") == 55  # the rest still reads
    notes = [r.getMessage() for r in caplog.records if "GPU 1: thermal margin" in r.getMessage()]
    assert len(notes) == 1 and "not supported" in notes[0]


def test_every_agent_metric_the_shipped_rules_read_is_exported() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "fleetmedic-rules.yaml").read_text())
    used = {name for group in rules["groups"] for rule in group["rules"]
            if rule.get("labels", {}).get("source") == "fleetmedic-agent"
            for name in re.findall(r"fleetmedic_[a-z_]+", rule["expr"])}
    exported = set(METRICS) | {f"{name}_total" for name, (kind, _) in METRICS.items() if kind == "counter"}
    assert used and used <= exported, used - exported


async def test_validation_passes_on_a_healthy_node(world: World, http: httpx.AsyncClient) -> None:
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    answer = (await http.get("/v1/validate", params={"since": since, "expected_gpus": "8"})).json()
    assert answer["passed"] is True, answer
    checks = {c["name"]: c for c in answer["checks"]}
    assert set(checks) == {"gpus_present", "gpus_answer", "temperature", "no_xid_since", "nvlink_up",
                           "infiniband_active"}
    assert checks["gpus_present"]["value"] == "8/8" and checks["gpus_answer"]["value"] == "8/8"
    assert checks["nvlink_up"]["value"] == "144/144 up"
    assert checks["infiniband_active"]["value"] == "2/2 active"


async def test_validation_fails_for_each_reason_with_its_value(world: World, http: httpx.AsyncClient) -> None:
    before = datetime.now(UTC) - timedelta(seconds=1)
    world.agent.nvml.record_xid(5, 79)  # type: ignore[union-attr]
    world.lib.gpus[2].temperature_c = 83
    world.lib.gpus[6].link_down = {11}
    write_port(world.ib_root, "mlx5_0", state=2)
    answer = (await http.get("/v1/validate", params={"since": before.isoformat(), "expected_gpus": "9"})).json()
    assert answer["passed"] is False
    checks = {c["name"]: (c["passed"], c["value"]) for c in answer["checks"]}
    assert checks["gpus_present"] == (False, "8/9")
    assert checks["temperature"] == (False, "83 C max (GPU 2; limit 78 C)")
    assert checks["no_xid_since"][0] is False and checks["no_xid_since"][1].startswith("XID 79 on GPU 5 at ")
    assert checks["nvlink_up"] == (False, "down: GPU 6 link 11")
    assert checks["infiniband_active"] == (False, "not active: mlx5_0/1 INIT")
    # An XID before `since` (the repair) does not count against the node.
    later = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    answer = (await http.get("/v1/validate", params={"since": later})).json()
    assert dict((c["name"], c["passed"]) for c in answer["checks"])["no_xid_since"] is True
    bad = await http.get("/v1/validate", params={"since": "yesterday"})
    assert bad.status_code == 400 and "bad query" in bad.json()["error"]


async def test_a_gpu_that_fell_off_the_bus_fails_validation(world: World, http: httpx.AsyncClient,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """NVML keeps the handle of a GPU that fell off the bus, and every query of it answers "GPU is
    lost". It is counted present, its temperature is merely missing beside the others': only its
    errors tell it apart, and a node with it must not go back to service."""
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    world.lib.gpus[5].lost = True
    answer = (await http.get("/v1/validate", params={"since": since, "expected_gpus": "8"})).json()
    checks = {c["name"]: (c["passed"], c["value"]) for c in answer["checks"]}
    assert answer["passed"] is False
    assert checks["gpus_answer"] == (False, "GPU 5: uuid: GPU is lost, name: GPU is lost, temperature: GPU is lost")
    assert checks["gpus_present"] == (True, "8/8") and checks["temperature"][0] is True  # what let it through
    # The scrape goes on without the lost GPU's series, and says so once.
    metrics = await scrape(http)
    reading = {s.labels["gpu"] for s in metrics["fleetmedic_gpu_temperature_celsius"]}
    assert reading == {str(i) for i in range(8) if i != 5}
    await scrape(http)
    assert len([r for r in caplog.records if r.getMessage() == "GPU 5: temperature failed: GPU is lost"]) == 1
    # Back on the bus (a reset, a reboot): it answers again and the node passes.
    world.lib.gpus[5].lost = False
    answer = (await http.get("/v1/validate", params={"since": since, "expected_gpus": "8"})).json()
    assert answer["passed"] is True, answer


async def test_gpu_readings_for_hot_gpu_pull(world: World, http: httpx.AsyncClient) -> None:
    world.lib.gpus[3].temperature_c = 84
    answer = (await http.get("/v1/gpus")).json()
    assert answer["gpus"][3] == {"gpu": 3, "temperature_c": 84.0, "thermal_margin_c": 3}


async def test_reset_needs_the_token_a_cordoned_node_and_an_idle_gpu(world: World, http: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (await http.post("/v1/gpus/3/reset")).status_code == 401
    assert (await http.post("/v1/gpus/3/reset", headers={"Authorization": "Bearer wrong"})).status_code == 401
    refused = await http.post("/v1/gpus/3/reset", headers=auth)
    assert refused.status_code == 409 and "not cordoned" in refused.json()["error"]
    world.cordoned = True
    world.lib.gpus[3].processes = [4242]
    busy = await http.post("/v1/gpus/3/reset", headers=auth)
    assert busy.status_code == 409 and "[4242]" in busy.json()["error"]
    assert (await http.post("/v1/gpus/8/reset", headers=auth)).status_code == 404
    assert world.resets == []
    world.lib.gpus[3].processes = []
    done = await http.post("/v1/gpus/3/reset", headers=auth)
    assert done.status_code == 200 and done.json()["detail"] == "GPU 3 reset"
    assert world.resets == [3]


async def test_without_a_token_resets_are_disabled(tmp_path: Path) -> None:
    world = World(tmp_path, token=None)
    world.cordoned = True
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=world.agent.app()),
                                     base_url="http://agent") as http:
            answer = await http.post("/v1/gpus/0/reset", headers={"Authorization": "Bearer "})
    finally:
        world.close()
    assert answer.status_code == 403 and world.resets == []


@pytest.mark.not_worker_rbac  # the agent's own ServiceAccount (nodes get), not the worker's
def test_the_cordon_check_reads_the_node_from_the_kubernetes_api(kube: RealKube) -> None:
    kube.put(fleet.node("gpu-node-4"))
    settings = Settings(kubeconfig=str(kube.kubeconfig))  # type: ignore[attr-defined]
    cordoned = node_cordon_reader(settings, "gpu-node-4")
    assert cordoned() is False
    node = kube.get("v1", "Node", "gpu-node-4")
    assert node is not None
    node["spec"]["unschedulable"] = True
    kube.put(node)
    assert cordoned() is True


def test_the_agent_without_nvml_serves_infiniband_and_says_unhealthy(tmp_path: Path) -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise self.NVMLError(self.NVML_ERROR_DRIVER_NOT_LOADED)

    settings = Settings(node_name="gpu-x", infiniband_root=str(write_fabric(tmp_path / "ib", 1)))
    agent = build_agent(settings, Policy(), lib=Broken(), node_cordoned=lambda: True)
    assert isinstance(agent, Agent) and agent.nvml is None and "Driver Not Loaded" in agent.nvml_error


class ServedAgent:
    """The real agent on a real port, for the worker's HTTP client."""

    def __init__(self, agent: Agent) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(agent.app(), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def test_the_workers_agent_client_speaks_the_real_agents_api(world: World) -> None:
    world.lib.gpus[3].temperature_c = 80
    world.cordoned = True
    with ServedAgent(world.agent) as url:
        client = AgentActivities(url, TOKEN)  # one node: the template needs no {node}
        assert run_activity(client.available, "gpu-node-4") is True
        readings = run_activity(client.gpus, "gpu-node-4")
        assert readings.available and readings.gpus[3].temperature_c == 80
        verdict = run_activity(client.validate, Validate(node="gpu-node-4", since=datetime.now(UTC),
                                                         expected_gpus=8))
        assert verdict.available and not verdict.passed
        assert [c.name for c in verdict.checks if not c.passed] == ["temperature"]
        result = run_activity(client.reset_gpu, GpuResetRequest(node="gpu-node-4", gpu=3))
        assert result.changed and world.resets == [3]
