"""A Temporal as users deploy it, for the tests marked `temporal_production` and the benchmarks'
`--temporal production`.

temporal-server built from go.temporal.io/server (scripts/install-temporal) runs its four services
(frontend, history, matching, worker) in one process, as `temporal-server start` does by default,
with PostgreSQL from Debian for persistence and for SQL (advanced) visibility, and several history
shards. It is set up the way an operator sets up a self-hosted cluster, not the dev server's way:
- PostgreSQL with password authentication on loopback;
- temporal-sql-tool, Temporal's own schema tool, creates both databases and applies the schemas
  embedded in it (`setup-schema -v 0.0`, then `update-schema` to the newest version);
- the namespace is registered through the frontend's API with a retention, and FleetMedic's search
  attributes are added by FleetMedic's worker through the operator API (`ensure_search_attributes`).
Unlike the dev server, a namespace just registered is unknown to the frontend until its namespace
cache refreshes (every 2 s by default): `start()` waits until the namespace is served, as an
operator's setup script does.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devstack.jwt_issuer import JwtIssuer
from devstack.kube_cluster import Process, _tail, spawn, stop_processes
from devstack.slurm_cluster import free_port

TEMPORAL_VERSION = os.environ.get("FLEETMEDIC_TEMPORAL_VERSION", "v1.32.0")
BUILD_HINT = ("run scripts/install-temporal (builds temporal-server and temporal-sql-tool from "
              "go.temporal.io/server, ~6 min cold) and scripts/install-system-deps (PostgreSQL)")
NAMESPACE = "fleetmedic"
SHARDS = 4
RETENTION = timedelta(days=1)


def cache_dir() -> Path:
    return (Path(os.environ.get("FLEETMEDIC_TEMPORAL_CACHE", Path.home() / ".cache/fleetmedic/temporal"))
            / TEMPORAL_VERSION)


def postgres_bin() -> Path | None:
    """Debian's PostgreSQL server programs (initdb, postgres), newest major version installed."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


def missing() -> list[str]:
    """What install-temporal and install-system-deps have not put on this machine yet."""
    gone = [b for b in ("temporal-server", "temporal-sql-tool") if not (cache_dir() / b).is_file()]
    if postgres_bin() is None:
        gone.append("postgresql (Debian)")
    return gone


def frontend_requests(metrics_url: str, operations: list[str], namespace: str | None = None) -> list[float]:
    """How many calls of each operation (e.g. RecordActivityTaskHeartbeat) a Temporal server's
    frontend has served so far, in `namespace` or all: its own Prometheus metrics, on the dev server
    as on this one (the namespace label has `_` for `-`; the reporter flushes every second)."""
    label = namespace.replace("-", "_") if namespace is not None else None
    text = httpx.get(metrics_url, timeout=30).text
    samples = [sample for family in text_string_to_metric_families(text) if family.name == "service_requests"
               for sample in family.samples if sample.labels.get("service_name") == "frontend"
               and (label is None or sample.labels.get("namespace") == label)]
    return [sum(s.value for s in samples if s.labels.get("operation") == operation) for operation in operations]


