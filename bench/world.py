"""The world the latency and scale benchmarks run in, with FleetMedic as it is deployed: a Temporal
server — the dev server (in memory), or a production one (`--temporal production`:
temporal-server from go.temporal.io/server on PostgreSQL, commits synced to disk, as
devstack/temporal_production.py sets it up) — the real Kubernetes control plane (scripts/install-kube),
Debian's slurmctld — its nodes without slurmd, a fleet's worth of them —, the provider stand-in,
and `fleetmedic worker` and `fleetmedic webhook` as processes of their own. What an operator sees
is read from the outside: a watch on the nodes and slurmctld's own log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml
from kubernetes import client as k8s_client
from kubernetes import watch
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.start import RUNBOOK_TASK_TIMEOUT
from devstack import fleet
from devstack.dev import DevOptions, connect_when_serving, start_temporal, stop_temporal
from devstack.kube_cluster import LocalKubeCluster, install_rbac_and_crds, missing_binaries
from devstack.kube_world import RealKube
from devstack.processes import FleetMedicProcess
from devstack.slurm_cluster import LocalSlurmCluster, free_port
from devstack.standins import ProviderStandIn
from devstack.temporal_production import ProductionTemporal, frontend_requests
from devstack.temporal_production import missing as missing_production
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import NodeRunbookInput
from workers.temporal_client import connect, ensure_search_attributes

CLUSTER = "bench"
QUEUE = "bench"
TOKEN = "bench-token"
SLURM_OUT = re.compile(r"^\[(\S+)\] update_node: node (\S+) state set to (DRAIN\w*|DOWN)", re.M)


class Observed:
    """When each node was first seen unschedulable (a watch on the API) and out of service in Slurm
    (slurmctld's log, millisecond timestamps)."""

    def __init__(self, api: Any, slurm_log: Path) -> None:
        self.api, self.slurm_log = api, slurm_log
        self.cordoned: dict[str, float] = {}
        self.drained: dict[str, float] = {}
        self.read_to = 0  # how far slurmctld's log has been read
        self.stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="node-watch").start()

    def _watch(self) -> None:
        """Nodes as plain JSON, the watch resumed where it stopped: the observer shares the 2 cores
        with what it measures, and a model object per kubelet heartbeat (or a relist of the fleet
        every few seconds) would slow that down."""
        core = k8s_client.CoreV1Api(self.api)
        version: str | None = None
        while not self.stop.is_set():
            try:
                if version is None:
                    listed = json.loads(core.list_node(_preload_content=False).data)
                    for node in listed["items"]:
                        self._saw(node)
                    version = listed["metadata"]["resourceVersion"]
                stream = watch.Watch()
                for event in stream.stream(core.list_node, resource_version=version, timeout_seconds=30,
                                           deserialize=False):
                    self._saw(event["object"])
                    version = event["object"].get("metadata", {}).get("resourceVersion", version)
            except Exception:  # a broken or expired watch lists again
                version = None
                time.sleep(0.1)

    def _saw(self, node: dict[str, Any]) -> None:
        if (node.get("spec") or {}).get("unschedulable"):
            self.cordoned.setdefault(node["metadata"]["name"], time.time())

    def slurm_out(self) -> dict[str, float]:
        """Nodes slurmctld set DRAIN or DOWN, and when (its log read on from where it was left)."""
        with self.slurm_log.open("rb") as log:
            log.seek(self.read_to)
            new = log.read()
        complete = new[:new.rfind(b"\n") + 1]  # a line being written is read next time
        self.read_to += len(complete)
        for stamp, node, _ in SLURM_OUT.findall(complete.decode(errors="replace")):
            self.drained.setdefault(node, datetime.fromisoformat(stamp).timestamp())
        return self.drained

    async def wait(self, nodes: list[str], timeout_s: float = 60) -> dict[str, float]:
        """When each of `nodes` was out of service in both systems."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            slurm = self.slurm_out()
            if all(n in self.cordoned and n in slurm for n in nodes):
                return {n: max(self.cordoned[n], slurm[n]) for n in nodes}
            await asyncio.sleep(0.05)
        missing = [n for n in nodes if n not in self.cordoned or n not in self.slurm_out()]
        raise SystemExit(json.dumps({"error": f"{len(missing)} node(s) never observed out of service within "
                                              f"{timeout_s:g} s", "nodes": missing[:10]}))


async def start_xid_runs(client: Client, nodes: list[str], batch: int) -> None:
    """An XID 79 run for each node, started directly (untimed), `batch` at a time, with the
    workflow-task timeout the webhook gives every runbook."""
    for start in range(0, len(nodes), batch):
        await asyncio.gather(*(client.start_workflow(
            "xid-recovery", NodeRunbookInput(cluster=CLUSTER, node=n, gpu=0, xid=79),
            id=node_workflow_id("xid-recovery", CLUSTER, n), task_queue=QUEUE, task_timeout=RUNBOOK_TASK_TIMEOUT)
            for n in nodes[start:start + batch]))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (its own, not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(*pids: int) -> float:
    """CPU seconds of processes and of every descendant, live or exited: PostgreSQL serves each
    connection from a process of its own. (/proc is read once for them all.)"""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, list(pids)
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            # utime, stime, and the waited-for children's cutime, cstime
            total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
            todo += children.get(current, [])
    return total


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds so far, every core: (busy, in all), from /proc/stat. A case's busy
    share says whether the cores set its pace (every part here shares them) or a wait did."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle and iowait; guest time is in user already
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


SERVERS = ("dev", "production")


def servers(choice: str) -> list[str]:
    """`--temporal dev|production|both`: the servers a benchmark runs on, one after the other."""
    return list(SERVERS) if choice == "both" else [choice]


async def on_each(choice: str, run: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Each server's section; a server whose run failed says why instead of losing the others'.
    A run that gave up (SystemExit with its JSON error, as the waits here raise) counts as failed:
    the next server still runs, and the error is its section."""
    results: dict[str, Any] = {}
    for server in servers(choice):
        try:
            results[server] = await run(server)
        except SystemExit as exc:
            with contextlib.suppress(ValueError):
                results[server] = json.loads(str(exc.code))
            if not isinstance(results.get(server), dict):
                results[server] = {"error": str(exc.code)[:300]}
        except Exception as exc:
            results[server] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(json.dumps({server: results[server]}), file=sys.stderr, flush=True)
    return results


