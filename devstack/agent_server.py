"""Node agents on the fake NVML, served on one loopback port under `/<node>` (the worker's agent URL
template is then `http://127.0.0.1:PORT/{node}`): the dev stack's GPU nodes, and the tests' scraped
fleet. Each node has its own FakeNvml and InfiniBand sysfs, so a dev user can heat one GPU of one
node (`POST /dev/<node>/gpus/<gpu>`, not part of the agent's API) and watch the runbook confirm it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from devstack.fake_nvml import FakeGpu, FakeNvml
from devstack.fake_sysfs import write_fabric
from devstack.slurm_cluster import free_port
from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from workers.node_agent.app import Agent
from workers.node_agent.serve import build_agent


class ServedAgents:
    """One agent per node on the fake NVML, served from a thread on a free loopback port."""

    def __init__(self, nodes: list[str], root: Path, policy: Policy | None = None, token: str = "dev-agent-token",
                 node_cordoned: Callable[[str], bool] | None = None, gpus: int = 8, port: int | None = None) -> None:
        self.token = token
        self.nvml: dict[str, FakeNvml] = {}
        self.agents: dict[str, Agent] = {}
        self.resets: dict[str, list[int]] = {}
        for node in nodes:
            lib = self.nvml[node] = FakeNvml()
            self.resets[node] = []
            settings = Settings(node_name=node, agent_token=token, agent_expected_gpus=gpus,
                                infiniband_root=str(write_fabric(root / node / "infiniband", gpus)))
            self.agents[node] = build_agent(settings, policy or Policy(), lib=lib,
                                            resetter=self.resets[node].append,
                                            node_cordoned=self._cordon_check(node, node_cordoned))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        routes: list[Any] = [Route("/dev/{node}/gpus/{gpu:int}", self._set_gpu, methods=["POST"])]
        routes += [Mount(f"/{node}", app=agent.app()) for node, agent in self.agents.items()]
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="agents")

    @staticmethod
    def _cordon_check(node: str, node_cordoned: Callable[[str], bool] | None) -> Callable[[], bool]:
        """The reset endpoint's first condition; without a reader every node counts as cordoned."""
        return (lambda: node_cordoned(node)) if node_cordoned is not None else (lambda: True)

    @property
    def url_template(self) -> str:
        return f"{self.url}/{{node}}"

    async def _set_gpu(self, request: Request) -> JSONResponse:
        """Dev only: `{"temperature_c": 84}` heats a GPU, `{"xid": 79}` makes the driver report one."""
        node, gpu = request.path_params["node"], request.path_params["gpu"]
        lib = self.nvml.get(node)
        if lib is None or not 0 <= gpu < len(lib.gpus):
            return JSONResponse({"error": f"no GPU {gpu} on {node}"}, status_code=404)
        try:
            body = await request.json()
            temperature, xid = body.get("temperature_c"), body.get("xid")
            if temperature is not None:
                lib.gpus[gpu].temperature_c = int(temperature)
            if xid is not None:
                lib.emit_xid(gpu, int(xid))
        except (ValueError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors
            return JSONResponse({"error": f'expected {{"temperature_c": 84}} or {{"xid": 79}}: {exc}'},
                                status_code=400)
        return JSONResponse({"node": node, "gpu": gpu, "temperature_c": lib.gpus[gpu].temperature_c})

    def replaced(self, node: str) -> None:
        """The provider put new hardware in: every GPU of `node` healthy and cool again."""
        lib = self.nvml.get(node)
        if lib is not None:
            lib.gpus[:] = [FakeGpu() for _ in lib.gpus]

    def __enter__(self) -> ServedAgents:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the node agents did not listen")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        for agent in self.agents.values():
            if agent.nvml is not None:
                agent.nvml.stop()
