"""Kubernetes: nodes, pods, evictions, taints, Events and the custom resources runbooks touch.

Blocking calls through the official `kubernetes` client, so these activities are plain
functions run on the worker's thread pool. Nodes and the opted-out pods are read and written as
the API's JSON (`JsonNode`): the client's model classes cost a millisecond or more an object, and
every runbook reads its node at its protective step and at each gate. Every call carries
`_request_timeout`; every write is idempotent (it reads first and does nothing when the node is
already as asked) and guarded by the object's resourceVersion, so a concurrent writer costs us a
retry, never its change.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import urllib3
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from temporalio import activity

from activities.errors import fail, from_http_status, reread_on_conflict
from activities.node_watch import NodeWatch, tick_for
from activities.out_of_service import OutOfService
from activities.shared_reads import SharedReads
from activities.waits import BlockingCalls, heartbeat, window_left
from fleetmedic.errors import ErrorKind
from fleetmedic.lemon import with_remediation
from fleetmedic.models import (
    ActionResult,
    EventRequest,
    EvictionReport,
    EvictRequest,
    FleetCapacity,
    NodeInfo,
    NodeTarget,
    OptOut,
    PodInfo,
    PodProblem,
    Taint,
    TaintRequest,
    WaitNodeReady,
)
from fleetmedic.policy import Policy
from fleetmedic.selectors import label_selector_matches

log = logging.getLogger(__name__)
T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
# Annotation set when FleetMedic found the node already cordoned by someone else: on return
# to service we take our annotations off and leave their cordon in place.
PRE_CORDONED = "fleetmedic.io/was-cordoned"
# Kinds whose Events name no namespace in their involvedObject.
CLUSTER_SCOPED = frozenset({"Node", "ClusterQueue", "ResourceFlavor"})


@contextmanager
def api_errors(what: str) -> Iterator[None]:
    """Classify client failures: 404/403/422 are final, 409/429/5xx and network errors retry."""
    try:
        yield
    except ApiException as exc:
        raise from_http_status(int(exc.status or 500), f"{what}: {exc.reason}") from None
    except urllib3.exceptions.NewConnectionError as exc:  # (a subclass of ConnectTimeoutError)
        raise fail(ErrorKind.UNAVAILABLE, f"kube-apiserver{_at(exc)} unreachable: {what}: {exc}") from None
    except urllib3.exceptions.TimeoutError as exc:
        raise fail(ErrorKind.TIMEOUT, f"kube-apiserver{_at(exc)} did not answer in time: {what}: {exc}") from None
    except urllib3.exceptions.HTTPError as exc:
        raise fail(ErrorKind.UNAVAILABLE, f"kube-apiserver{_at(exc)} unreachable: {what}: {exc}") from None


def newest_served(api: ApiClient, group: str, versions: tuple[str, ...], timeout: float) -> str | None:
    """The first of `versions` (newest first) the API server serves for `group` (discovery); None
    when it serves none of them (the group is not installed)."""
    with api_errors(f"discover the served {group} versions"):
        groups = client.ApisApi(api).get_api_versions(_request_timeout=timeout).groups or []
    served = {v.version for g in groups if g.name == group for v in g.versions or []}
    return next((v for v in versions if v in served), None)


def _at(exc: Exception) -> str:
    """" at host:port" of the connection that failed, when urllib3 says."""
    conn = getattr(exc, "conn", None) or getattr(exc, "pool", None)
    host, port = getattr(conn, "host", None), getattr(conn, "port", None)
    return f" at {host}:{port}" if host else ""


def _ready(node: client.V1Node) -> tuple[bool, datetime | None]:
    for condition in (node.status.conditions if node.status else None) or []:
        if condition.type == "Ready":
            return condition.status == "True", condition.last_transition_time
    return False, None


# A Node as the API server's JSON.
JsonNode = dict[str, Any]


def _annotations(node: JsonNode) -> dict[str, str]:
    return (node.get("metadata") or {}).get("annotations") or {}


def _unschedulable(node: JsonNode) -> bool:
    return bool((node.get("spec") or {}).get("unschedulable"))


def node_info(node: client.V1Node, gpu_resource: str) -> NodeInfo:
    meta, spec = node.metadata, node.spec
    allocatable = (node.status.allocatable if node.status else None) or {}
    ready, since = _ready(node)
    return NodeInfo(
        name=meta.name, uid=meta.uid or "", ready=ready, ready_since=since,
        unschedulable=bool(spec and spec.unschedulable),
        labels=dict(meta.labels or {}), annotations=dict(meta.annotations or {}),
        taints=[Taint(key=t.key, value=t.value or "", effect=t.effect) for t in (spec.taints or [])]
        if spec else [],
        gpu_allocatable=int(allocatable.get(gpu_resource, "0") or 0),
        provider_id=(spec.provider_id or "") if spec else "",
    )


def node_info_from_json(node: dict[str, Any], gpu_resource: str) -> NodeInfo:
    """`node_info` of a Node as the API's JSON (a watch event): the client's model classes cost
    milliseconds a node, which a watch on a large fleet pays for every heartbeat."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    since = ready.get("lastTransitionTime") if ready else None
    return NodeInfo(
        name=meta.get("name", ""), uid=meta.get("uid") or "", ready=bool(ready and ready.get("status") == "True"),
        ready_since=datetime.fromisoformat(since.replace("Z", "+00:00")) if since else None,
        unschedulable=bool(spec.get("unschedulable")), labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        taints=[Taint(key=t["key"], value=t.get("value") or "", effect=t["effect"]) for t in spec.get("taints") or []],
        gpu_allocatable=int((status.get("allocatable") or {}).get(gpu_resource, "0") or 0),
        provider_id=spec.get("providerID") or "",
    )


