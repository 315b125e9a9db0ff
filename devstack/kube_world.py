"""What tests (and `fleetmedic dev`) do to the real control plane: put and read objects as a
controller would, make a node NotReady, and read back what FleetMedic's identities sent.

`RealKube` puts and reads objects (`put`, `get`, `list`, `remove`), injects faults through the
proxy (`inject`) and reads what FleetMedic sent from the audit log (`requests`, `mutations`).
Objects are validated and defaulted, status belongs to its controllers (kwok for nodes and pods,
the disruption controller for PDBs), evicted pods take their grace period to go, and
FleetMedic's requests are judged by RBAC and read from the audit log.
"""

from __future__ import annotations

import builtins
import copy
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

from devstack.kube_cluster import NOT_READY_ANNOTATION, LocalKubeCluster, install_rbac_and_crds
from devstack.kube_faults import FaultProxy

SYSTEM_NAMESPACES = frozenset({"kube-system", "kube-public", "kube-node-lease", "fleetmedic"})
VERB_METHOD = {"get": "GET", "list": "GET", "watch": "GET", "create": "POST", "update": "PUT", "patch": "PATCH",
               "delete": "DELETE", "deletecollection": "DELETE"}
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Kinds a test may leave behind: removed after each test (namespaced ones in every test namespace).
# Owners before what they own: a ReplicaSet still there when its pods go would make them again (and
# without the garbage collector nothing would remove those).
CLEANUP_KINDS = [("apps/v1", "Deployment"), ("apps/v1", "ReplicaSet"), ("apps/v1", "DaemonSet"), ("batch/v1", "Job"),
                 ("v1", "Pod"), ("policy/v1", "PodDisruptionBudget"), ("v1", "Event")]


@dataclass
class _Method:
    value: str


@dataclass
class _Url:
    path: str
    query: dict[str, str]


@dataclass
class AuditedRequest:
    """One request as the apiserver's audit log saw it."""

    method: _Method
    url: _Url
    params: dict[str, str]
    data: Any
    verb: str
    user: str
    code: int
    event: dict[str, Any] = field(repr=False)


@contextmanager
def local_kube(workdir: Path) -> Iterator[RealKube]:
    """A control plane of its own in `workdir` (benchmarks): started, its roles and CRDs installed,
    stopped on the way out."""
    with LocalKubeCluster(workdir / "kube") as cluster:
        install_rbac_and_crds(cluster)
        yield RealKube(cluster, None, workdir)


