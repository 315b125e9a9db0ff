"""`fleetmedic worker`: the Temporal worker that runs every runbook and its activities.

Activities use blocking clients (kubernetes, scontrol, httpx), so they run on a thread pool
sized by FLEETMEDIC_ACTIVITY_THREADS. The protective step (cordon + Slurm DRAIN of a bad node)
runs as a local activity inside the run's workflow task, on threads of its own
(FLEETMEDIC_PROTECTIVE_SLOTS): however many runs wait on drains and watches, a new alert's cordon
never waits for a task queue or a free thread. SIGTERM/SIGINT shut down gracefully: no new tasks are
polled, running activities get `graceful_shutdown_timeout` to finish, and whatever is cut short
is retried by Temporal on another worker.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import cache
from typing import Any, Protocol

from kubernetes.client import ApiClient
from temporalio.client import Client
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker

import fleetmedic
from activities.agent import AgentActivities
from activities.breaker import CordonBreaker, GuardViews
from activities.burn_in import BurnInActivities
from activities.config import ConfigActivities
from activities.guard import GuardActivities
from activities.jobs import JobActivities
from activities.kube_client import build_api_classes, load_api_client
from activities.kubernetes import KubernetesActivities
from activities.kueue import KueueActivities, KueueTrigger
from activities.protect import ProtectiveActivities
from activities.providers import ProviderActivities, make_provider
from activities.slack import SlackActivities
from activities.slurm import SlurmActivities, SlurmCli, SlurmRest
from activities.slurm_names import SameName, SlinkyNames
from activities.storage import StorageActivities
from activities.temporal import TemporalActivities
from activities.traffic import TrafficActivities, TrafficHandoff
from activities.training_pods import TrainingPodActivities
from activities.waits import WAIT_IO_THREADS, BlockingCalls
from fleetmedic import ids
from fleetmedic.models import RunContext
from fleetmedic.policy import Policy, load_policy
from fleetmedic.settings import Settings
from workers.failure_lines import one_line_for_named_failures
from workers.full_passes import ActivationGate
from workers.heap import freeze_startup_objects
from workers.kueue_admission import KueueAdmission
from workers.memory import CacheSize, workflow_cache
from workers.payload_walks import skip_walks_that_change_nothing
from workers.schedules import ensure_job_failures, ensure_quota_schedule
from workers.temporal_client import SearchAttributesMissing, connect, ensure_search_attributes
from workflows.fleet_guard import FleetGuard
from workflows.registry import WORKFLOWS

# What running activities get to finish after SIGTERM; the pod's terminationGracePeriodSeconds
# (deploy/kubernetes/base/worker.yaml) is longer, and a test keeps it so.
SHUTDOWN_GRACE = timedelta(seconds=30)

log = logging.getLogger(__name__)


def slurm_enabled(settings: Settings) -> bool:
    if settings.slurm == "auto":
        return shutil.which("scontrol") is not None
    return settings.slurm == "on"


class ActivityGroup(Protocol):
    """One system's activities (Kubernetes, Slurm, …), sharing its client."""

    def activities(self) -> list[Callable[..., Any]]: ...


def wait_queue(settings: Settings) -> str:
    return ids.waits_queue(settings.task_queue)


def guard_queue(settings: Settings) -> str:
    return ids.guard_queue(settings.task_queue)


