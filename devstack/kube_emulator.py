"""A Kubernetes API stand-in for tests and `fleetmedic dev`, built on kmock.

No kube-apiserver can run on our CI machines, so this emulator serves the slice of the API the
runbooks rely on, with the semantics they rely on — which kmock's own emulator does not give
(it stores objects as sent, has no resourceVersion, no selectors, no eviction, and applies a
PATCH even when an injected error answers it):

- uid, creationTimestamp and a cluster-wide resourceVersion on every write; 409 Conflict on a
  write that carries a stale resourceVersion; no-op patches keep the resourceVersion;
- merge patches (strategic merge patches are applied as merge patches) and JSON patches;
- label selectors (=, ==, !=, in, notin, exists, !exists) and field selectors
  (metadata.name, metadata.namespace, spec.nodeName, status.phase, spec.unschedulable,
  involvedObject.*) on list and watch;
- watch from a resourceVersion, with timeoutSeconds;
- `pods/eviction` that honours PodDisruptionBudgets (429 when one forbids it);
- Events, and any custom resource (Kueue, Cluster API, Karpenter) registered with `add_resource`;
- faults injected per method/resource/name, applied before any state change;
- every request recorded (kmock's `requests`), so tests can assert what reached the API.

Controllers do not exist here: a test that needs a ReplicaSet to recreate a pod drives it.
The emulator runs on its own event loop in a thread (`KubeEmulatorThread`), so blocking client
code in tests and activities can call it without deadlocking the test's loop.
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import json
import re
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal.k8s import KubernetesError

from fleetmedic.selectors import label_selector_matches, match_labels_selector, split_selector

# (group, version, plural) -> (kind, namespaced)
CORE_RESOURCES: dict[tuple[str, str, str], tuple[str, bool]] = {
    ("", "v1", "nodes"): ("Node", False),
    ("", "v1", "pods"): ("Pod", True),
    ("", "v1", "events"): ("Event", True),
    ("", "v1", "namespaces"): ("Namespace", False),
    ("events.k8s.io", "v1", "events"): ("Event", True),
    ("policy", "v1", "poddisruptionbudgets"): ("PodDisruptionBudget", True),
    ("apps", "v1", "deployments"): ("Deployment", True),
    ("apps", "v1", "replicasets"): ("ReplicaSet", True),
    ("apps", "v1", "daemonsets"): ("DaemonSet", True),
    ("kueue.x-k8s.io", "v1beta1", "workloads"): ("Workload", True),
    ("kueue.x-k8s.io", "v1beta1", "clusterqueues"): ("ClusterQueue", False),
    ("kueue.x-k8s.io", "v1beta1", "resourceflavors"): ("ResourceFlavor", False),
    ("cluster.x-k8s.io", "v1beta1", "machines"): ("Machine", True),
    ("karpenter.sh", "v1", "nodeclaims"): ("NodeClaim", False),
}

VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-fleetmedic-emulator", "gitCommit": "",
           "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.23",
           "compiler": "gc", "platform": "linux/amd64"}

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class ApiError(KubernetesError):
    """A Kubernetes Status error (kmock renders it as a Status object with this code)."""


def _status_error(code: int, reason: str, message: str) -> ApiError:
    return ApiError(status=code, reason=reason, message=message, details={})


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "false" if path == "spec.unschedulable" else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def field_selector_matches(selector: str | None, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    for term in split_selector(selector):
        negate = "!=" in term
        key, value = (s.strip() for s in re.split(r"!=|==|=", term, maxsplit=1))
        if (_field_value(obj, key) == value) == negate:
            return False
    return True


# --- faults ----------------------------------------------------------------------------------

@dataclass
class Fault:
    method: str | None  # GET, POST, PATCH, PUT, DELETE; None = any
    plural: str | None  # e.g. "nodes"; None = any
    name: str | None = None
    subresource: str | None = None
    status: int = 500
    times: int = 1
    delay_s: float = 0.0  # sleep first (for client timeouts); status 0 = then answer normally
    hits: int = 0

    def matches(self, method: str, plural: str | None, name: str | None, subresource: str | None) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.plural is None or self.plural == plural)
            and (self.name is None or self.name == name)
            and (self.subresource is None or self.subresource == subresource)
            and self.hits < self.times
        )


@dataclass
class _Watcher:
    key: tuple[str, str, str]
    namespace: str | None
    name: str | None
    label_selector: str | None
    field_selector: str | None
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)


# --- the emulator ----------------------------------------------------------------------------

HISTORY_LIMIT = 2000  # requests kept for requests()/mutations(); 0 keeps all


class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's emulator, with the API semantics listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.kinds: dict[tuple[str, str, str], tuple[str, bool]] = dict(CORE_RESOURCES)
        self.store: dict[tuple[tuple[str, str, str], str | None, str], dict[str, Any]] = {}
        self.faults: list[Fault] = []
        self.revision = 0
        self.state_lock = threading.RLock()
        self.watchers: list[_Watcher] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.history_limit = HISTORY_LIMIT
        for (group, version, plural), (kind, namespaced) in self.kinds.items():
            self._declare(group, version, plural, kind, namespaced)

    # -- set-up API for tests and the dev fleet (thread-safe) --

    def _core_discovery(self) -> dict[str, Any]:
        resources = []
        for (group, _version, plural), (kind, namespaced) in sorted(self.kinds.items()):
            if group:
                continue
            resources.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                              "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"]})
            for sub in ("eviction", "status") if plural == "pods" else ("status",):
                resources.append({"name": f"{plural}/{sub}", "singularName": "", "namespaced": namespaced,
                                  "kind": "Eviction" if sub == "eviction" else kind, "verbs": ["create", "get",
                                                                                                "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": resources}

    def _declare(self, group: str, version: str, plural: str, kind: str, namespaced: bool) -> None:
        self.resources[kmock.resource(group, version, plural)] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs={"get", "list", "watch", "create", "patch", "update",
                                                     "delete"},
            subresources={"eviction", "status"} if plural == "pods" else {"status"})

    def add_resource(self, group: str, version: str, plural: str, kind: str, namespaced: bool) -> None:
        self.kinds[(group, version, plural)] = (kind, namespaced)
        self._declare(group, version, plural, kind, namespaced)

    def key_for(self, api_version: str, kind: str) -> tuple[str, str, str]:
        group, _, version = api_version.rpartition("/")
        for key, (known_kind, _) in self.kinds.items():
            if key[0] == group and key[1] == version and known_kind == kind:
                return key
        raise KeyError(f"unknown resource {api_version} {kind}: register it with add_resource()")

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]  # the store, not HTTP
        """Create or replace an object directly (no HTTP), as a controller or a test would."""
        key = self.key_for(obj["apiVersion"], obj["kind"])
        with self.state_lock:
            meta = obj.setdefault("metadata", {})
            namespaced = self.kinds[key][1]
            ns = meta.setdefault("namespace", "default") if namespaced else None
            existing = self.store.get((key, ns, meta["name"]))
            event = "MODIFIED" if existing else "ADDED"
            meta.setdefault("uid", existing["metadata"]["uid"] if existing else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            stored = self._commit(key, ns, meta["name"], copy.deepcopy(obj), event)
        return copy.deepcopy(stored)

    def get(  # type: ignore[override]  # the store, not HTTP
            self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        key = self.key_for(api_version, kind)
        with self.state_lock:
            obj = self.store.get((key, namespace if self.kinds[key][1] else None, name))
            return copy.deepcopy(obj) if obj else None

    def list(self, api_version: str, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        key = self.key_for(api_version, kind)
        with self.state_lock:
            return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.store.items(), key=lambda i: i[0][2])
                    if k == key and (namespace is None or ns == namespace)]

    def remove(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        key = self.key_for(api_version, kind)
        with self.state_lock:
            if (key, self._ns(key, namespace), name) in self.store:
                self._delete(key, namespace, name)

    def inject(self, method: str | None, plural: str | None, *, name: str | None = None,
               subresource: str | None = None, status: int = 500, times: int = 1,
               delay_s: float = 0.0) -> Fault:
        fault = Fault(method=method.upper() if method else None, plural=plural, name=name,
                      subresource=subresource, status=status, times=times, delay_s=delay_s)
        with self.state_lock:
            self.faults.append(fault)
        return fault

    def requests(self) -> builtins.list[kmock.Request]:
        """Every request that reached the API, in order."""
        return list(self._requests)

    def mutations(self) -> builtins.list[kmock.Request]:
        """Every write that reached the API (including refused ones), in order."""
        return [r for r in list(self._requests) if r.method.value in MUTATING_METHODS]

    # -- internals --

    def _bump(self, obj: dict[str, Any]) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def _commit(self, key: tuple[str, str, str], ns: str | None, name: str, obj: dict[str, Any],
                event: str) -> dict[str, Any]:
        obj.setdefault("apiVersion", f"{key[0]}/{key[1]}" if key[0] else key[1])
        obj.setdefault("kind", self.kinds[key][0])
        self._bump(obj)
        self.store[(key, ns, name)] = obj
        self._publish(key, event, obj)
        return obj

    def _publish(self, key: tuple[str, str, str], event: str, obj: dict[str, Any]) -> None:
        for watcher in list(self.watchers):
            if watcher.key != key:
                continue
            meta = obj["metadata"]
            if watcher.namespace and meta.get("namespace") != watcher.namespace:
                continue
            if watcher.name and meta.get("name") != watcher.name:
                continue
            if not label_selector_matches(watcher.label_selector, meta.get("labels") or {}):
                continue
            if not field_selector_matches(watcher.field_selector, obj):
                continue
            item = {"type": event, "object": copy.deepcopy(obj)}
            if self.loop is not None and self.loop.is_running():
                self.loop.call_soon_threadsafe(watcher.queue.put_nowait, item)

    def _check_fault(self, request: kmock.Request) -> Fault | None:
        plural = request.resource.plural if request.resource else None
        with self.state_lock:
            for fault in self.faults:
                if fault.matches(request.method.value, plural, request.name, request.subresource):
                    fault.hits += 1
                    return fault
        return None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        # kmock keeps every request and re-filters the whole history on each new one: keep the
        # last HISTORY_LIMIT so a long `fleetmedic dev` neither slows down nor grows.
        if self.history_limit and len(self._requests) > self.history_limit:
            del self._requests[: len(self._requests) - self.history_limit]
        resource = request.resource
        path = request.url.path.rstrip("/")
        if path == "/version":
            return aiohttp.web.json_response(VERSION)
        if path == "/api/v1":
            # kmock answers groupVersion "/v1" here, and kubectl then finds no core resources.
            return aiohttp.web.json_response(self._core_discovery())
        if resource is None or resource.plural is None:
            return await super()._handle(request)  # discovery: /api, /apis, /version
        fault = self._check_fault(request)
        if fault is not None:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status:
                raise _status_error(fault.status, "InjectedFault", f"injected fault {fault.status}")
        key = (resource.group or "", resource.version or "", resource.plural)
        if key not in self.kinds:
            raise _status_error(404, "NotFound", f"the server could not find the requested resource "
                                                 f"{resource.plural}")
        method = request.method.value
        params = request.params
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, key)
        with self.state_lock:
            if method == "GET" and request.name is None:
                body: dict[str, Any] = self._list(key, request.namespace, params)
                status = 200
            elif method == "GET":
                body, status = self._fetch(key, request.namespace, request.name), 200
            elif method == "POST" and request.subresource == "eviction":
                body, status = self._evict(key, request.namespace, request.name or ""), 201
            elif method == "POST":
                body, status = self._create(key, request.namespace, request.data), 201
            elif method == "PATCH":
                content_type = request.headers.get("Content-Type", "")
                body, status = self._patch(key, request.namespace, request.name or "", request.data,
                                           content_type), 200
            elif method == "PUT":
                body, status = self._replace(key, request.namespace, request.name or "", request.data), 200
            elif method == "DELETE":
                body, status = self._delete(key, request.namespace, request.name or ""), 200
            else:
                raise _status_error(405, "MethodNotAllowed", f"{method} is not supported here")
        return aiohttp.web.json_response(body, status=status)

    def _ns(self, key: tuple[str, str, str], namespace: str | None) -> str | None:
        return namespace if self.kinds[key][1] else None

    def _require(self, key: tuple[str, str, str], namespace: str | None, name: str | None) -> dict[str, Any]:
        obj = self.store.get((key, self._ns(key, namespace), name or ""))
        if obj is None:
            raise _status_error(404, "NotFound", f'{key[2]} "{name}" not found')
        return obj

    def _list(self, key: tuple[str, str, str], namespace: str | None, params: Mapping[str, str]) -> dict[str, Any]:
        items = [
            copy.deepcopy(obj) for (k, ns, _), obj in sorted(self.store.items(), key=lambda i: i[0][2])
            if k == key and (namespace is None or ns == namespace)
            and label_selector_matches(params.get("labelSelector"), obj["metadata"].get("labels") or {})
            and field_selector_matches(params.get("fieldSelector"), obj)
        ]
        kind = self.kinds[key][0]
        return {"apiVersion": f"{key[0]}/{key[1]}" if key[0] else key[1], "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self.revision)}, "items": items}

    def _fetch(self, key: tuple[str, str, str], namespace: str | None, name: str | None) -> dict[str, Any]:
        return copy.deepcopy(self._require(key, namespace, name))

    def _create(self, key: tuple[str, str, str], namespace: str | None, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise _status_error(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not meta.get("name"):
            raise _status_error(422, "Invalid", "metadata.name: Required value")
        ns = self._ns(key, namespace or meta.get("namespace"))
        if ns is not None:
            meta["namespace"] = ns
        if (key, ns, meta["name"]) in self.store:
            raise _status_error(409, "AlreadyExists", f'{key[2]} "{meta["name"]}" already exists')
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta.pop("resourceVersion", None)
        return copy.deepcopy(self._commit(key, ns, meta["name"], obj, "ADDED"))

    def _check_version(self, current: dict[str, Any], wanted: str | None) -> None:
        if wanted and wanted != current["metadata"].get("resourceVersion"):
            raise _status_error(409, "Conflict",
                                f'Operation cannot be fulfilled on {current["kind"]} '
                                f'"{current["metadata"]["name"]}": the object has been modified; '
                                f"please apply your changes to the latest version and try again")

    def _patch(self, key: tuple[str, str, str], namespace: str | None, name: str, data: Any,
               content_type: str) -> dict[str, Any]:
        current = self._require(key, namespace, name)
        if "json-patch" in content_type:
            try:
                patched = jsonpatch.apply_patch(current, data)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise _status_error(409, "Conflict", f"the patch test failed: {exc}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise _status_error(422, "Invalid", f"bad JSON patch: {exc}") from None
        else:
            if not isinstance(data, dict):
                raise _status_error(400, "BadRequest", "a merge patch must be a JSON object")
            self._check_version(current, (data.get("metadata") or {}).get("resourceVersion"))
            patched = _merge_patch(current, data)
        return self._store_update(key, namespace, name, current, patched)

    def _replace(self, key: tuple[str, str, str], namespace: str | None, name: str, data: Any) -> dict[str, Any]:
        current = self._require(key, namespace, name)
        if not isinstance(data, dict):
            raise _status_error(400, "BadRequest", "the body must be a JSON object")
        self._check_version(current, (data.get("metadata") or {}).get("resourceVersion"))
        return self._store_update(key, namespace, name, current, copy.deepcopy(data))

    def _store_update(self, key: tuple[str, str, str], namespace: str | None, name: str,
                      current: dict[str, Any], patched: dict[str, Any]) -> dict[str, Any]:
        # Identity fields belong to the server, whatever the client sent.
        meta = patched.setdefault("metadata", {})
        for field_name in ("uid", "creationTimestamp", "name", "namespace"):
            if field_name in current["metadata"]:
                meta[field_name] = current["metadata"][field_name]
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        if patched == current:
            return copy.deepcopy(current)  # a no-op write keeps the resourceVersion
        return copy.deepcopy(self._commit(key, self._ns(key, namespace), name, patched, "MODIFIED"))

    def _delete(self, key: tuple[str, str, str], namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._require(key, namespace, name)
        del self.store[(key, self._ns(key, namespace), name)]
        self._bump(obj)
        self._publish(key, "DELETED", obj)
        return copy.deepcopy(obj)  # as the API server does: the object as it was deleted

    def _evict(self, key: tuple[str, str, str], namespace: str | None, name: str) -> dict[str, Any]:
        pod = self._require(key, namespace, name)
        labels = pod["metadata"].get("labels") or {}
        pdb_key = ("policy", "v1", "poddisruptionbudgets")
        pods_key = ("", "v1", "pods")
        for (k, ns, _), pdb in self.store.items():
            if k != pdb_key or ns != namespace:
                continue
            selector = pdb.get("spec", {}).get("selector")
            if not match_labels_selector(selector, labels):
                continue
            covered = [p for (pk, pns, _), p in self.store.items()
                       if pk == pods_key and pns == namespace
                       and match_labels_selector(selector, p["metadata"].get("labels") or {})]
            healthy = sum(1 for p in covered if _pod_ready(p) and not p["metadata"].get("deletionTimestamp"))
            spec = pdb["spec"]
            if "minAvailable" in spec:
                allowed = healthy - _resolve_int_or_percent(spec["minAvailable"], len(covered), round_up=True)
            else:
                max_unavailable = _resolve_int_or_percent(spec.get("maxUnavailable", 0), len(covered),
                                                          round_up=True)
                allowed = max_unavailable - (len(covered) - healthy)
            if allowed <= 0 and _pod_ready(pod):
                raise _status_error(
                    429, "TooManyRequests",
                    f"Cannot evict pod as it would violate the pod's disruption budget "
                    f"{pdb['metadata']['name']}")
        self._delete(key, namespace, name)
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success", "code": 201}

    async def _watch(self, request: kmock.Request, key: tuple[str, str, str]) -> aiohttp.web.StreamResponse:
        params = request.params
        watcher = _Watcher(key=key, namespace=request.namespace, name=request.name,
                           label_selector=params.get("labelSelector"),
                           field_selector=params.get("fieldSelector"))
        since = int(params.get("resourceVersion") or 0)
        with self.state_lock:
            initial = [copy.deepcopy(o) for (k, ns, n), o in self.store.items()
                       if k == key and (request.namespace is None or ns == request.namespace)
                       and (request.name is None or n == request.name)
                       and int(o["metadata"]["resourceVersion"]) > since
                       and label_selector_matches(watcher.label_selector, o["metadata"].get("labels") or {})
                       and field_selector_matches(watcher.field_selector, o)]
            self.watchers.append(watcher)
        raw = request._raw_request
        assert raw is not None  # a watch always arrives over HTTP
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        deadline = asyncio.get_running_loop().time() + float(params.get("timeoutSeconds") or 1800)
        try:
            for obj in sorted(initial, key=lambda o: int(o["metadata"]["resourceVersion"])):
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), timeout=remaining)
                except TimeoutError:
                    break
                await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            with self.state_lock:
                self.watchers.remove(watcher)
        await response.write_eof()
        return response


def _pod_ready(pod: dict[str, Any]) -> bool:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _resolve_int_or_percent(value: int | str, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total / 100
        return int(-(-share // 1)) if round_up else int(share)
    return int(value)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


# --- running it -----------------------------------------------------------------------------

class KubeEmulatorThread:
    """Serve a KubeEmulator on 127.0.0.1 from a thread with its own event loop."""

    def __init__(self, emulator: KubeEmulator | None = None, port: int | None = None) -> None:
        self.emulator = emulator or KubeEmulator()
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with self.emulator, kmock.Server(self.emulator, port=self._port) as server:
                self.emulator.loop = asyncio.get_running_loop()
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # surface start-up failures to the starting thread
            self._error = exc
            self._ready.set()

    def start(self) -> KubeEmulatorThread:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> KubeEmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path


def seed(emulator: KubeEmulator, objects: Iterable[dict[str, Any]]) -> None:
    for obj in objects:
        emulator.put(obj)
