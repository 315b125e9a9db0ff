"""Who asks the Kubernetes API for what: every request the adapters send to the apiserver during
the tests, as RBAC sees it — (verb, API group, resource[/subresource]). `tests/test_rbac.py`
compares what was seen with the worker's ClusterRole."""

from __future__ import annotations

from typing import Any

# (verb, group, resource) seen across this test session.
OBSERVED: set[tuple[str, str, str]] = set()
# (group, version, resource) of every custom or built-in resource the worker called.
VERSIONS: set[tuple[str, str, str]] = set()


def access(request: Any) -> tuple[str, str, str] | None:
    """The RBAC triple of one HTTP request to the API server (None for discovery and the like)."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return None
    resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
    named = len(rest) >= 2
    method = request.method.value.upper()
    watching = str(request.url.query.get("watch", "")).lower() in ("true", "1")
    verb = {"GET": "get" if named else ("watch" if watching else "list"), "POST": "create", "PATCH": "patch",
            "PUT": "update", "DELETE": "delete" if named else "deletecollection"}.get(method)
    return (verb, group, resource) if verb else None


def api_version(request: Any) -> tuple[str, str, str] | None:
    """(group, version, resource) of one request to a resource (None for discovery)."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    return (group, version, rest[0]) if rest else None


def record(requests: list[Any]) -> None:
    for request in requests:
        triple = access(request)
        if triple is not None:
            OBSERVED.add(triple)
        called = api_version(request)
        if called is not None:
            VERSIONS.add(called)
