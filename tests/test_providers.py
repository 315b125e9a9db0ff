"""Node providers: http (against its stand-in), cluster-api and karpenter (against the real apiserver
and their CRDs), manual."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import providers
from activities.kube_client import load_api_client
from activities.providers import ProviderActivities, make_provider
from activities.providers.cluster_api import ClusterApiProvider
from activities.providers.http import HttpProvider
from activities.providers.karpenter import KarpenterProvider
from activities.providers.manual import ManualProvider
from devstack import fleet
from devstack.kube_world import RealKube
from devstack.standins import ProviderStandIn
from fleetmedic.models import FindReplacement, Follow, ProviderRequest, Replacement
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


def test_http_provider_follows_a_new_machine_to_its_node(provider_http: ProviderStandIn) -> None:
    provider_http.replacement = "new"
    provider = HttpProvider(provider_http.url, "provider-secret", timeout_s=5)
    result = provider.request(request())
    assert result.follow is not None and result.follow.reference == result.reference and result.new_node is None
    assert provider.find_replacement(result.follow).node is None  # not joined yet
    provider_http.complete(result.reference, node="gpu-node-41")
    found = provider.find_replacement(result.follow)
    assert found.node == "gpu-node-41" and result.reference in found.detail
    provider_http.complete(result.reference, status="failed")
    assert provider.find_replacement(result.follow).failed


def test_a_replacement_name_from_a_provider_is_untrusted(provider_http: ProviderStandIn) -> None:
    provider_http.replacement = "new"
    activities = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5))
    result = run(activities.request, request())
    provider_http.complete(result.reference, node="gpu-node-41; rm -rf /")
    with pytest.raises(ApplicationError) as err:
        run(activities.find_replacement, FindReplacement(follow=result.follow, timeout_s=1))
    assert err.value.type == "Invalid" and err.value.non_retryable


def test_dry_run_reaches_no_provider(provider_http: ProviderStandIn) -> None:
    activities = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5))
    result = run(activities.request, request(dry_run=True))
    assert result.dry_run and "would POST" in result.detail
    forced = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5), force_dry_run=True)
    assert run(forced.request, request()).dry_run
    assert provider_http.requests == []


CAPI = "cluster.x-k8s.io/v1beta2"


def capi_machine(kube: RealKube, name: str = "md-0-abc", node: str = "n1", *, healthy: int = 10,
                 machine_annotations: dict[str, str] | None = None, paused: bool = False) -> dict[str, Any]:
    """A node of MachineSet md-0 in namespace capi, its Machine, its Cluster and a MachineHealthCheck."""
    kube.put(fleet.capi_cluster(namespace="capi", paused=paused))
    machine_set = kube.put(fleet.machine_set("md-0", namespace="capi", replicas=10))
    kube.put(fleet.machine_health_check("md-0-mhc", namespace="capi", healthy=healthy))
    machine = fleet.machine(name, namespace="capi", node=node, machine_set=machine_set)
    machine["metadata"]["annotations"] = dict(machine_annotations or {})
    kube.put(machine)
    kube.put(fleet.node(node, annotations={"cluster.x-k8s.io/machine": name,
                                           "cluster.x-k8s.io/cluster-namespace": "capi",
                                           "cluster.x-k8s.io/owner-kind": "MachineSet",
                                           "cluster.x-k8s.io/owner-name": "md-0"}))
    return machine_set


def capi(kube: RealKube) -> ClusterApiProvider:
    return ClusterApiProvider(lambda: load_api_client(str(kube.kubeconfig)), ClusterApiProviderPolicy(), 5)


def test_cluster_api_deletes_the_machine_once_and_says_where_the_replacement_appears(kube: RealKube) -> None:
    capi_machine(kube)
    provider = capi(kube)
    dry = provider.request(request(dry_run=True))
    assert dry.dry_run and kube.get(CAPI, "Machine", "md-0-abc", "capi")
    result = provider.request(request())
    assert result.reference == "capi/md-0-abc" and "deleted Machine" in result.detail
    assert result.follow is not None and result.follow.group == "capi/md-0" and result.new_node is None
    assert kube.get(CAPI, "Machine", "md-0-abc", "capi") is None
    again = provider.request(request())  # a retry after the delete went through
    assert again.accepted and "already deleted" in again.detail
    assert again.follow is not None and again.follow.group == "capi/md-0"  # read from the node's annotations
    deletes = [r for r in kube.mutations() if r.method.value == "DELETE"]
    assert len(deletes) == 1
    marks = [r for r in kube.mutations() if r.method.value == "PATCH" and r.url.path.endswith("/machines/md-0-abc")]
    assert len(marks) == 1 and "cluster.x-k8s.io/delete-machine" in json.dumps(marks[0].data)


@pytest.mark.parametrize(("setup", "why"), [
    ({"machine_annotations": {"cluster.x-k8s.io/skip-remediation": ""}}, "skip-remediation"),
    ({"machine_annotations": {"cluster.x-k8s.io/paused": ""}}, "annotated cluster.x-k8s.io/paused"),
    ({"paused": True}, "Cluster gpu-cluster is paused"),
    ({"healthy": 6}, "maxUnhealthy"),  # 4 of 10 unhealthy, this one the 5th: more than 40%
])
def test_cluster_api_leaves_to_a_person_what_cluster_api_would_not_remediate(kube: RealKube, setup: dict[str, Any],
                                                                             why: str) -> None:
    capi_machine(kube, **setup)
    result = capi(kube).request(request())
    assert result.needs_human and why in result.detail, result.detail
    assert kube.get(CAPI, "Machine", "md-0-abc", "capi") is not None
    assert not [r for r in kube.mutations() if r.url.path.endswith("/machines/md-0-abc")]


def test_cluster_api_two_replacements_in_one_machine_set_never_take_the_same_machine(kube: RealKube) -> None:
    """Two nodes of md-0 replaced at once: each run claims its own new Machine (oldest first), and a
    Machine from before the request is nobody's replacement."""
    machine_set = capi_machine(kube, "md-0-aaa", "n1")
    capi_machine(kube, "md-0-bbb", "n2")
    kube.put(fleet.machine("md-0-old", namespace="capi", node="n9", machine_set=machine_set))
    time.sleep(1.1)  # creation times have second precision: the requests come a second later
    provider = capi(kube)
    now = datetime.now(UTC)
    follows = []
    for node in ("n1", "n2"):
        follow = provider.request(request(node=node, key=f"k/{node}")).follow
        assert follow is not None
        follows.append(follow.model_copy(update={"since": now}))
    kube.put(fleet.machine("md-0-new1", namespace="capi", machine_set=machine_set))
    time.sleep(1.1)
    kube.put(fleet.machine("md-0-new2", namespace="capi", node="n11", machine_set=machine_set))

    first = provider.find_replacement(follows[0])
    assert first.node is None and "md-0-new1 has no node yet" in first.detail
    assert provider.find_replacement(follows[1]).node == "n11"  # md-0-new1 is n1's: n2 gets the next one
    claims = {m["metadata"]["name"]: (m["metadata"].get("annotations") or {}).get("fleetmedic.io/replaces")
              for m in kube.list(CAPI, "Machine", "capi")}
    assert claims == {"md-0-new1": "n1", "md-0-new2": "n2", "md-0-old": None}
    kube.put(fleet.machine("md-0-new1", namespace="capi", node="n10", machine_set=machine_set))  # its node joined
    assert provider.find_replacement(follows[0]).node == "n10"


