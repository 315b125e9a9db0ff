"""The node agent on a real NVIDIA GPU, through the driver's own NVML (`pynvml` from nvidia-ml-py),
read against `nvidia-smi` from the outside: what every other test of the agent does with
devstack.fake_nvml, here with the driver the fake imitates.

Marked `nvidia_gpu`: collected only where FLEETMEDIC_GPU_TESTS=1 says a GPU is there (a lent
device machine: `scripts/test-gpu`); CI has none, and there these tests are deselected, not
skipped. The work on the GPU is a PyTorch matrix product in a process of its own, as a training
job's would be. The GPU is never reset: a lent GPU must not be, so the agent's resetter here
records the call, and what is tested is the guard in front of it with the driver's own process list.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from tests.test_node_agent import scrape
from workers.node_agent.app import Agent
from workers.node_agent.metrics import METRICS
from workers.node_agent.serve import build_agent

pytestmark = pytest.mark.nvidia_gpu

TOKEN = "gpu-test-token"
SMI_FIELDS = ("index", "uuid", "name", "memory.total", "temperature.gpu", "power.draw")
# A training job's work, in a process of its own: bf16 matrix products until stdin closes.
LOAD = """
import sys, threading, torch
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
(a @ b).sum().item()
print("ready", flush=True)
while not stop.is_set():
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
"""


def nvidia_smi() -> list[dict[str, str]]:
    done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30, check=True)
    return [dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
            for line in done.stdout.splitlines() if line.strip()]


@dataclass
class GpuWorld:
    agent: Agent
    smi: list[dict[str, str]]
    resets: list[int] = field(default_factory=list)
    cordoned: bool = False


@pytest.fixture
def gpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[GpuWorld]:
    caplog.set_level(logging.INFO, logger="fleetmedic.agent")
    smi = nvidia_smi()
    assert smi, "nvidia-smi lists no GPU"
    settings = Settings(node_name="gpu-test", agent_token=TOKEN, agent_expected_gpus=len(smi),
                        infiniband_root=str(tmp_path / "no-infiniband"))
    resets: list[int] = []
    world: GpuWorld

    def cordoned() -> bool:
        return world.cordoned

    agent = build_agent(settings, Policy(), resetter=resets.append, node_cordoned=cordoned)  # the real pynvml
    world = GpuWorld(agent=agent, smi=smi, resets=resets)
    assert agent.nvml is not None, f"NVML did not start: {agent.nvml_error}"
    yield world
    agent.nvml.stop()


@pytest.fixture
async def http(gpu: GpuWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=gpu.agent.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
        yield client


class GpuLoad:
    """Matrix products on GPU 0 in a child process, stopped by closing its stdin (then by its PID)."""

    def __enter__(self) -> GpuLoad:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
        self.process = subprocess.Popen([sys.executable, "-c", LOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.process.stdout.readline()),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        reader.join(120)
        if not ready or ready[0].strip() != "ready":
            self.__exit__()
            raise AssertionError(f"the GPU load did not start: {self.process.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def gauge(metrics: dict[str, list[Any]], name: str, gpu: int, **labels: str) -> float | None:
    found = [s.value for s in metrics.get(name, []) if s.labels.get("gpu") == str(gpu)
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, found)
    return float(found[0]) if found else None


async def test_the_agents_readings_match_nvidia_smi(gpu: GpuWorld, http: httpx.AsyncClient,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    health = await http.get("/healthz")
    assert health.status_code == 200 and health.json()["gpus"] == len(gpu.smi), health.text
    metrics = await scrape(http)
    assert set(metrics) <= set(METRICS), set(metrics) - set(METRICS)
    assert [s.value for s in metrics["fleetmedic_gpu_count"]] == [len(gpu.smi)]
    for row in gpu.smi:
        index = int(row["index"])
        info = [s.labels for s in metrics["fleetmedic_gpu_info"] if s.labels["gpu"] == str(index)]
        assert info == [{"node": "gpu-test", "gpu": str(index), "uuid": row["uuid"], "model": row["name"]}]
        assert gauge(metrics, "fleetmedic_gpu_memory_total_bytes", index) == int(row["memory.total"]) * 2**20
        temperature = gauge(metrics, "fleetmedic_gpu_temperature_celsius", index)
        assert temperature is not None and abs(temperature - float(row["temperature.gpu"])) <= 5
        power = gauge(metrics, "fleetmedic_gpu_power_watts", index)
        assert power is not None and 0 < power < 2000
        used = gauge(metrics, "fleetmedic_gpu_memory_used_bytes", index)
        assert used is not None and 0 <= used <= int(row["memory.total"]) * 2**20
        for name in ("fleetmedic_gpu_utilization_ratio", "fleetmedic_gpu_memory_utilization_ratio"):
            ratio = gauge(metrics, name, index)
            assert ratio is not None and 0 <= ratio <= 1, (name, ratio)
    # What the driver does not answer is absent and said once, by name, never a scrape error.
    said = " | ".join(r.getMessage() for r in caplog.records if "its metric stays absent" in r.getMessage())
    absent = sorted(name for name in METRICS if name.startswith("fleetmedic_gpu_") and name not in metrics
                    and name not in ("fleetmedic_gpu_tensor_active_ratio",))  # GPM needs a second sample
    print(f"\nabsent on this GPU: {absent}\nthe agent said: {said or 'nothing'}")
    # Any other NVML error is the adapter asking the driver wrongly (a wrong argument or structure).
    errors = [r.getMessage() for r in caplog.records
              if r.name == "fleetmedic.agent.nvml" and r.levelno >= logging.WARNING]
    assert not errors, errors
    second = await scrape(http)
    assert set(second) >= set(metrics)


async def test_tensor_activity_follows_real_work(gpu: GpuWorld, http: httpx.AsyncClient) -> None:
    """GPM's tensor activity, the metric that tells real training work from a GPU that only looks
    busy: high while matrix products run, near nothing once they stop."""
    await scrape(http)  # GPM reports between two samples: this is the first
    with GpuLoad():
        await scrape(http)  # the load's start is behind this sample
        time.sleep(3)
        busy = await scrape(http)
    time.sleep(1)
    await scrape(http)
    time.sleep(3)
    idle = await scrape(http)
    tensor_busy = gauge(busy, "fleetmedic_gpu_tensor_active_ratio", 0)
    tensor_idle = gauge(idle, "fleetmedic_gpu_tensor_active_ratio", 0)
    utilization = gauge(busy, "fleetmedic_gpu_utilization_ratio", 0)
    print(f"\ntensor activity busy {tensor_busy}, idle {tensor_idle}; utilization busy {utilization}, "
          f"idle {gauge(idle, 'fleetmedic_gpu_utilization_ratio', 0)}")
    assert tensor_busy is not None and tensor_idle is not None, "no GPM tensor activity on this GPU"
    assert 0.3 <= tensor_busy <= 1.0, tensor_busy
    assert 0 <= tensor_idle <= 0.05, tensor_idle
    assert utilization is not None and utilization >= 0.5


async def test_a_reset_waits_for_the_cordon_and_for_the_gpus_processes(gpu: GpuWorld,
                                                                        http: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    refused = await http.post("/v1/gpus/0/reset", headers=auth)
    assert refused.status_code == 409 and "not cordoned" in refused.text, refused.text
    gpu.cordoned = True
    assert gpu.agent.nvml is not None
    with GpuLoad() as load:
        assert load.pid in gpu.agent.nvml.processes(0)  # the driver's own list names the job's process
        busy = await http.post("/v1/gpus/0/reset", headers=auth)
        assert busy.status_code == 409 and str(load.pid) in busy.text, busy.text
    deadline = time.monotonic() + 30
    while gpu.agent.nvml.processes(0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gpu.resets == []
    allowed = await http.post("/v1/gpus/0/reset", headers=auth)
    assert allowed.status_code == 200, allowed.text
    assert gpu.resets == [0]  # recorded, not done: see the module's docstring
    missing = await http.post(f"/v1/gpus/{len(gpu.smi)}/reset", headers=auth)
    assert missing.status_code == 404


async def test_a_healthy_gpu_validates_and_its_xid_events_are_watched(gpu: GpuWorld, http: httpx.AsyncClient,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    since = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    response = await http.get("/v1/validate", params={"since": since})
    assert response.status_code == 200, response.text
    body = response.json()
    checks = {c["name"]: c for c in body["checks"]}
    print(f"\nvalidate: {checks}")
    assert checks["gpus_present"] == {"name": "gpus_present", "passed": True,
                                      "value": f"{len(gpu.smi)}/{len(gpu.smi)}"}
    assert checks["gpus_answer"]["value"] == f"{len(gpu.smi)}/{len(gpu.smi)}"  # no NVML error but "not supported"
    assert checks["temperature"]["passed"] and checks["no_xid_since"]["value"] == "none"
    assert body["passed"], checks
    # The XID watch registered on the driver's event set and waits on it.
    assert not [r for r in caplog.records if "XID events unavailable" in r.getMessage()]
    watcher = gpu.agent.nvml._watcher if gpu.agent.nvml else None
    assert watcher is not None and watcher.is_alive()
    gpus = (await http.get("/v1/gpus")).json()["gpus"]
    assert [g["gpu"] for g in gpus] == list(range(len(gpu.smi)))
    assert all(g["temperature_c"] is not None for g in gpus)