class Activities:
    """Every activity the runbooks call, wired to the systems `settings` names: `all` for the main
    task queue, `protective` and `waits` for their own queues (also in `all`, for runs recorded
    before those queues existed)."""

    def __init__(self, settings: Settings, policy: Policy, client: Client,
                 api_client: Callable[[], ApiClient] | None = None) -> None:
        # One API client for the process, its pool sized to every thread that may use it at once.
        pool = settings.activity_threads + 2 * settings.protective_slots + WAIT_IO_THREADS
        kube_client = api_client or cache(lambda: load_api_client(
            settings.kubeconfig, pool=pool, qps=policy.kube_api.qps, burst=policy.kube_api.burst,
            timeout_s=settings.kube_timeout_s, protective_qps=policy.kube_api.protective_qps,
            protective_burst=policy.kube_api.protective_burst))
        dry = settings.dry_run
        blocking = BlockingCalls(WAIT_IO_THREADS)  # the waits' short calls, shared by every wait
        kubernetes = KubernetesActivities(kube_client, policy, timeout_s=settings.kube_timeout_s, force_dry_run=dry,
                                          blocking=blocking)
        cli = SlurmCli(settings.slurm_conf, settings.slurm_timeout_s)
        reader = (SlurmRest(settings.slurmrestd_url, settings.slurm_jwt or "", settings.slurm_user,
                            settings.slurm_timeout_s) if settings.slurmrestd_url else None)
        # Which Slurm node each Kubernetes node is: the same name, or its Slinky slurmd pod's.
        names = (SlinkyNames(policy.slurm.slinky, kubernetes.list_pods) if policy.slurm.mapping == "slinky"
                 else SameName())
        slurm = SlurmActivities(cli, reader, force_dry_run=dry, names=names)
        provider = make_provider(policy.provider, kube_client, token=settings.provider_token,
                                 kube_timeout_s=settings.kube_timeout_s)
        context = RunContext(slurm_enabled=slurm_enabled(settings), agent_configured=bool(settings.agent_url),
                             provider=provider.name, provider_supports=sorted(provider.supports),
                             wait_queue=wait_queue(settings))
        # The cordon breaker: the worker's node watch counts, the guards' memo says paused or tripped.
        self.views = GuardViews(client, list(policy.routing.served_clusters))
        # The first protective steps after a start wait (up to 10 s) for the watch's first list: a
        # storm that arrives with a new worker is counted too.
        breaker = CordonBreaker(policy, lambda: kubernetes.node_watch.out_of_service(wait_s=10), self.views.get)
        self.protective = ProtectiveActivities(kubernetes, slurm, slots=settings.protective_slots, breaker=breaker,
                                               views=self.views).activities()
        providers = ProviderActivities(provider, force_dry_run=dry, blocking=blocking)
        traffic = TrafficActivities(kubernetes, settings.prometheus_url)
        self.waits: list[Callable[..., Any]] = [kubernetes.wait_node_ready, kubernetes.evict_pods,
                                                providers.find_replacement, traffic.evict, traffic.wait_home]
        groups: list[ActivityGroup] = [
            ConfigActivities(policy, context, force_dry_run=dry),
            kubernetes,
            KueueActivities(kubernetes),
            traffic,
            slurm,
            BurnInActivities(slurm),
            JobActivities(slurm),
            TrainingPodActivities(kubernetes),
            StorageActivities(policy.storage),
            providers,
            SlackActivities(settings.slack_bot_token, settings.slack_channel or policy.notify.slack_channel,
                            settings.slack_api_url, shadow_channel=policy.notify.shadow_channel),
            AgentActivities(settings.agent_url, settings.agent_token, force_dry_run=dry),
            GuardActivities(client, guard_queue(settings), self.views),
            KueueTrigger(client, settings.task_queue),
            TrafficHandoff(client),
            TemporalActivities(client, settings.task_queue, names),
        ]
        self.all = [fn for group in groups for fn in group.activities()] + self.protective
        self.node_watch = kubernetes.node_watch
        self._warm = kubernetes.warm
        # Kueue's admission starting traffic-flip and migrate-back, while the worker polls.
        self.kueue_admission = (KueueAdmission(client, traffic, cluster=settings.cluster,
                                               task_queue=settings.task_queue)
                                if policy.traffic.start_from_kueue else None)

    def start(self) -> None:
        """With the pollers, not when the activities are built: the warm-up starts the node watch,
        which lists and watches until `close`, and activities built and never served (a check, a
        test) would leave it retrying against an API for the rest of the process."""
        threading.Thread(target=self._warm, name="kubernetes-warm-up", daemon=True).start()

    def close(self) -> None:
        """Once the pollers have stopped: no more node watch, no more reads of the guards."""
        self.node_watch.stop()
        self.views.stop()


