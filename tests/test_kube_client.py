"""The worker's Kubernetes client: every request passes the process's token bucket (the policy's
`kube_api.qps` and `burst`), a 429 holds every caller for its Retry-After, and a request that
would wait past its timeout fails at once (retried by its activity's bounded policy)."""

from __future__ import annotations

import pytest
from kubernetes import client
from temporalio.exceptions import ApplicationError

from activities.kube_client import MAX_RETRY_AFTER_S, LimitedApiClient, RateLimiter, load_api_client
from devstack import fleet
from devstack.kube_world import RealKube


class FakeClock:
    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 3))
        self.now += seconds


def test_a_burst_passes_then_requests_are_spaced_at_the_rate() -> None:
    clock = FakeClock()
    limiter = RateLimiter(qps=2, burst=3, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        limiter.acquire(timeout_s=10)
    assert clock.slept == []
    limiter.acquire(timeout_s=10)
    limiter.acquire(timeout_s=10)
    assert clock.slept == [0.5, 0.5]
    clock.now += 10  # idle: the bucket refills, up to the burst
    for _ in range(3):
        limiter.acquire(timeout_s=10)
    assert clock.slept == [0.5, 0.5]


def test_a_429_holds_everyone_and_a_request_that_would_wait_too_long_fails_now() -> None:
    clock = FakeClock()
    limiter = RateLimiter(qps=100, burst=100, clock=clock, sleep=clock.sleep)
    limiter.back_off(5)
    with pytest.raises(ApplicationError) as refused:
        limiter.acquire(timeout_s=2)
    assert refused.value.type == "Timeout" and "rate limit" in refused.value.message
    limiter.acquire(timeout_s=10)
    assert clock.slept == [5.0]
    limiter.back_off(3600)  # a silly Retry-After is capped
    limiter.acquire(timeout_s=3600)
    assert clock.slept[-1] == MAX_RETRY_AFTER_S


def test_every_request_of_the_workers_client_passes_the_limiter(kube: RealKube) -> None:
    kube.put(fleet.node("n1"))
    api = load_api_client(str(kube.kubeconfig), pool=8, qps=1000, burst=1000)  # type: ignore[attr-defined]
    assert isinstance(api, LimitedApiClient) and api.configuration.connection_pool_maxsize == 8
    counted: list[float] = []
    original = api.limiter.acquire
    api.limiter.acquire = lambda timeout_s: (counted.append(timeout_s), original(timeout_s))[1]  # type: ignore[method-assign]
    core = client.CoreV1Api(api)
    core.read_node("n1")
    core.list_node()
    assert len(counted) == 2
    # The API server says 429: the limiter holds every caller (for Retry-After, at least a second).
    kube.inject("GET", "nodes", name="n1", status=429, times=1)
    with pytest.raises(client.ApiException):
        core.read_node("n1")
    assert api.limiter.hold_until > api.limiter.clock()


def test_the_protective_step_has_a_bucket_of_its_own_and_a_429_holds_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand drains using up the main bucket never delay a new alert's cordon."""
    from kubernetes.client import rest

    from activities.kube_client import protective_lane

    sent: list[str] = []

    class Answer:
        status = 200

        @staticmethod
        def getheaders() -> dict[str, str]:
            return {}

    def send(self: object, method: str, url: str, *args: object, **kwargs: object) -> Answer:
        sent.append(url)
        return Answer()

    monkeypatch.setattr(rest.RESTClientObject, "request", send)  # where every API call ends
    clock = FakeClock()
    main = RateLimiter(qps=1, burst=2, clock=clock, sleep=clock.sleep)
    protective = RateLimiter(qps=10, burst=5, clock=clock, sleep=clock.sleep)
    api = LimitedApiClient(client.Configuration(), main, timeout_s=60, protective=protective)
    for _ in range(4):
        api.rest_client.request("GET", "/bulk")
    assert clock.slept == [1.0, 1.0]  # the main bucket: burst 2, then 1/s
    with protective_lane():
        for _ in range(5):
            api.rest_client.request("GET", "/cordon")
    assert clock.slept == [1.0, 1.0] and sent.count("/cordon") == 5  # no wait behind the bulk
    api.rest_client.request("GET", "/bulk")
    assert clock.slept[-1] == 1.0  # outside the lane: the main bucket again
    api.back_off(3)
    with protective_lane():
        api.rest_client.request("GET", "/cordon")
    assert clock.slept[-1] == pytest.approx(3.0)  # the server's Retry-After holds the protective lane too
