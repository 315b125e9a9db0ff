"""`fleetmedic agent`: wire NVML, sysfs and the Kubernetes node read into the HTTP API, and serve."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import uvicorn

from fleetmedic.policy import Policy
from fleetmedic.settings import Settings
from workers.node_agent.app import Agent
from workers.node_agent.infiniband import Infiniband
from workers.node_agent.nvml import Nvml, nvidia_smi_reset

log = logging.getLogger("fleetmedic.agent")


def node_cordon_reader(settings: Settings, node: str) -> Callable[[], bool]:
    """Reads the agent's own Node (RBAC: nodes get) — the reset endpoint's first condition."""
    from kubernetes import client

    from activities.kube_client import load_api_client

    api = client.CoreV1Api(load_api_client(settings.kubeconfig))

    def cordoned() -> bool:
        return bool(api.read_node(node, _request_timeout=settings.kube_timeout_s).spec.unschedulable)

    return cordoned


def build_agent(settings: Settings, policy: Policy, lib: Any = None, resetter: Callable[[int], None] | None = None,
                node_cordoned: Callable[[], bool] | None = None, watch_xids: bool = True) -> Agent:
    """`lib`: the `pynvml` module (default) or a fake with its names."""
    if not settings.node_name:
        raise ValueError("NODE_NAME is not set: the agent labels every metric with its node "
                         "(give it from the downward API, spec.nodeName)")
    if lib is None:
        lib = importlib.import_module("pynvml")
    nvml: Nvml | None = Nvml(lib, resetter or nvidia_smi_reset)
    error = ""
    try:
        assert nvml is not None
        nvml.start(watch_xids=watch_xids)
        nvml.known_xids(sorted(policy.xid.catalog))
        log.info("NVML: %d GPU(s) on %s", nvml.count, settings.node_name)
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded ...: serve what we can, say so
        error = str(exc) or type(exc).__name__
        log.error("NVML unavailable (%s): GPU metrics are absent and /healthz answers 503", error)
        nvml = None
    return Agent(settings.node_name, nvml, Infiniband(settings.infiniband_root), token=settings.agent_token,
                 expected_gpus=settings.agent_expected_gpus, max_temperature_c=policy.thermal.threshold_c,
                 node_cordoned=node_cordoned or node_cordon_reader(settings, settings.node_name), nvml_error=error)


async def serve(settings: Settings, policy: Policy, host: str, port: int) -> None:
    agent = build_agent(settings, policy)
    config = uvicorn.Config(agent.app(), host=host, port=port, log_level="info", access_log=False)
    log.info("agent of %s listening on %s:%d", settings.node_name, host, port)
    try:
        await uvicorn.Server(config).serve()
    finally:
        if agent.nvml is not None:
            agent.nvml.stop()