def build_activities(settings: Settings, policy: Policy, client: Client,
                     api_client: Callable[[], ApiClient] | None = None) -> list[Callable[..., Any]]:
    """Every activity the runbooks call (see `Activities`)."""
    return Activities(settings, policy, client, api_client).all


# Workflow code runs without Temporal's sandbox. Inside it, each activation crossed into the
# sandbox (`exec` with restricted builtins) several times: replaying a saved xid-recovery history
# cost 46-74 ms with it and 29-51 ms without, and a new run's first task built a sandbox of its
# own on the worker's one event loop, which a storm of 50 alerts paid in series before the
# first cordon. The domain modules were already passed through it, so what it still checked
# (a clock, randomness or I/O in workflow code) is checked instead where it costs nothing at
# run time: statically in tests/test_determinism.py (the workflows and the domain modules they
# call), and by replaying every saved history in a sandbox that imports the workflow modules
# afresh, so their calls meet its restrictions (tests/test_replay.py).
WORKFLOW_RUNNER = UnsandboxedWorkflowRunner()


class FleetWorker:
    """The worker's pollers, started and stopped together: the main task queue (workflows and every
    activity), the waits queue (long async waits: no thread each, and never the slots other steps
    need) and the fleet guards' queue."""

    def __init__(self, main: Worker, *others: Worker, cache: CacheSize, gate: ActivationGate,
                 on_start: Callable[[], None] = lambda: None, on_close: Callable[[], None] = lambda: None,
                 kueue_admission: KueueAdmission | None = None) -> None:
        self.workers = (*others, main)
        self.cache = cache  # the runs `main` keeps in memory, and why that many
        self.gate = gate  # counts the workflow activations in flight (workers/full_passes.py)
        self.on_start = on_start
        self.on_close = on_close
        self.kueue_admission = kueue_admission

    async def __aenter__(self) -> FleetWorker:
        self.on_start()
        started: list[Worker] = []
        try:
            for worker in self.workers:
                await worker.__aenter__()
                started.append(worker)
        except BaseException:
            await asyncio.gather(*(w.__aexit__(None, None, None) for w in started))
            self.gate.close()
            self.on_close()
            raise
        if self.kueue_admission is not None:  # once the runs it starts have a worker
            self.kueue_admission.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.kueue_admission is not None:
            await self.kueue_admission.stop()
        # All finish their running activities within the same SHUTDOWN_GRACE, side by side.
        try:
            await asyncio.gather(*(w.__aexit__(*exc) for w in self.workers))
        finally:
            self.gate.close()
            self.on_close()


# Workflow-task polls a worker keeps open, half on the shared queue (a storm's new runs, whose first
# task is the protective step) and half on the worker's sticky queue (the next steps of the runs it
# keeps). The SDK's default, one shared poll of five, left 50 new alerts waiting ~2.5 s, a poll round
# trip each, for their first task. Its autoscaling pollers took them together but, once tasks flow,
# shorten each poll to 11 s, and a busy server answers some polls after their caller has given up:
# the task is then recorded as handed out, nobody runs it, and the run sits out the 10 s workflow
# task timeout. bench/xid_latency counts such tasks in every run's history: of 1,110 runs, 30 and 33
# with the autoscaler (in two of its four storm rounds one of the 50 new alerts waited that out: its
# cordon came 11.8 s after the alert); 13 and 13 with these fixed polls, which the server holds for a
# minute (none in their four storm rounds). Fewer polls lost fewer (16: 3) but left the sticky
# queue short: 215 next steps waited out its 10 s timeout (none at 32).
WORKFLOW_POLLS = 32
# The share of them on the shared queue (the SDK's nonsticky_to_sticky_poll_ratio): half.
SHARED_QUEUE_POLLS = 0.5
# Activity polls on the main queue (leases, drains, provider calls), fixed for the same reason.
ACTIVITY_POLLS = 16
# Workflow tasks a worker takes at once: twice its polls. A poll is sent only with a free slot, and a
# new run's first task holds its slot through the protective step (a local activity: ~2 s in a
# storm on this machine, the interpreter mostly idle meanwhile). At 32 slots for 32 polls, the first
# tasks in their protective step left the shared queue without polls, and a storm's other first
# tasks waited in the server for them: 50 at once, first task queued p99 5.5 s (1.3 s at 64), the
# cordon p99 7.9-16.3 s (4.4 s). Tasks beyond that share the one interpreter: at the SDK's 100,
# 5,000 runs started together kept 100 in the worker, 2,759 of them past the SDK's 5 s warning and
# some past their 10 s timeout, to be redone; at 64, of 2,000 started together, the longest a task
# was held was 5.6 s (bench/worker_scale's tally). What a run more at once costs in that ramp: more
# tasks lost by the server (RUNBOOK_TASK_TIMEOUT), 48 of 2,000 runs against 12-16 at 32.
WORKFLOW_TASK_SLOTS = 64