def pod_info(pod: client.V1Pod, gpu_resource: str) -> PodInfo:
    meta = pod.metadata
    owner = next((o for o in meta.owner_references or [] if o.controller), None)
    ready = any(c.type == "Ready" and c.status == "True"
                for c in (pod.status.conditions if pod.status else None) or [])
    gpus = 0
    for container in pod.spec.containers if pod.spec else []:
        limits = (container.resources.limits if container.resources else None) or {}
        gpus += int(limits.get(gpu_resource, "0") or 0)
    return PodInfo(
        namespace=meta.namespace or "", name=meta.name, uid=meta.uid or "",
        node=(pod.spec.node_name or "") if pod.spec else "", phase=(pod.status.phase or "") if pod.status else "",
        ready=ready, labels=dict(meta.labels or {}), owner_kind=owner.kind if owner else "",
        owner_name=owner.name if owner else "",
        mirror="kubernetes.io/config.mirror" in (meta.annotations or {}), gpus=gpus,
    )


class KubernetesActivities:
    def __init__(self, api_client: Callable[[], ApiClient], policy: Policy, *, timeout_s: float = 10.0,
                 force_dry_run: bool = False, blocking: BlockingCalls | None = None) -> None:
        self._api_client = api_client
        self.blocking = blocking or BlockingCalls()  # the async waits' API calls
        self._client: ApiClient | None = None
        self.policy = policy
        self.timeout = timeout_s
        self.force_dry_run = force_dry_run
        self.shared_opt_outs: SharedReads[None, list[dict[str, Any]]] = SharedReads(
            lambda _: {None: self._list_opted_out_pods()})
        self.cached_opt_outs: SharedReads[None, list[dict[str, Any]]] = SharedReads(
            lambda _: {None: self._list_opted_out_pods(cached=True)})
        self.node_watch = NodeWatch(lambda: self.core, lambda n: node_info_from_json(n, policy.labels.gpu_resource),
                                    timeout_s,
                                    OutOfService(policy.labels.gpu_node_selector, policy.labels.workflow_annotation))

    @property
    def core(self) -> client.CoreV1Api:
        if self._client is None:
            self._client = self._api_client()
        return client.CoreV1Api(self._client)

    @property
    def custom(self) -> client.CustomObjectsApi:
        if self._client is None:
            self._client = self._api_client()
        return client.CustomObjectsApi(self._client)

    def warm(self) -> None:
        """Build the client and open a connection before the first runbook needs it: the first call
        otherwise pays for loading the configuration and the client's models (~0.7 s)."""
        try:
            self.read_node("fleetmedic-warm-up")
        except Exception as exc:  # NotFound is the expected answer; anything else only costs latency
            log.debug("kubernetes warm-up: %s", exc)
        self.node_watch.out_of_service()  # the node watch starts now: the cordon breaker counts from it

    def _dry(self, requested: bool) -> bool:
        return requested or self.force_dry_run

    # --- reads -------------------------------------------------------------------------------

    def read_node(self, name: str) -> JsonNode:
        with api_errors(f"get node {name}"):
            response = self.core.read_node(name, _preload_content=False, _request_timeout=self.timeout)
        node: JsonNode = json.loads(response.data)
        return node

    def find_node(self, name: str) -> JsonNode | None:
        """The node, or None when it does not exist (any other failure is raised)."""
        try:
            return self.read_node(name)
        except Exception as exc:
            if getattr(exc, "type", None) == ErrorKind.NOT_FOUND:
                return None
            raise

    def pods_on(self, node: str) -> list[client.V1Pod]:
        with api_errors(f"list pods on {node}"):
            return list(self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _request_timeout=self.timeout).items)

    @activity.defn(name="k8s.get_node")
    def get_node(self, name: str) -> NodeInfo | None:
        """The node, or None when it does not exist (the runbook ends `unknown-node`)."""
        node = self.find_node(name)
        return node_info_from_json(node, self.policy.labels.gpu_resource) if node is not None else None

    def raw_list(self, what: str, call: Callable[..., Any], **kwargs: Any) -> list[dict[str, Any]]:
        """A list call as plain JSON: the client's model objects cost milliseconds per object, and a
        fleet's nodes are listed whenever the fleet guard counts them (a storm asks it again and again)."""
        with api_errors(what):
            response = call(_preload_content=False, _request_timeout=self.timeout, **kwargs)
        return list(json.loads(response.data).get("items") or [])

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Pods of `namespace` that `label_selector` selects, as plain JSON (Slinky's slurmd pods)."""
        return self.raw_list(f"list pods {label_selector} in {namespace}", self.core.list_namespaced_pod,
                             namespace=namespace, label_selector=label_selector)

    def list_nodes(self, label_selector: str) -> list[NodeInfo]:
        return [node_info_from_json(n, self.policy.labels.gpu_resource) for n in self.raw_list(
            "list nodes", self.core.list_node, label_selector=label_selector or None)]

    @activity.defn(name="k8s.fleet_capacity")
    def fleet_capacity(self, gpu_node_selector: str, topology_label: str | None = None) -> FleetCapacity:
        """GPU nodes, and those already out of service (NotReady or cordoned) with their topology
        domain, for the fleet guard."""
        nodes = self.list_nodes(gpu_node_selector)
        out = [n for n in nodes if not n.ready or n.unschedulable]
        domains = {n.name: n.labels[topology_label] for n in out if topology_label and n.labels.get(topology_label)}
        return FleetCapacity(gpu_nodes=len(nodes), unavailable=sorted(n.name for n in out), domains=domains)

    def list_pods_on_node(self, node: str) -> list[PodInfo]:
        return [pod_info(p, self.policy.labels.gpu_resource) for p in self.pods_on(node)]

    @activity.defn(name="k8s.check_opt_out")
    def check_opt_out(self, node: str) -> OptOut:
        """The opt-out label on the node or on any pod running on it stops destructive steps."""
        return self.look(node)[1]

    def look(self, node: str, opted_out_pods: Callable[[], list[dict[str, Any]] | None] | None = None,
             ) -> tuple[JsonNode | None, OptOut]:
        """The node and its opt-out (its label, or a label of a pod running on it), read now.
        `opted_out_pods`: the answer of a read of the opted-out pods the caller started beside this
        one (the protective step: the node read and the list then take the time of the slower, not
        of both); by default they are read here, after the node."""
        key, value = self.policy.labels.opt_out_pair
        reasons = []
        found = self.find_node(node)
        if found is None:
            return None, OptOut(opted_out=False, missing=True, reasons=[f"node {node} does not exist"])
        if ((found.get("metadata") or {}).get("labels") or {}).get(key) == value:
            reasons.append(f"node {node} has {key}={value}")
        for pod in (opted_out_pods or self.opted_out_pods)() or []:
            if (pod.get("spec") or {}).get("nodeName") == node:
                meta = pod.get("metadata") or {}
                reasons.append(f"pod {meta.get('namespace')}/{meta.get('name')} has {key}={value}")
        return found, OptOut(opted_out=bool(reasons), reasons=reasons)

    def opted_out_pods(self) -> list[dict[str, Any]] | None:
        """Every pod carrying the opt-out label, from a read that started after this call (shared
        with the callers asking at the same time)."""
        return self.shared_opt_outs.get(None)

    def opted_out_pods_cached(self) -> list[dict[str, Any]] | None:
        """The same list from the API server's watch cache (`resourceVersion=0`), for the protective
        step. A list without a resourceVersion is a consistent read: the API server first asks etcd
        for its latest revision, then waits until its watch cache of pods has caught up with it
        (KEP-2340, consistent reads from cache), and a cache that sees no pod change catches up only
        at etcd's next progress notification. Here that wait was 70-95 ms in two of three alerts
        that came one at a time (bench/xid_latency's world: kwok's 1,320 nodes write their status,
        the pods do not change), most of the time from an alert to its cordon. The watch cache may
        lag etcd by milliseconds: a label put on a pod in that moment is missed by the protective
        step (cordon and DRAIN, reversible), and found by the consistent check before the first
        destructive step, which then stops the run and tells a person, as for a label put on
        after the protective step."""
        return self.cached_opt_outs.get(None)

    def _list_opted_out_pods(self, cached: bool = False) -> list[dict[str, Any]]:
        """Every pod carrying the opt-out label, in one list: the opted-out pods are few, where a
        list per node returns every pod on it. Runs asking at once share it (activities/shared_reads.py)."""
        key, value = self.policy.labels.opt_out_pair
        return self.raw_list("list opted-out pods", self.core.list_pod_for_all_namespaces,
                             label_selector=f"{key}={value}", resource_version="0" if cached else None)

    @activity.defn(name="k8s.wait_node_ready")
    async def wait_node_ready(self, request: WaitNodeReady) -> NodeInfo | None:
        """Until the node is Ready again after `since`; None at the timeout. No thread and no
        connection of its own: the worker's one node watch (activities/node_watch.py) wakes it.

        One call spans the run's deadline, so
        a 30-minute wait costs a handful of history events and the heartbeats; an abort cancels it.
        """
        def back(info: NodeInfo | None) -> NodeInfo | None:  # None: a replacement has not registered yet
            if info is None or not info.ready:
                return None
            fresh = request.since is None or (info.ready_since is not None and info.ready_since >= request.since)
            return info if fresh else None

        return await self.node_watch.wait(request.node, back, window_left(request.timeout_s),
                                          lambda: activity.heartbeat("waiting for Ready"),
                                          tick_for(activity.info().heartbeat_timeout))

    # --- node writes ---------------------------------------------------------------------------

    def _patch_node(self, name: str, resource_version: str, patch: dict[str, Any]) -> None:
        patch.setdefault("metadata", {})["resourceVersion"] = resource_version
        with api_errors(f"patch node {name}"):
            # The answer is not parsed (the next step reads the node afresh), but it is read to its
            # end: an unread answer keeps its connection out of the pool, and every write opened a
            # new one (a TLS handshake for the worker and the API server each).
            response = self.core.patch_node(name, patch, _content_type=MERGE_PATCH, _preload_content=False,
                                            _request_timeout=self.timeout)
            response.drain_conn()
            response.release_conn()

    def _update_node(self, name: str, change: Callable[[JsonNode], dict[str, Any] | None],
                     current: JsonNode | None = None) -> bool:
        """Read-modify-write with the resourceVersion; re-read and retry on 409. False: no-op.
        `current`: the node as just read (the protective step's read): the first try writes on it."""
        first: list[JsonNode] = [current] if current is not None else []

        def attempt() -> bool:
            node = first.pop() if first else self.read_node(name)  # a 409 reads it again
            patch = change(node)
            if patch is None:
                return False
            self._patch_node(name, (node.get("metadata") or {}).get("resourceVersion", ""), patch)
            return True

        return reread_on_conflict(f"node {name}", attempt)

    def _holder(self, node: JsonNode, target: NodeTarget) -> str | None:
        """The workflow holding the node (our annotation); another run's hold is not ours to change."""
        owner = _annotations(node).get(self.policy.labels.workflow_annotation)
        if owner and owner != target.workflow_id:
            raise fail(ErrorKind.NOT_OWNED, f"node {target.node} is held by workflow {owner}, not us")
        return owner

    def _remediation(self, node: JsonNode) -> dict[str, str]:
        """This run's remediation added to the node's record, which the lemon rule reads (a cordon or
        taint that takes the node out is one remediation; a retried write is the same entry)."""
        key = self.policy.labels.remediations_annotation
        value = with_remediation(_annotations(node).get(key), datetime.now(UTC),
                                 activity.info().workflow_run_id or "", self.policy.lemon.keep)
        return {key: value} if value is not None else {}

    @activity.defn(name="k8s.cordon_node")
    def cordon_node(self, target: NodeTarget) -> ActionResult:
        return self.cordon(target)

    def cordon(self, target: NodeTarget, current: JsonNode | None = None) -> ActionResult:
        """Cordon the node for `target`'s run; `current`: the node as just read, if it was."""
        workflow_key = self.policy.labels.workflow_annotation
        reason_key = self.policy.labels.reason_annotation

        def change(node: JsonNode) -> dict[str, Any] | None:
            owner = self._holder(node, target)
            record = self._remediation(node) if target.remediation else {}
            if _unschedulable(node) and owner == target.workflow_id and not record:
                return None
            new = {workflow_key: target.workflow_id, reason_key: target.reason, **record}
            if _unschedulable(node) and not owner:
                new[PRE_CORDONED] = "true"  # someone else's cordon: keep it when we are done
            return {"spec": {"unschedulable": True}, "metadata": {"annotations": new}}

        return self._node_action("cordon", target, change, current)

    @activity.defn(name="k8s.uncordon_node")
    def uncordon_node(self, target: NodeTarget) -> ActionResult:
        workflow_key = self.policy.labels.workflow_annotation
        reason_key = self.policy.labels.reason_annotation

        def change(node: JsonNode) -> dict[str, Any] | None:
            annotations = _annotations(node)
            owner = self._holder(node, target)
            if not owner:
                return None  # not ours (or already returned): leave it as it is
            patch: dict[str, Any] = {"metadata": {"annotations": {workflow_key: None, reason_key: None,
                                                                  PRE_CORDONED: None}}}
            if annotations.get(PRE_CORDONED) != "true":
                patch["spec"] = {"unschedulable": None}
            return patch

        return self._node_action("uncordon", target, change)

    @activity.defn(name="k8s.annotate_quarantine")
    def annotate_quarantine(self, target: NodeTarget) -> ActionResult:
        """Leave a node out of service on purpose: the annotation says why, for whoever finds it."""
        reason_key = self.policy.labels.reason_annotation
        if self.find_node(target.node) is None:
            # Its machine is gone and the provider deleted the Node: nothing is left to mark.
            return ActionResult(system="kubernetes", action="annotate", target=f"node {target.node}", changed=False,
                                dry_run=self._dry(target.dry_run), detail="the node no longer exists")

        def change(node: JsonNode) -> dict[str, Any] | None:
            if _annotations(node).get(reason_key) == target.reason and _unschedulable(node):
                return None
            return {"spec": {"unschedulable": True}, "metadata": {"annotations": {reason_key: target.reason}}}

        return self._node_action("annotate", target, change)

    @activity.defn(name="k8s.retire_node")
    def retire_node(self, target: NodeTarget) -> ActionResult:
        """What a replaced node leaves behind: a Node object the provider did not delete. NotReady
        (the machine is gone), it is deleted; still Ready, it is left cordoned and annotated (the old
        machine still runs: a person decides). Gone already: nothing to do."""
        node = self.find_node(target.node)
        done = ActionResult(system="kubernetes", action="retire", target=f"node {target.node}", changed=False,
                            dry_run=self._dry(target.dry_run))
        if node is None:
            return done.model_copy(update={"detail": "already gone (the provider deleted it)"})
        self._holder(node, target)
        if node_info_from_json(node, self.policy.labels.gpu_resource).ready:
            self.annotate_quarantine(target)
            return done.model_copy(update={"changed": not done.dry_run,
                                           "detail": f"still Ready: left cordoned ({target.reason})"})
        if done.dry_run:
            return done.model_copy(update={"detail": "would delete the Node object (NotReady)"})
        with api_errors(f"delete node {target.node}"):
            try:
                self.core.delete_node(target.node, body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(uid=(node.get("metadata") or {}).get("uid"))),
                    _request_timeout=self.timeout)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        return done.model_copy(update={"changed": True, "detail": "deleted the Node object (NotReady)"})

    def _node_action(self, verb: str, target: NodeTarget, change: Callable[[JsonNode], dict[str, Any] | None],
                     current: JsonNode | None = None) -> ActionResult:
        if self._dry(target.dry_run):
            would_change = change(current or self.read_node(target.node)) is not None
            return ActionResult(system="kubernetes", action=verb, target=f"node {target.node}",
                                changed=False, dry_run=True,
                                detail=target.reason if would_change else "already so")
        changed = self._update_node(target.node, change, current)
        return ActionResult(system="kubernetes", action=verb, target=f"node {target.node}", changed=changed,
                            detail=target.reason)

    def _taint_action(self, request: TaintRequest, add: bool, current: JsonNode | None = None) -> ActionResult:
        taint = request.taint
        workflow_key = self.policy.labels.workflow_annotation
        reason_key = self.policy.labels.reason_annotation

        def change(node: JsonNode) -> dict[str, Any] | None:
            patch: dict[str, Any] = {}
            if request.workflow_id:
                owner = self._holder(node, NodeTarget(node=request.node, workflow_id=request.workflow_id))
                if add and not owner:
                    patch["metadata"] = {"annotations": {workflow_key: request.workflow_id,
                                                         reason_key: request.reason, **self._remediation(node)}}
                elif not add and owner and not _unschedulable(node):
                    # Ours, and no cordon of ours left on it: the hold ends with the taint.
                    patch["metadata"] = {"annotations": {workflow_key: None, reason_key: None}}
            current = list((node.get("spec") or {}).get("taints") or [])
            others = [t for t in current if not (t["key"] == taint.key and t["effect"] == taint.effect)]
            wanted = others + ([{"key": taint.key, "value": taint.value or None, "effect": taint.effect}]
                               if add else [])
            wanted = [{k: v for k, v in t.items() if v is not None and k != "timeAdded"} for t in wanted]
            trimmed = [{k: v for k, v in t.items() if v is not None and k != "timeAdded"} for t in current]
            if wanted != trimmed:
                patch["spec"] = {"taints": wanted}  # a merge patch replaces the list as a whole
            return patch or None

        verb = "add taint" if add else "remove taint"
        target = f"{taint} on node {request.node}"
        if self._dry(request.dry_run):
            would = change(current or self.read_node(request.node)) is not None
            return ActionResult(system="kubernetes", action=verb, target=target, changed=False, dry_run=True,
                                detail="" if would else "already so")
        return ActionResult(system="kubernetes", action=verb, target=target,
                            changed=self._update_node(request.node, change, current))

    @activity.defn(name="k8s.add_taint")
    def add_taint(self, request: TaintRequest) -> ActionResult:
        return self._taint_action(request, add=True)

    def taint(self, request: TaintRequest, current: JsonNode | None = None) -> ActionResult:
        """Add `request`'s taint; `current`: the node as just read, if it was."""
        return self._taint_action(request, add=True, current=current)

    @activity.defn(name="k8s.remove_taint")
    def remove_taint(self, request: TaintRequest) -> ActionResult:
        return self._taint_action(request, add=False)

    # --- eviction -------------------------------------------------------------------------------

    @activity.defn(name="k8s.evict_pods")
    async def evict_pods(self, request: EvictRequest) -> EvictionReport:
        """Evict every pod on the node through the Eviction API, like `kubectl drain`.

        DaemonSet, Slinky NodeSet and mirror pods are skipped (their controllers put them straight back); a
        PodDisruptionBudget's 429 is waited out until the deadline; pods that never leave are
        reported, not hidden. Heartbeats carry progress so a retried attempt can be watched.
        Async, on the waits queue: the PDB backoff and the wait for terminating pods hold no thread.
        """
        deadline = time.monotonic() + request.deadline_s
        pending: list[client.V1Pod] = []
        skipped: list[PodProblem] = []
        for pod in await self.blocking(self.pods_on, request.node):
            info = pod_info(pod, self.policy.labels.gpu_resource)
            if info.owner_kind == "DaemonSet":
                skipped.append(PodProblem(pod=info.ref, reason="DaemonSet pod"))
            elif info.owner_kind == "NodeSet":
                # Slinky's slurmd: the node's Slurm side, taken out through Slurm (DRAIN, DOWN); evicted,
                # its NodeSet would only start it again, and a node coming back would have no Slurm node.
                skipped.append(PodProblem(pod=info.ref, reason="Slinky NodeSet pod (slurmd)"))
            elif info.mirror:
                skipped.append(PodProblem(pod=info.ref, reason="mirror (static) pod"))
            elif info.phase in ("Succeeded", "Failed"):
                skipped.append(PodProblem(pod=info.ref, reason=f"already {info.phase}"))
            elif request.selector and not label_selector_matches(request.selector, info.labels):
                skipped.append(PodProblem(pod=info.ref, reason=f"not selected by {request.selector}"))
            else:
                pending.append(pod)
        if self._dry(request.dry_run):
            return EvictionReport(node=request.node, dry_run=True, skipped=skipped,
                                  evicted=[f"{p.metadata.namespace}/{p.metadata.name}" for p in pending])

        evicted, left, last_error = await self.evict_until(pending, deadline)
        await self._wait_gone(request.node, evicted, deadline)
        failed = [PodProblem(pod=ref, reason=last_error.get(ref, "deadline")) for ref in left]
        return EvictionReport(node=request.node, evicted=evicted, skipped=skipped, failed=failed)

    async def evict_until(self, pending: list[client.V1Pod],
                          deadline: float) -> tuple[list[str], list[str], dict[str, str]]:
        """Evict each pod, waiting out PodDisruptionBudget refusals (backoff) until `deadline`.
        Returns (evicted, still there, why each one is still there)."""
        evicted: list[str] = []
        last_error: dict[str, str] = {}
        delay = 0.2
        while pending and time.monotonic() < deadline:
            still: list[client.V1Pod] = []
            for pod in pending:
                ref = f"{pod.metadata.namespace}/{pod.metadata.name}"
                outcome = await self.blocking(self._evict_one, pod)
                if outcome is None:
                    evicted.append(ref)
                else:
                    last_error[ref] = outcome
                    still.append(pod)
            pending = still
            heartbeat({"evicted": len(evicted), "waiting": len(pending)})
            if pending:
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 5.0)
        return evicted, [f"{p.metadata.namespace}/{p.metadata.name}" for p in pending], last_error

    def _evict_one(self, pod: client.V1Pod) -> str | None:
        """None when the pod is evicted (or already gone); else why it is still there."""
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod.metadata.name,
                                                              namespace=pod.metadata.namespace))
        try:
            self.core.create_namespaced_pod_eviction(pod.metadata.name, pod.metadata.namespace, body,
                                                     _request_timeout=self.timeout)
            return None
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status == 429:
                return "PodDisruptionBudget does not allow it yet"
            if exc.status in (401, 403):
                raise from_http_status(exc.status, f"evict {pod.metadata.name}: {exc.reason}") from None
            return f"HTTP {exc.status} {exc.reason}"
        except urllib3.exceptions.HTTPError as exc:
            return f"API unreachable: {exc}"

    async def _wait_gone(self, node: str, refs: list[str], deadline: float) -> None:
        while refs and time.monotonic() < deadline:
            present = {f"{p.metadata.namespace}/{p.metadata.name}" for p in await self.blocking(self.pods_on, node)}
            if not present.intersection(refs):
                return
            heartbeat({"terminating": len(present.intersection(refs))})
            await asyncio.sleep(0.5)

    # --- events -------------------------------------------------------------------------------

    @activity.defn(name="k8s.record_event")
    def record_event(self, request: EventRequest) -> ActionResult:
        # A deterministic name makes a retried activity find its own Event instead of a duplicate.
        digest = hashlib.sha256(f"{request.reason}|{request.message}".encode()).hexdigest()[:10]
        name = f"{request.name}.fleetmedic.{digest}"
        target = f"Event {request.reason} on {request.kind} {request.name}"
        if self._dry(request.dry_run):
            return ActionResult(system="kubernetes", action="record", target=target, changed=False, dry_run=True,
                                detail=request.message)
        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=name, namespace=request.namespace),
            involved_object=client.V1ObjectReference(kind=request.kind, name=request.name,
                                                     api_version=request.api_version,
                                                     namespace=None if request.kind in CLUSTER_SCOPED
                                                     else request.namespace),
            reason=request.reason, message=request.message[:1024], type=request.type,
            source=client.V1EventSource(component="fleetmedic"),
            first_timestamp=now, last_timestamp=now, count=1,
            reporting_component="fleetmedic", reporting_instance=activity.info().workflow_id,
        )
        try:
            self.core.create_namespaced_event(request.namespace, event, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 409:
                return ActionResult(system="kubernetes", action="record", target=target, changed=False)
            raise from_http_status(int(exc.status or 500), f"create event: {exc.reason}") from None
        except urllib3.exceptions.HTTPError as exc:
            raise fail(ErrorKind.UNAVAILABLE, f"create event: {exc}") from None
        return ActionResult(system="kubernetes", action="record", target=target, changed=True,
                            detail=request.message)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.get_node, self.wait_node_ready, self.fleet_capacity, self.check_opt_out, self.cordon_node,
                self.uncordon_node, self.annotate_quarantine, self.retire_node, self.add_taint, self.remove_taint,
                self.evict_pods, self.record_event]