def test_searches_in_one_machine_set_share_its_lists_and_claim_apart(kube: RealKube) -> None:
    """Twelve replacements of one MachineSet under way at once, as a storm's runs wait for theirs:
    their looks share the set's lists (the apiserver's audit log: a list a wave of looks, where
    each search listed the set on each of its looks: 36 lists here), each claims a new Machine of
    its own with no conflicting write, and each finds its node once the node joins."""
    machine_set = capi_machine(kube, "md-0-abc", "n1")
    time.sleep(1.1)  # creation times have second precision: the new Machines come a second later
    since = datetime.now(UTC)
    count = 12
    for i in range(count):
        kube.put(fleet.machine(f"md-0-new{i:02}", namespace="capi", machine_set=machine_set))
    activities = ProviderActivities(capi(kube))
    follows = [Follow(provider="cluster-api", old_node=f"old{i:02}", reference=f"capi/md-0-gone{i:02}",
                      group="capi/md-0", since=since) for i in range(count)]

    async def searches() -> list[Replacement]:
        waits = [asyncio.ensure_future(ActivityEnvironment().run(activities.find_replacement,
                                                                 FindReplacement(follow=f, timeout_s=60)))
                 for f in follows]
        await asyncio.sleep(4)  # a few looks each: the new Machines have no node yet
        assert not any(w.done() for w in waits)
        for machine in kube.list(CAPI, "Machine", "capi"):
            name = machine["metadata"]["name"]
            if name.startswith("md-0-new"):
                machine["status"] = {"nodeRef": {"name": f"n-{name}"}}
                kube.put(machine)
        return await asyncio.wait_for(asyncio.gather(*waits), 60)

    found = asyncio.run(searches())
    claims = {m["metadata"]["name"]: (m["metadata"].get("annotations") or {}).get("fleetmedic.io/replaces")
              for m in kube.list(CAPI, "Machine", "capi")}
    assert {f"n-{name}": old for name, old in claims.items() if old} == {
        r.node: f.old_node for r, f in zip(found, follows, strict=True)}
    assert len({r.node for r in found}) == count
    lists = [r for r in kube.requests() if r.verb == "list" and r.url.path.endswith("/machines")]
    assert 1 <= len(lists) <= 6, len(lists)  # a wave of looks a list: at 0, 2, 5 and 9.5 s
    conflicts = [r for r in kube.mutations() if r.method.value == "PATCH" and r.code == 409]
    assert conflicts == [], [r.url.path for r in conflicts]


