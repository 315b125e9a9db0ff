"""Node providers: http (against its stand-in), cluster-api and karpenter (against the emulator), manual."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError

from activities.kube_client import load_api_client
from activities.providers import ProviderActivities, make_provider
from activities.providers.cluster_api import ClusterApiProvider
from activities.providers.http import HttpProvider
from activities.providers.karpenter import KarpenterProvider
from activities.providers.manual import ManualProvider
from devstack import fleet
from devstack.kube_emulator import KubeEmulatorThread
from devstack.standins import ProviderStandIn
from fleetmedic.models import ProviderRequest
from fleetmedic.policy import ClusterApiProviderPolicy, KarpenterProviderPolicy, ProviderPolicy
from tests.harness import run_activity as run


def request(action: str = "replace", dry_run: bool = False, key: str = "xid-recovery/c/n1/run/replace",
            node: str = "n1") -> ProviderRequest:
    return ProviderRequest(cluster="c", node=node, action=action, reason="XID 79 on GPU 3",  # type: ignore[arg-type]
                           idempotency_key=key, dry_run=dry_run)



def test_http_provider_asks_once_per_idempotency_key(provider_http: ProviderStandIn) -> None:
    provider = HttpProvider(provider_http.url, "provider-secret", timeout_s=5)
    first = provider.request(request())
    second = provider.request(request())  # a retried activity
    assert first.accepted and first.reference == second.reference
    assert len(provider_http.accepted()) == 1
    assert provider_http.requests[0].headers["Idempotency-Key"] == "xid-recovery/c/n1/run/replace"
    provider.request(request("reboot", key="other"))
    assert [r["action"] for r in provider_http.accepted()] == ["replace", "reboot"]


@pytest.mark.parametrize(("status", "kind", "retryable"), [
    (500, "Unavailable", True), (503, "Unavailable", True), (401, "Forbidden", False), (400, "Invalid", False),
    (409, "Invalid", False), (404, "NotFound", False),
])
def test_http_provider_errors(provider_http: ProviderStandIn, status: int, kind: str, retryable: bool) -> None:
    provider_http.fail_next(status)
    with pytest.raises(ApplicationError) as err:
        HttpProvider(provider_http.url, "provider-secret", timeout_s=5).request(request())
    assert err.value.type == kind and err.value.non_retryable is not retryable


def test_http_provider_wrong_token(provider_http: ProviderStandIn) -> None:
    with pytest.raises(ApplicationError) as err:
        HttpProvider(provider_http.url, "wrong", timeout_s=5).request(request())
    assert err.value.type == "Forbidden" and provider_http.accepted() == []


def test_http_provider_timeout_and_unreachable(provider_http: ProviderStandIn) -> None:
    provider_http.fail_next(status=0, delay_s=3)
    with pytest.raises(ApplicationError) as slow:
        HttpProvider(provider_http.url, "provider-secret", timeout_s=1).request(request())
    assert slow.value.type == "Timeout" and not slow.value.non_retryable
    with pytest.raises(ApplicationError) as down:
        HttpProvider("http://127.0.0.1:9", None, timeout_s=1).request(request())
    assert down.value.type == "Unavailable"


def test_dry_run_reaches_no_provider(provider_http: ProviderStandIn) -> None:
    activities = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5))
    result = run(activities.request, request(dry_run=True))
    assert result.dry_run and "would POST" in result.detail
    forced = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5), force_dry_run=True)
    assert run(forced.request, request()).dry_run
    assert provider_http.requests == []


def capi_machine(kube: KubeEmulatorThread) -> None:
    kube.emulator.put(fleet.node("n1", annotations={"cluster.x-k8s.io/machine": "md-0-abc",
                                                    "cluster.x-k8s.io/cluster-namespace": "capi"}))
    kube.emulator.put(fleet.machine("md-0-abc", namespace="capi", cluster="c", node="n1"))


def test_cluster_api_deletes_the_machine_once(kube: KubeEmulatorThread) -> None:
    capi_machine(kube)
    provider = ClusterApiProvider(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                                  ClusterApiProviderPolicy(), 5)
    dry = provider.request(request(dry_run=True))
    assert dry.dry_run and kube.emulator.get("cluster.x-k8s.io/v1beta1", "Machine", "md-0-abc", "capi")
    result = provider.request(request())
    assert result.reference == "capi/md-0-abc" and "deleted Machine" in result.detail
    assert kube.emulator.get("cluster.x-k8s.io/v1beta1", "Machine", "md-0-abc", "capi") is None
    again = provider.request(request())  # a retry after the delete went through
    assert again.accepted and "already deleted" in again.detail
    deletes = [r for r in kube.emulator.mutations() if r.method.value == "DELETE"]
    assert len(deletes) == 2  # the second found nothing: 404, treated as done


def test_cluster_api_refuses_a_node_it_does_not_own(kube: KubeEmulatorThread) -> None:
    kube.emulator.put(fleet.node("n1"))
    provider = ClusterApiProvider(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                                  ClusterApiProviderPolicy(), 5)
    with pytest.raises(ApplicationError) as err:
        provider.request(request())
    assert err.value.type == "Invalid" and err.value.non_retryable
    assert provider.request(request("reboot")).needs_human  # Cluster API cannot reboot


def test_cluster_api_server_error_is_retryable(kube: KubeEmulatorThread) -> None:
    capi_machine(kube)
    kube.emulator.inject("DELETE", "machines", status=503)
    provider = ClusterApiProvider(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                                  ClusterApiProviderPolicy(), 5)
    with pytest.raises(ApplicationError) as err:
        provider.request(request())
    assert err.value.type == "Unavailable" and not err.value.non_retryable
    assert kube.emulator.get("cluster.x-k8s.io/v1beta1", "Machine", "md-0-abc", "capi") is not None


def test_karpenter_deletes_the_nodeclaim(kube: KubeEmulatorThread) -> None:
    kube.emulator.put(fleet.node("n1", labels={"karpenter.sh/nodepool": "gpu"}))
    for name, node in (("gpu-x1", "n1"), ("gpu-x2", "n2")):
        kube.emulator.put(fleet.nodeclaim(name, node=node))
    provider = KarpenterProvider(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                                 KarpenterProviderPolicy(), 5)
    assert provider.request(request()).reference == "gpu-x1"
    assert [c["metadata"]["name"] for c in kube.emulator.list("karpenter.sh/v1", "NodeClaim")] == ["gpu-x2"]
    assert "already deleted" in provider.request(request()).detail
    kube.emulator.put(fleet.node("n3"))
    with pytest.raises(ApplicationError) as err:
        provider.request(request(node="n3"))
    assert err.value.type == "Invalid"


def test_manual_provider_asks_a_human() -> None:
    result = ManualProvider().request(request())
    assert result.needs_human and "signal `replaced`" in result.detail


def test_policy_picks_the_provider(provider_http: ProviderStandIn) -> None:
    def never() -> None:
        raise AssertionError("no Kubernetes call expected")

    assert make_provider(ProviderPolicy(kind="manual"), never, token=None, kube_timeout_s=1).name == "manual"  # type: ignore[arg-type]
    http = make_provider(ProviderPolicy.model_validate({"kind": "http", "http": {"url": provider_http.url}}),
                         never, token="t", kube_timeout_s=1)  # type: ignore[arg-type]
    assert http.name == "http" and http.supports == frozenset({"replace", "reboot", "rma", "prewarm"})
