"""The Kubernetes emulator keeps the API semantics the runbooks rely on (through the official client)."""

from __future__ import annotations

import threading

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from devstack import fleet
from devstack.kube_emulator import KubeEmulatorThread

MERGE = "application/merge-patch+json"


@pytest.fixture
def kube(kube_emulator: KubeEmulatorThread) -> KubeEmulatorThread:
    """The emulator's own tests run against the emulator (the `fleetmedic dev` fallback)."""
    return kube_emulator


@pytest.fixture
def core(kube: KubeEmulatorThread) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(kube.kubeconfig)))  # type: ignore[attr-defined]

# These tests exercise the emulator itself, not the worker's adapters.
pytestmark = pytest.mark.not_worker_rbac


def test_uid_and_resource_version_and_stale_write_conflict(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    kube.emulator.put(fleet.node("n1"))
    node = core.read_node("n1")
    assert node.metadata.uid and node.metadata.resource_version
    updated = core.patch_node("n1", {"metadata": {"resourceVersion": node.metadata.resource_version},
                                     "spec": {"unschedulable": True}}, _content_type=MERGE)
    assert int(updated.metadata.resource_version) > int(node.metadata.resource_version)
    with pytest.raises(ApiException) as stale:
        core.patch_node("n1", {"metadata": {"resourceVersion": node.metadata.resource_version},
                               "spec": {"unschedulable": False}}, _content_type=MERGE)
    assert stale.value.status == 409
    assert core.read_node("n1").spec.unschedulable is True  # the stale write changed nothing
    same = core.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    assert same.metadata.resource_version == updated.metadata.resource_version  # no-op keeps the version


def test_create_conflict_and_delete(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    body = fleet.pod("p", "n1")
    core.create_namespaced_pod("default", body)
    with pytest.raises(ApiException) as exists:
        core.create_namespaced_pod("default", body)
    assert exists.value.status == 409
    core.delete_namespaced_pod("p", "default")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("p", "default")
    assert gone.value.status == 404


def test_label_and_field_selectors(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    for name, node, app in [("a", "n1", "x"), ("b", "n1", "y"), ("c", "n2", "x")]:
        kube.emulator.put(fleet.pod(name, node, labels={"app": app, "tier": "gpu"}))
    names = lambda items: sorted(p.metadata.name for p in items)  # noqa: E731
    assert names(core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").items) == ["a", "b"]
    assert names(core.list_namespaced_pod("default", label_selector="app=x").items) == ["a", "c"]
    assert names(core.list_namespaced_pod("default", label_selector="app in (y),tier").items) == ["b"]
    assert names(core.list_namespaced_pod("default", label_selector="app!=x").items) == ["b"]
    assert names(core.list_namespaced_pod("default", label_selector="!tier").items) == []
    assert names(core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1,metadata.name!=a").items) == ["b"]


def test_watch_streams_changes_after_a_resource_version(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    kube.emulator.put(fleet.node("n1"))
    listed = core.list_node()
    seen: list[tuple[str, str]] = []

    def later() -> None:
        kube.emulator.put(fleet.node("n2"))
        core.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)

    timer = threading.Timer(0.3, later)
    timer.start()
    for event in watch.Watch().stream(core.list_node, resource_version=listed.metadata.resource_version,
                                      timeout_seconds=2):
        seen.append((event["type"], event["object"].metadata.name))
    timer.join()
    assert seen == [("ADDED", "n2"), ("MODIFIED", "n1")]


def test_eviction_honours_pod_disruption_budgets(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    for i in range(2):
        kube.emulator.put(fleet.pod(f"web-{i}", "n1", labels={"app": "web"}))
    kube.emulator.put(fleet.pdb("web", match_labels={"app": "web"}, min_available=1))
    eviction = lambda name: client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace="default"))  # noqa: E731
    core.create_namespaced_pod_eviction("web-0", "default", eviction("web-0"))
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod_eviction("web-1", "default", eviction("web-1"))
    assert refused.value.status == 429
    assert core.read_namespaced_pod("web-1", "default").metadata.name == "web-1"


def test_injected_fault_happens_before_any_state_change(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    kube.emulator.put(fleet.node("n1"))
    kube.emulator.inject("PATCH", "nodes", status=500)
    with pytest.raises(ApiException) as failed:
        core.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    assert failed.value.status == 500
    assert not core.read_node("n1").spec.unschedulable  # kmock's plain emulator would have applied it
    core.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)  # only once
    assert core.read_node("n1").spec.unschedulable


def test_custom_resources_and_events(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    api = client.ApiClient(configuration=core.api_client.configuration)
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("cluster.x-k8s.io", "v1beta1", "default", "machines", {
        "apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine", "metadata": {"name": "m1"}, "spec": {}})
    assert custom.get_namespaced_custom_object("cluster.x-k8s.io", "v1beta1", "default", "machines", "m1")
    custom.delete_namespaced_custom_object("cluster.x-k8s.io", "v1beta1", "default", "machines", "m1")
    assert kube.emulator.list("cluster.x-k8s.io/v1beta1", "Machine") == []
    core.create_namespaced_event("default", client.CoreV1Event(
        metadata=client.V1ObjectMeta(name="e1"), involved_object=client.V1ObjectReference(kind="Node", name="n1"),
        reason="Test", message="hello"))
    assert core.list_namespaced_event("default", field_selector="involvedObject.name=n1").items[0].reason == "Test"
    assert client.VersionApi(api).get_code().major == "1"


def test_kubectl_finds_the_core_resources(kube: KubeEmulatorThread) -> None:
    """The discovery document of /api/v1 names groupVersion v1: `kubectl get nodes` works on `fleetmedic dev`."""
    import shutil
    import subprocess

    from tests.conftest import require

    require(shutil.which("kubectl") is not None, "kubectl")
    kube.emulator.put(fleet.node("n1"))
    out = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "get", "nodes",  # type: ignore[attr-defined]
                          "-o", "name"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["node/n1"]


def test_request_history_is_bounded(kube: KubeEmulatorThread, core: client.CoreV1Api) -> None:
    kube.emulator.history_limit = 50
    kube.emulator.put(fleet.node("n1"))
    for _ in range(120):
        core.read_node("n1")
    assert len(kube.emulator.requests()) <= 51