def build_worker(client: Client, settings: Settings, policy: Policy, *,
                 api_client: Callable[[], ApiClient] | None = None,
                 workflows: Sequence[type] | None = None,
                 executor: ThreadPoolExecutor | None = None) -> FleetWorker:
    executor = executor or ThreadPoolExecutor(max_workers=settings.activity_threads,
                                              thread_name_prefix="fleetmedic-activity")
    activities = Activities(settings, policy, client, api_client)
    cache = workflow_cache(settings)
    # Every workflow activation is counted, so that a full garbage-collector pass can wait for a
    # moment with none in flight (started by a worker in its own process: run_worker).
    gate = ActivationGate()
    # The SDK walks every workflow task's payloads six times, for a codec and external storage that
    # FleetMedic's converter does not have: a third of the event loop in a storm (workers/payload_walks.py).
    skip_walks_that_change_nothing()
    # A failed try whose cause an activity named is one line in the log, not a traceback.
    one_line_for_named_failures()
    main = Worker(
        client, task_queue=settings.task_queue,
        workflows=list(workflows or WORKFLOWS),
        activities=activities.all,
        activity_executor=executor,
        max_concurrent_activities=settings.activity_threads,
        workflow_runner=WORKFLOW_RUNNER,
        max_cached_workflows=cache.runs,
        max_concurrent_workflow_tasks=WORKFLOW_TASK_SLOTS,
        workflow_task_executor=gate.executor(WORKFLOW_TASK_SLOTS, "fleetmedic-workflow"),
        graceful_shutdown_timeout=SHUTDOWN_GRACE,
        # Polls held open at a fixed count: see WORKFLOW_POLLS.
        workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(WORKFLOW_POLLS),
        nonsticky_to_sticky_poll_ratio=SHARED_QUEUE_POLLS,
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(ACTIVITY_POLLS),
    )
    waits = Worker(client, task_queue=wait_queue(settings), activities=activities.waits,
                   max_concurrent_activities=settings.wait_slots, graceful_shutdown_timeout=SHUTDOWN_GRACE,
                   # A wait heartbeats at 0.8 x its timeout (policy retries.wait_heartbeat), not at the
                   # SDK's cap of once a minute: the point of a long timeout is fewer writes.
                   max_heartbeat_throttle_interval=policy.retries.wait_heartbeat)
    others = [waits]
    if FleetGuard in (workflows or WORKFLOWS):
        # The fleet guards on their own queue (and sticky queue): every lease goes through one, and
        # 5,000 runs started together kept a guard's task 10 s behind theirs until it timed out, so
        # none got a lease. Its own few calls (the policy, the fleet's capacity, which holders still run) are served
        # there as well, from the main pool of threads.
        others.append(Worker(client, task_queue=guard_queue(settings), workflows=[FleetGuard],
                             activities=activities.all, activity_executor=executor, max_concurrent_activities=4,
                             # The SDK's own size for its default executor.
                             workflow_task_executor=gate.executor(500, "fleetmedic-guard"),
                             workflow_runner=WORKFLOW_RUNNER, graceful_shutdown_timeout=SHUTDOWN_GRACE))
    return FleetWorker(main, *others, cache=cache, gate=gate, on_start=activities.start, on_close=activities.close,
                       kueue_admission=activities.kueue_admission)