def test_a_search_looks_less_often_the_longer_it_waits(provider_http: ProviderStandIn,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A new machine takes minutes: a search looks again 2 s after its first look, then each wait
    half as long again, up to 15 s (here scaled down tenfold). Every 2 s for minutes, 1,000
    replacements under way were 500 calls a second to the provider's API."""
    monkeypatch.setattr(providers, "LOOK_EVERY_S", 0.2)
    monkeypatch.setattr(providers, "LOOK_AT_MOST_S", 1.5)
    provider_http.replacement = "new"
    activities = ProviderActivities(HttpProvider(provider_http.url, "provider-secret", 5))
    result = run(activities.request, request())
    assert result.follow is not None
    began = time.monotonic()
    found = run(activities.find_replacement, FindReplacement(follow=result.follow, timeout_s=6))
    assert found.node is None and time.monotonic() - began >= 6
    looks = [r for r in provider_http.requests if r.method == "GET"]
    # 0.2, 0.3, 0.45, 0.68, 1.01, 1.5, 1.5, 1.5: 9 looks in 6 s, where every 0.2 s was 31.
    assert 7 <= len(looks) <= 11, len(looks)


def test_cluster_api_refuses_a_node_it_does_not_own(kube: RealKube) -> None:
    kube.put(fleet.node("n1"))
    provider = capi(kube)
    with pytest.raises(ApplicationError) as err:
        provider.request(request())
    assert err.value.type == "Invalid" and err.value.non_retryable
    assert provider.request(request("reboot")).needs_human  # Cluster API cannot reboot


def test_cluster_api_server_error_is_retryable(kube: RealKube) -> None:
    capi_machine(kube)
    kube.inject("DELETE", "machines", status=503)
    with pytest.raises(ApplicationError) as err:
        capi(kube).request(request())
    assert err.value.type == "Unavailable" and not err.value.non_retryable
    assert kube.get(CAPI, "Machine", "md-0-abc", "capi") is not None


def test_karpenter_deletes_the_nodeclaim(kube: RealKube) -> None:
    kube.put(fleet.node("n1", labels={"karpenter.sh/nodepool": "gpu"}))
    for name, node in (("gpu-x1", "n1"), ("gpu-x2", "n2")):
        kube.put(fleet.nodeclaim(name, node=node))
    provider = KarpenterProvider(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                                 KarpenterProviderPolicy(), 5)
    assert provider.request(request()).reference == "gpu-x1"
    assert [c["metadata"]["name"] for c in kube.list("karpenter.sh/v1", "NodeClaim")] == ["gpu-x2"]
    assert "already deleted" in provider.request(request()).detail
    kube.put(fleet.node("n3"))
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
