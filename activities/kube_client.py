"""The Kubernetes API client FleetMedic's processes share: the worker's activities and providers,
and the node agent (which reads only its own Node). Small on purpose: the agent imports this, not
the activities.

One client per process: its connection pool is sized to the threads that use it (a pool smaller
than the threads makes urllib3 open and drop connections under load), and every request passes
a token bucket, so a fleet-wide incident cannot flood an API server that may itself be in trouble.
The protective step (cordon a bad node) has a bucket of its own (`kube_api.protective_qps`): a
thousand drains and watches using up the main one never delay a new alert's cordon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kubernetes import client, config
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from activities.errors import fail
from fleetmedic.errors import ErrorKind

# The longest a 429's Retry-After may hold the process's requests (a bad header must not stall it).
MAX_RETRY_AFTER_S = 30.0

# Set while the protective step runs (and in the threads it hands work to, which copy the context).
_PROTECTIVE = ContextVar("fleetmedic_protective_lane", default=False)


@contextmanager
def protective_lane() -> Iterator[None]:
    """The requests made inside take the protective bucket instead of the main one."""
    token = _PROTECTIVE.set(True)
    try:
        yield
    finally:
        _PROTECTIVE.reset(token)


class RateLimiter:
    """A token bucket (`qps` a second, `burst` at once), shared by every thread of the process."""

    def __init__(self, qps: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.qps, self.burst = qps, burst
        self.clock, self.sleep = clock, sleep
        self.tokens = float(burst)
        self.at = clock()
        self.hold_until = 0.0
        self.lock = threading.Lock()

    def acquire(self, timeout_s: float) -> None:
        """Take a token, waiting at most `timeout_s`; a request that would wait longer fails now
        (retried by its activity's bounded policy) rather than queue without end."""
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.qps)
            self.at = now
            self.tokens -= 1  # reserved now: callers queue in arrival order
            wait = max(-self.tokens / self.qps, self.hold_until - now, 0.0)
            if wait > timeout_s:
                self.tokens += 1
                raise fail(ErrorKind.TIMEOUT, f"Kubernetes API rate limit: would wait {wait:.1f}s for a request "
                                              f"slot (kube_api.qps {self.qps:g}, burst {self.burst})")
        if wait > 0:
            self.sleep(wait)

    def back_off(self, seconds: float) -> None:
        """The server said 429: every caller holds for `seconds` (at most MAX_RETRY_AFTER_S)."""
        with self.lock:
            self.hold_until = max(self.hold_until, self.clock() + min(max(seconds, 1.0), MAX_RETRY_AFTER_S))


class LimitedApiClient(ApiClient):  # type: ignore[misc]  # the client is untyped
    """An ApiClient whose every request (watches included) passes the process's rate limiter: the
    protective one inside `protective_lane()`, the main one otherwise. A 429 holds both: the server
    asked everyone to wait."""

    def __init__(self, configuration: client.Configuration, limiter: RateLimiter, timeout_s: float,
                 protective: RateLimiter | None = None) -> None:
        super().__init__(configuration)
        self.limiter = limiter
        self.protective = protective or limiter
        self.timeout_s = timeout_s
        send = self.rest_client.request  # every API call of the generated client ends here

        def limited(*args: Any, **kwargs: Any) -> Any:
            (self.protective if _PROTECTIVE.get() else self.limiter).acquire(self.timeout_s)
            try:
                response = send(*args, **kwargs)
            except ApiException as exc:  # client versions that raise here
                if exc.status == 429:
                    self.back_off(_retry_after(exc.headers))
                raise
            if getattr(response, "status", None) == 429:  # those that raise later, from the response
                self.back_off(_retry_after(response.getheaders()))
            return response

        self.rest_client.request = limited

    def back_off(self, seconds: float) -> None:
        self.limiter.back_off(seconds)
        if self.protective is not self.limiter:
            self.protective.back_off(seconds)


def _retry_after(headers: Any) -> float:
    try:
        return float((headers or {}).get("Retry-After", "1"))
    except (TypeError, ValueError):
        return 1.0


def load_api_client(kubeconfig: str | None, *, pool: int = 4, qps: float = 50, burst: int = 100,
                    timeout_s: float = 10.0, protective_qps: float | None = None,
                    protective_burst: int | None = None) -> ApiClient:
    """In-cluster config when running in a pod, else KUBECONFIG / ~/.kube/config.

    urllib3's own retries are off: a timeout must surface after one `_request_timeout`, and
    Temporal's retry policy (bounded, visible in the history) does the retrying. `pool`: the
    threads that share this client; `qps`/`burst`: the policy's `kube_api` rate limit, and
    `protective_qps`/`protective_burst` the protective step's own (none: it shares the main one).
    """
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    configuration.retries = False
    configuration.connection_pool_maxsize = pool
    protective = (RateLimiter(protective_qps, protective_burst or max(1, int(protective_qps)))
                  if protective_qps else None)
    return LimitedApiClient(configuration, RateLimiter(qps, burst), timeout_s, protective)


# The API classes FleetMedic calls. The client builds an API class's argument validators (pydantic)
# the first time one of its instances is made: CoreV1Api took 0.39 s of CPU and left ~66,000
# objects here, in whichever runbook step came first; later instances cost nothing.
API_CLASSES = (client.CoreV1Api, client.CustomObjectsApi, client.AppsV1Api, client.ApisApi)


def build_api_classes() -> None:
    """Build each API class's validators now, sending nothing: at a worker's start, before its
    start-up objects are frozen (workers/heap.py), not in the first alert's protective step."""
    offline = ApiClient(client.Configuration(host="http://localhost"))
    for api in API_CLASSES:
        api(offline)