async def count(client: Client, query: str) -> int:
    """A visibility count for the benchmark's own polling: a production server limits visibility
    calls per namespace (`frontend.namespaceRPS.visibility`, 10/s per frontend by default) and
    FleetMedic's runs share that budget, so a refusal waits and asks again."""
    while True:
        try:
            return (await client.count_workflows(query)).count
        except RPCError as exc:
            if exc.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(1)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class BenchWorld:
    """`async with BenchWorld(nodes, workdir, policy) as world:` — everything up, every node in the
    API and in Slurm; on exit every process this started is stopped by its PID."""

    def __init__(self, nodes: list[str], workdir: Path, policy: dict[str, Any], *, webhook: bool = True,
                 worker_env: dict[str, str] | None = None, node_lease_s: int = 40, temporal: str = "dev") -> None:
        if missing_binaries():
            raise SystemExit(json.dumps({"error": "the real control plane is not built: run scripts/install-kube"}))
        if temporal == "production" and (gone := missing_production()):
            raise SystemExit(json.dumps({"error": f"the production Temporal server is not built ({', '.join(gone)}): "
                                                  "run scripts/install-temporal"}))
        self.temporal_kind = temporal
        self.nodes, self.workdir, self.policy = nodes, workdir, policy
        self.with_webhook, self.worker_env = webhook, worker_env or {}
        self.node_lease_s = node_lease_s  # kwok's (devstack/kube_cluster.py): thousands of nodes lengthen it
        self.stack = contextlib.ExitStack()
        self.processes: list[FleetMedicProcess] = []

    async def __aenter__(self) -> BenchWorld:
        try:
            await self._start_temporal()
            self.cluster = cluster = self.stack.enter_context(
                LocalKubeCluster(self.workdir / "kube", node_lease_s=self.node_lease_s))
            install_rbac_and_crds(cluster)
            self.kube = RealKube(cluster, None, self.workdir)
            for name in self.nodes:
                self.kube.put(fleet.node(name))
            self.slurm = self.stack.enter_context(LocalSlurmCluster([], silent_nodes=self.nodes,
                                                                    workdir=self.workdir / "slurm"))
            self.provider = self.stack.enter_context(ProviderStandIn(token="bench"))
            policy = {"provider": {"kind": "http", "http": {"url": self.provider.url}},
                      "storage": {"root": str(self.workdir)}, "routing": {"clusters": [CLUSTER]}, **self.policy}
            (self.workdir / "policy.yaml").write_text(yaml.safe_dump(policy))
            port = free_port()
            env = {**os.environ, "TEMPORAL_ADDRESS": self.address, "TEMPORAL_NAMESPACE": self.client.namespace,
                   "FLEETMEDIC_TASK_QUEUE": QUEUE,
                   "FLEETMEDIC_POLICY": str(self.workdir / "policy.yaml"), "KUBECONFIG": str(self.kube.kubeconfig),
                   "FLEETMEDIC_SLURM": "on", "SLURM_CONF": str(self.slurm.conf), "FLEETMEDIC_PROVIDER_TOKEN": "bench",
                   "FLEETMEDIC_METRICS_PORT": "0", "FLEETMEDIC_WEBHOOK_TOKEN": TOKEN, **self.worker_env}
            self.worker = FleetMedicProcess(["worker"], env, self.workdir / "worker.log")
            self.processes.append(self.worker)
            if self.with_webhook:
                self.processes.append(FleetMedicProcess(["webhook", "--host", "127.0.0.1", "--port", str(port)], env,
                                                        self.workdir / "webhook.log"))
            for process in self.processes:
                process.start()
            self.observed = Observed(self.kube.api, self.slurm.dir / "log" / "slurmctld.log")
            self.stack.callback(self.observed.stop.set)
            self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30,
                                          headers={"Authorization": f"Bearer {TOKEN}"})
            if self.with_webhook:
                await self._webhook_up()
            return self
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def _start_temporal(self) -> None:
        if self.temporal_kind == "production":
            self.production = self.stack.enter_context(ProductionTemporal(self.workdir / "temporal"))
            self.address = self.production.address
            self.client: Client = await connect(target_host=self.address, namespace=self.production.namespace)
            await ensure_search_attributes(self.client)  # as the worker does at start
            return
        options = DevOptions(state_dir=self.workdir / "temporal", port=free_port(), ui_port=free_port())
        self.temporal = start_temporal(options, persist=False)
        self.stack.callback(stop_temporal, self.temporal)
        self.address = f"127.0.0.1:{options.port}"
        self.client = await connect_when_serving(self.address)

    def metrics_url(self) -> str:
        """The Temporal server's Prometheus endpoint: the production server's configured one, or the
        address the dev server's banner gives."""
        if self.temporal_kind == "production":
            return self.production.metrics_url
        banner = (self.workdir / "temporal" / "temporal.log").read_text(errors="replace")
        found = re.search(r"Temporal Metrics:\s+(\S+)", banner)
        if found is None:
            raise SystemExit(json.dumps({"error": "the Temporal dev server printed no metrics address"}))
        return found[1]

    def server_log(self) -> Path | None:
        """temporal-server's log (JSON lines, warn and above) on the production server; None on the
        dev server, whose log is not read."""
        return self.production.server_log if self.temporal_kind == "production" else None

    def worker_cpu(self) -> float:
        """CPU seconds so far of the worker with the processes it starts: scontrol and squeue (a
        protective step's Slurm reads and writes are each a process of its own, a quarter of what
        the worker spends on a run's first task here), which a worker's pod pays for too."""
        return tree_cpu_seconds(self.worker_pid())

    def temporal_cpu(self) -> float:
        """CPU seconds so far of the Temporal server: the dev server's process, or temporal-server
        and PostgreSQL (every backend process) together."""
        if self.temporal_kind == "production":
            return tree_cpu_seconds(*(proc.popen.pid for proc in self.production.processes))
        return cpu_seconds(self.temporal.pid)

    def systems_cpu(self) -> dict[str, float]:
        """CPU seconds so far of the systems the runs call, on the same cores here (elsewhere in a
        real cluster): the Kubernetes control plane with kwok (whose node leases are renewed in
        waves), and munged with slurmctld."""
        return {"kubernetes": tree_cpu_seconds(*(proc.popen.pid for proc in self.cluster.processes)),
                "slurm": tree_cpu_seconds(*(proc.pid for proc in self.slurm.procs.values()))}

    async def until_quiet(self, below_cores: float = 0.15, within_s: float = 120) -> float:
        """Until the Temporal server uses less than `below_cores` over 2 s (what the case before
        started has settled), at most `within_s`: the seconds waited. A case and its floor each
        start from a quiet server, so neither pays for the other's runs."""
        began = time.monotonic()
        while time.monotonic() - began < within_s:
            before = self.temporal_cpu()
            await asyncio.sleep(2)
            if (self.temporal_cpu() - before) / 2 < below_cores:
                break
        return round(time.monotonic() - began, 1)

    async def _webhook_up(self) -> None:
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                if (await self.http.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
        raise SystemExit(json.dumps({"error": "the webhook did not answer /healthz within 60 s"}))

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        for process in self.processes:
            process.stop()
        if hasattr(self, "http"):
            await self.http.aclose()
        self.stack.close()

    def server_requests(self, operation: str) -> float:
        """How many `operation` calls (e.g. RecordActivityTaskHeartbeat) the Temporal server's
        frontend has served so far: its own metrics."""
        return frontend_requests(self.metrics_url(), [operation])[0]

    def worker_pid(self) -> int:
        assert self.worker.proc is not None
        return self.worker.proc.pid

    def webhook_pid(self) -> int:
        assert self.with_webhook and self.processes[-1].proc is not None
        return self.processes[-1].proc.pid