class RealKube:
    def __init__(self, cluster: LocalKubeCluster, proxy: FaultProxy | None, workdir: Path,
                 identity: str = "worker") -> None:
        self.cluster = cluster
        self.proxy = proxy
        self.api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig("admin")))
        # Its discovery cache beside the cluster's own files: by default the client leaves one in
        # /tmp for every API server it meets (tmpfile osrcp-<hash of the address>.json, ~55 KB each).
        self.dynamic = DynamicClient(self.api, cache_file=str(cluster.workdir / "discovery-cache.json"))
        self.audit_offset = cluster.audit_log.stat().st_size if cluster.audit_log.exists() else 0
        self.began = datetime.now(UTC)
        self.identity = identity
        # FleetMedic's processes reach the apiserver as `identity` (through the fault proxy in tests).
        self.kubeconfig = self.write_kubeconfig(workdir / "kubeconfig", identity)

    # --- kubeconfigs -------------------------------------------------------------------------------

    def write_kubeconfig(self, path: Path, identity: str = "worker") -> Path:
        config = yaml.safe_load(self.cluster.kubeconfig(identity).read_text())
        if self.proxy is not None:
            config["clusters"][0]["cluster"] = {"server": self.proxy.url}
        path.write_text(yaml.safe_dump(config))
        return path

    # --- objects -----------------------------------------------------------------------------------

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def ensure_namespace(self, name: str) -> None:
        core = k8s_client.CoreV1Api(self.api)
        try:
            core.read_namespace(name)
        except k8s_client.ApiException as exc:
            if exc.status != 404:
                raise
            try:
                core.create_namespace({"metadata": {"name": name}})
            except k8s_client.ApiException as again:
                if again.status != 409:
                    raise

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace `obj` as a controller would: spec and metadata, then its status where
        the API keeps one apart. A Node or Pod that is not Ready is made so the way kwok knows."""
        obj = copy.deepcopy(obj)
        resource = self._resource(obj["apiVersion"], obj["kind"])
        meta = obj.setdefault("metadata", {})
        meta.pop("resourceVersion", None)
        meta.pop("uid", None)
        namespace = meta.setdefault("namespace", "default") if resource.namespaced else None
        if namespace:
            self.ensure_namespace(namespace)
        status = obj.get("status")
        if obj["kind"] in ("Node", "Pod") and not _ready(status):
            meta.setdefault("annotations", {})[NOT_READY_ANNOTATION] = "true"
        elif obj["kind"] in ("Node", "Pod"):
            meta.setdefault("annotations", {}).pop(NOT_READY_ANNOTATION, None)
        if obj["kind"] == "Pod":
            obj.pop("status", None)  # the kubelet's (kwok's)
            obj["spec"].setdefault("terminationGracePeriodSeconds", 1)
        for attempt in range(40):  # kwok and the controllers write status too: a 409 means read again
            try:
                stored = self._put_once(resource, obj, status, namespace)
                break
            except ConflictError:
                time.sleep(min(0.5, 0.02 * (attempt + 1)))
        else:
            raise RuntimeError(f"could not put {obj['kind']} {meta['name']}: conflicts")
        self._settle(obj["apiVersion"], obj["kind"], meta["name"], namespace)
        return stored

    def _settle(self, api_version: str, kind: str, name: str, namespace: str | None, timeout: float = 15) -> None:
        """Wait until the controllers have acted on a new object, so a test starts from a settled
        world: a pod runs (kwok), a PDB's allowance is computed (the disruption controller). A test
        that wants the in-between states creates objects through the API itself."""
        if kind not in ("Pod", "PodDisruptionBudget"):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.get(api_version, kind, name, namespace)
            if current is None:
                return
            status = current.get("status") or {}
            if kind == "Pod" and (status.get("phase") in ("Running", "Succeeded", "Failed")
                                  or self.get("v1", "Node", current["spec"].get("nodeName") or "-") is None):
                return  # running, or bound to a node that does not exist (Pending for good, as in a cluster)
            if kind == "PodDisruptionBudget" and (status.get("observedGeneration") == current["metadata"]["generation"]
                                                  or status.get("conditions")):
                return  # computed, or refused by the controller (no scalable owner): SyncFailed
            time.sleep(0.05)
        raise TimeoutError(f"{kind} {namespace}/{name} not settled within {timeout:g}s: {current}")

    def _put_once(self, resource: Any, obj: dict[str, Any], status: Any, namespace: str | None) -> dict[str, Any]:
        meta = obj["metadata"]
        try:
            existing = resource.get(name=meta["name"], namespace=namespace)
        except NotFoundError:
            stored: dict[str, Any] = resource.create(body=obj, namespace=namespace).to_dict()
        else:
            if obj["kind"] == "Pod":
                # A pod's spec is immutable: only its metadata (labels, annotations) can change.
                annotations: dict[str, Any] = dict(meta.get("annotations") or {})
                annotations.setdefault(NOT_READY_ANNOTATION, None)
                patch = {"metadata": {"labels": meta.get("labels") or {}, "annotations": annotations}}
                stored = resource.patch(body=patch, name=meta["name"], namespace=namespace,
                                        content_type="application/merge-patch+json").to_dict()
            else:
                meta["resourceVersion"] = existing.metadata.resourceVersion
                stored = resource.replace(body=obj, namespace=namespace).to_dict()
        if status is not None and obj["kind"] != "Pod" and _has_status(resource):
            # Merge-patch the status: no resourceVersion to race kwok's heartbeats with.
            stored = self.dynamic.request(
                "patch", resource.path(name=meta["name"], namespace=namespace) + "/status", body={"status": status},
                content_type="application/merge-patch+json").to_dict()
        return stored

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        resource = self._resource(api_version, kind)
        try:
            found: dict[str, Any] = resource.get(name=name, namespace=(namespace or "default")
                                                 if resource.namespaced else None).to_dict()
        except NotFoundError:
            return None
        return found

    def list(self, api_version: str, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        resource = self._resource(api_version, kind)
        items = [i.to_dict() for i in resource.get(namespace=namespace if resource.namespaced else None).items]
        if kind == "Event":
            # FleetMedic's Events, not the controllers' (RegisteredNode, Scheduled...).
            items = [e for e in items if str(e.get("reportingComponent") or e.get("source", {}).get("component", ""))
                     .startswith("fleetmedic")]
        return sorted(items, key=lambda o: o["metadata"]["name"])

    def remove(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        resource = self._resource(api_version, kind)
        try:
            resource.delete(name=name, namespace=(namespace or "default") if resource.namespaced else None,
                            body={"gracePeriodSeconds": 0})
        except NotFoundError:
            pass

    def set_ready(self, node: str, ready: bool, timeout: float = 20) -> None:
        """Make a node NotReady (or Ready again) the way a kubelet's status does, through kwok."""
        patch = {"metadata": {"annotations": {NOT_READY_ANNOTATION: None if ready else "true"}}}
        k8s_client.CoreV1Api(self.api).patch_node(node, patch)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            obj = self.get("v1", "Node", node)
            if obj is None:
                raise KeyError(node)
            if _ready(obj.get("status")) == ready:
                return
            time.sleep(0.1)
        raise TimeoutError(f"node {node} did not become {'Ready' if ready else 'NotReady'} in {timeout:g}s")

    # --- failures and what FleetMedic sent -----------------------------------------------------------

    def inject(self, method: str | None, plural: str | None, **kwargs: Any) -> Any:
        if self.proxy is None:
            raise RuntimeError("no fault proxy in front of this API server")
        return self.proxy.inject(method, plural, **kwargs)

    def requests(self, identities: tuple[str, ...] | None = None) -> builtins.list[AuditedRequest]:
        """Every request FleetMedic's identities sent since this test began, in order."""
        users = {self.cluster.identity_user(i) for i in (identities or ("worker", "webhook", "agent"))}
        out = []
        seen: set[str] = set()
        with self.cluster.audit_log.open() as log:
            log.seek(self.audit_offset)
            for line in log:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                user = event.get("user", {}).get("username", "")
                if user not in users or event.get("auditID") in seen:
                    continue  # a watch is logged when it starts and again when it ends
                if datetime.fromisoformat(event["requestReceivedTimestamp"]) < self.began:
                    continue  # an earlier test's watch, ending now
                seen.add(event.get("auditID", ""))
                split = urlsplit(event["requestURI"])
                query = dict(parse_qsl(split.query))
                out.append(AuditedRequest(
                    method=_Method(VERB_METHOD.get(event["verb"], "GET")), url=_Url(split.path, query), params=query,
                    data=event.get("requestObject"), verb=event["verb"], user=user,
                    code=int(event.get("responseStatus", {}).get("code", 0)), event=event))
        return out

    @property
    def _requests(self) -> builtins.list[AuditedRequest]:
        return self.requests()

    def mutations(self) -> builtins.list[AuditedRequest]:
        return [r for r in self.requests() if r.method.value in MUTATING]

    # --- between tests -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Remove what a test created (nodes, and workloads in every test namespace) and its faults."""
        if self.proxy is not None:
            self.proxy.clear()
        core = k8s_client.CoreV1Api(self.api)
        namespaces = [n.metadata.name for n in core.list_namespace().items
                      if n.metadata.name not in SYSTEM_NAMESPACES]
        extra = self.extra_kinds()
        for api_version, kind in [*CLEANUP_KINDS, *extra]:
            resource = self._resource(api_version, kind)
            for namespace in (namespaces if resource.namespaced else [None]):
                self._delete_all(resource, namespace)
        for api_version, kind in extra:
            # A custom object whose controller (a test's) is gone keeps its finalizer for ever.
            for obj in self.list(api_version, kind):
                meta = obj["metadata"]
                if not meta.get("finalizers"):
                    continue
                try:
                    self.dynamic.request(
                        "patch", self._resource(api_version, kind).path(name=meta["name"],
                                                                         namespace=meta.get("namespace")),
                        body={"metadata": {"finalizers": None}}, content_type="application/merge-patch+json")
                except NotFoundError:
                    pass
        self._delete_all(self._resource("v1", "Node"), None)
        # The next test starts on an empty fleet, not on objects still on their way out.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (core.list_node(limit=1).items or any(
                core.list_namespaced_pod(ns, limit=1).items for ns in namespaces)):
            time.sleep(0.1)

    def _delete_all(self, resource: Any, namespace: str | None) -> None:
        """DELETE on the collection, no grace: what the test left goes at once."""
        try:
            self.dynamic.request("delete", resource.path(namespace=namespace),
                                 body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                                       "propagationPolicy": "Background"})
        except NotFoundError:
            pass

    def extra_kinds(self) -> builtins.list[tuple[str, str]]:
        """Custom resources installed in the cluster (Kueue, Cluster API, Karpenter): emptied too."""
        out = []
        for crd in self.list("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
            version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
            out.append((f"{crd['spec']['group']}/{version}", crd["spec"]["names"]["kind"]))
        return out


def _ready(status: dict[str, Any] | None) -> bool:
    for condition in (status or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return True  # no condition stated: let kwok make it Ready


def _has_status(resource: Any) -> bool:
    return "status" in (getattr(resource, "subresources", None) or {})