# Buckets for what a person waits for: a repair takes minutes to hours, not the SDK's default
# milliseconds (whose top bucket, 10 s, would put every real repair in +Inf).
REPAIR_BUCKETS_S = [30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400]
# A full pass stops the whole worker: 2 s is the SDK's deadlock timeout for one workflow activation.
GC_PASS_BUCKETS_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10]
GPU_HOURS_BUCKETS = [0.1, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256]


def metrics_runtime(port: int, host: str = "0.0.0.0") -> Runtime | None:
    """The SDK's own metrics (task latency, slots, workflow outcomes) and the runbooks' on /metrics
    at `host:port`, as Prometheus names them: counters end in `_total`, durations are seconds."""
    if port == 0:
        return None
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
        bind_address=address, counters_total_suffix=True, durations_as_seconds=True,
        histogram_bucket_overrides={"fleetmedic_time_to_repair": REPAIR_BUCKETS_S,
                                    "fleetmedic_traffic_migrate_back_duration": REPAIR_BUCKETS_S,
                                    "fleetmedic_gpu_hours_lost": GPU_HOURS_BUCKETS,
                                    "fleetmedic_worker_gc_full_pass_seconds": GC_PASS_BUCKETS_S})))


async def run_worker(settings: Settings, policy: Policy | None = None, stop: asyncio.Event | None = None, *,
                     own_process: bool = False) -> None:
    """`own_process`: the process is the worker's alone (`fleetmedic worker`), so its start-up objects
    may be frozen (workers/heap.py); not in a process that hosts other things, a test session."""
    # Handlers first: a SIGTERM that arrives while we connect still means a clean exit.
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await _serve(settings, policy or load_policy(settings.policy_path), stop, own_process)
    finally:
        # Handed back: a process that goes on after the worker (a test session) stops on SIGINT again.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _serve(settings: Settings, policy: Policy, stop: asyncio.Event, own_process: bool) -> None:
    runtime = metrics_runtime(settings.metrics_port, settings.metrics_host)
    client = await connect(runtime=runtime)
    try:
        await ensure_search_attributes(client)
    except SearchAttributesMissing:
        raise  # every runbook's start names them: a worker without them could run nothing (one line, exit 1)
    except Exception:
        log.warning("continuing without registering search attributes; runbooks that upsert them will fail")
    await ensure_quota_schedule(client, settings, policy)
    await ensure_job_failures(client, settings, policy)
    worker = build_worker(client, settings, policy)
    if own_process:  # before the pollers: see workers/heap.py
        build_api_classes()
        freeze_startup_objects("worker")
    cache = worker.cache
    # The version in the first line: an upgrade's rollout time is read here (docs/upgrading.md).
    log.info("fleetmedic %s worker polling %s on %s (namespace %s); keeps up to %d runs in memory between their "
             "steps (%s)", fleetmedic.__version__, settings.task_queue, client.service_client.config.target_host,
             client.namespace, cache.runs, cache.why)
    if runtime is not None:
        # Beside the SDK's temporal_sticky_cache_size: how full the worker's memory is of runs.
        runtime.metric_meter.create_gauge("fleetmedic_worker_workflow_cache_max",
                                          "runs the worker keeps in memory between their steps").set(cache.runs)
        worker.gate.on_pass = full_pass_metrics(runtime)
    if own_process:  # the process's full passes between activations: see workers/full_passes.py
        worker.gate.start()
    try:
        async with worker:
            await stop.wait()
            log.info("shutting down: finishing running activities (up to 30 s)")
    finally:
        worker.gate.stop()


def full_pass_metrics(runtime: Runtime) -> Callable[[float, bool], None]:
    """How often and how long the worker stopped for a full garbage-collector pass, on /metrics."""
    meter = runtime.metric_meter
    passes = meter.create_counter("fleetmedic_worker_gc_full_passes",
                                  "full garbage-collector passes (forced: with workflow tasks in flight)")
    seconds = meter.create_histogram_float("fleetmedic_worker_gc_full_pass_seconds",
                                           "how long the worker stopped for a full garbage-collector pass")

    def record(length: float, forced: bool) -> None:
        passes.add(1, {"forced": str(forced).lower()})
        seconds.record(length)
    return record