class ProductionTemporal:
    """PostgreSQL and temporal-server on loopback, in a directory of their own; `address` and
    `namespace` are what a worker is given. Stopped by PID, newest first."""

    def __init__(self, workdir: Path | None = None, *, shards: int = SHARDS, namespace: str = NAMESPACE,
                 durable: bool = True, issuer: JwtIssuer | None = None) -> None:
        """`durable`: PostgreSQL syncs its commits to disk as in production (the benchmarks' case);
        tests may turn it off, which changes no behaviour they assert, only how long a write waits.
        `issuer`: the frontend authorizes every call by the issuer's JWTs (the default claim mapper
        and authorizer); this setup registers the namespace as `temporal-system:admin`."""
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fleetmedic-temporal-"))
        self.shards, self.namespace, self.durable = shards, namespace, durable
        self.bin = cache_dir()
        self.processes: list[Process] = []
        self.pg_password = secrets.token_hex(12)
        self.pg_port = 0
        self.port = 0
        self.metrics_port = 0
        self._pgdir: Path | None = None
        self.issuer = issuer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def server_log(self) -> Path:
        return self.workdir / "temporal-server.log"

    # --- start / stop -----------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> ProductionTemporal:
        gone = missing()
        if gone:
            raise RuntimeError(f"missing {', '.join(gone)}: {BUILD_HINT}")
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_postgres(timeout)
            self._setup_schemas()
            self._start_server()
            # On a loop of its own in a thread: a caller on an event loop (a benchmark) blocks here as
            # a plain caller does, and the setup's client lives and dies with that loop.
            with ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, self._ready(timeout)).result()
            self.started_in_s = round(time.monotonic() - began, 1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_processes(self.processes, grace_s=20)
        if self._pgdir is not None:
            shutil.rmtree(self._pgdir, ignore_errors=True)
            self._pgdir = None

    def __enter__(self) -> ProductionTemporal:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- PostgreSQL -----------------------------------------------------------------------------

    def _start_postgres(self, timeout: float) -> None:
        """A private cluster: initdb, then postgres on a loopback port, password auth over TCP.
        PostgreSQL refuses to run as root; as root, its directory belongs to Debian's `postgres`
        user and both programs run as that user (a test's own tmp dir is not traversable by it)."""
        pg = postgres_bin()
        assert pg is not None
        user = "postgres" if os.geteuid() == 0 else None
        self._pgdir = Path(tempfile.mkdtemp(prefix="fleetmedic-pg-"))
        (self._pgdir / "pw").write_text(self.pg_password)
        if user:
            shutil.chown(self._pgdir, user)
            shutil.chown(self._pgdir / "pw", user)
        data = self._pgdir / "data"
        init = subprocess.run([str(pg / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8",
                               "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={self._pgdir / 'pw'}",
                               "--no-sync"], user=user, capture_output=True, timeout=120)
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {init.stderr.decode(errors='replace')[-400:]}")
        self.pg_port = free_port()
        settings = {"listen_addresses": "127.0.0.1", "port": str(self.pg_port),
                    "unix_socket_directories": str(self._pgdir), "max_connections": "300"}
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        argv = [str(pg / "postgres"), "-D", str(data)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        self._spawn("postgres", argv, user=user, cwd=self._pgdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = subprocess.run([str(pg / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.pg_port)],
                                   capture_output=True, timeout=10)
            if ready.returncode == 0:
                return
            self._check_alive()
            time.sleep(0.2)
        raise RuntimeError(f"PostgreSQL did not accept connections in {timeout:.0f} s: "
                           f"{_tail(self.workdir / 'postgres.log')}")

    def _setup_schemas(self) -> None:
        """What an operator runs once per cluster (Temporal's docs, "Self-hosted: SQL setup")."""
        tool = [str(self.bin / "temporal-sql-tool"), "--plugin", "postgres12", "--endpoint", "127.0.0.1",
                "--port", str(self.pg_port), "--user", "postgres", "--password", self.pg_password]
        for database, schema in (("temporal", "temporal"), ("temporal_visibility", "visibility")):
            for step in (["create-database"], ["setup-schema", "-v", "0.0"],
                         ["update-schema", "--schema-name", f"postgresql/v12/{schema}"]):
                done = subprocess.run([*tool, "--database", database, *step], capture_output=True, timeout=120)
                if done.returncode != 0:
                    out = (done.stdout + done.stderr).decode(errors="replace")[-400:]
                    raise RuntimeError(f"temporal-sql-tool {step[0]} on {database} failed: {out}")

    # --- temporal-server --------------------------------------------------------------------------

    def _start_server(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        store = {"pluginName": "postgres12", "connectAddr": f"127.0.0.1:{self.pg_port}", "connectProtocol": "tcp",
                 "user": "postgres", "password": self.pg_password, "maxConnLifetime": "1h"}
        services = {}
        # With authorization, the server's own worker service calls an internal frontend, which
        # authorizes nothing (production secures it with internode mTLS): the public one refuses it.
        names = ["frontend", "history", "matching", "worker"] + (["internal-frontend"] if self.issuer else [])
        for name in names:
            rpc = {"grpcPort": self.port if name == "frontend" else free_port(), "membershipPort": free_port(),
                   "bindOnLocalHost": True}
            if name == "frontend":
                rpc["httpPort"] = free_port()
            services[name] = {"rpc": rpc}
        dynamic = self.workdir / "dynamicconfig.yaml"
        # Only what FleetMedic needs beyond the defaults: Updates (approvals, the guard) are on by
        # default in 1.32; the ID length matches the dev server's so the same IDs pass everywhere.
        dynamic.write_text(yaml.safe_dump({"limit.maxIDLength": [{"value": 255, "constraints": {}}]}))
        config: dict[str, Any] = {
            "log": {"stdout": True, "level": "warn"},
            "persistence": {
                "defaultStore": "default", "visibilityStore": "visibility", "numHistoryShards": self.shards,
                "datastores": {
                    "default": {"sql": {**store, "databaseName": "temporal", "maxConns": 20, "maxIdleConns": 20}},
                    "visibility": {"sql": {**store, "databaseName": "temporal_visibility", "maxConns": 10,
                                           "maxIdleConns": 10}},
                },
            },
            "global": {"membership": {"maxJoinDuration": "30s", "broadcastAddress": "127.0.0.1"},
                       "metrics": {"prometheus": {"framework": "tally", "timerType": "histogram",
                                                  "listenAddress": f"127.0.0.1:{self.metrics_port}"}}},
            "services": services,
            "clusterMetadata": {
                "enableGlobalNamespace": False, "failoverVersionIncrement": 10, "masterClusterName": "active",
                "currentClusterName": "active",
                "clusterInformation": {"active": {"enabled": True, "initialFailoverVersion": 1, "rpcName": "frontend",
                                                  "rpcAddress": self.address}},
            },
            "dcRedirectionPolicy": {"policy": "noop"},
            "dynamicConfigClient": {"filepath": str(dynamic), "pollInterval": "10s"},
        }
        if self.issuer is not None:
            config["global"]["authorization"] = self.issuer.server_config()
        path = self.workdir / "temporal.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn("temporal-server", [str(self.bin / "temporal-server"), "--config-file", str(path),
                                        "--allow-no-auth", "start", *(f"--service={name}" for name in names)])

    async def _ready(self, timeout: float) -> None:
        await self.register_namespace(self.namespace, timeout)

    async def register_namespace(self, namespace: str, timeout: float = 60) -> None:
        """Register `namespace` with the retention through the frontend's API and return once the
        frontend serves it (a namespace just registered is unknown until the cache refreshes)."""
        from google.protobuf.duration_pb2 import Duration
        from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest, RegisterNamespaceRequest
        from temporalio.client import Client
        from temporalio.service import RPCError, RPCStatusCode

        deadline = time.monotonic() + timeout
        client: Client | None = None
        registered = False
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if client is None:
                    client = await Client.connect(self.address, namespace=namespace, rpc_metadata=self.admin_metadata())
                if not registered:
                    retention = Duration()
                    retention.FromTimedelta(RETENTION)
                    await client.workflow_service.register_namespace(RegisterNamespaceRequest(
                        namespace=namespace, workflow_execution_retention_period=retention))
                    registered = True
                await client.workflow_service.list_workflow_executions(
                    ListWorkflowExecutionsRequest(namespace=namespace, page_size=1))
                return
            except RPCError as exc:
                if exc.status == RPCStatusCode.ALREADY_EXISTS:
                    registered = True
                last = f"{exc.status.name}: {exc.message}"
            except RuntimeError as exc:  # not listening yet
                last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            await asyncio.sleep(0.5)
        raise RuntimeError(f"Temporal at {self.address} did not serve namespace {namespace} in "
                           f"{timeout:.0f} s (last: {last}): {_tail(self.server_log)}")

    def admin_metadata(self) -> dict[str, str]:
        """gRPC metadata of a `temporal-system:admin` caller (none needed without an issuer)."""
        if self.issuer is None:
            return {}
        return {"authorization": f"Bearer {self.issuer.token('temporal-admin', ['temporal-system:admin'])}"}

    # --- processes --------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], user: str | None = None, cwd: Path | None = None) -> None:
        self.processes.append(spawn(self.workdir, name, argv, user=user, cwd=cwd))

    def _check_alive(self) -> None:
        for proc in self.processes:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: {_tail(proc.log)}")
