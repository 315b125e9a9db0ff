"""Process settings from the environment. Every variable, its default and its meaning.

Temporal's own variables (TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS*,
TEMPORAL_PROFILE, TEMPORAL_CONFIG_FILE) are read by the Temporal SDK's environment configuration,
so FleetMedic connects exactly as the `temporal` CLI does; they are listed here for the docs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleetmedic.errors import validation_errors


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


# The documented table (README renders the same list; a test keeps them in sync).
ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar("TEMPORAL_ADDRESS", "localhost:7233", "Temporal frontend host:port"),
    EnvVar("TEMPORAL_NAMESPACE", "default", "Temporal namespace"),
    EnvVar("TEMPORAL_API_KEY", "(none)", "API key for Temporal Cloud or a server that wants one; implies TLS"),
    EnvVar("TEMPORAL_TLS", "false", "use TLS to the frontend (also TEMPORAL_TLS_CLIENT_CERT_PATH, "
           "TEMPORAL_TLS_CLIENT_KEY_PATH, TEMPORAL_TLS_SERVER_CA_CERT_PATH, TEMPORAL_TLS_SERVER_NAME)"),
    EnvVar("FLEETMEDIC_TASK_QUEUE", "fleetmedic", "task queue the worker polls and runbooks start on"),
    EnvVar("FLEETMEDIC_CLUSTER", "default", "cluster name used in workflow IDs and search attributes"),
    EnvVar("FLEETMEDIC_POLICY", "(shipped default_policy.yaml)", "path of the policy YAML file"),
    EnvVar("KUBECONFIG", "(in-cluster config, else ~/.kube/config)", "Kubernetes client configuration"),
    EnvVar("FLEETMEDIC_KUBE_TIMEOUT", "10", "seconds per Kubernetes API call"),
    EnvVar("FLEETMEDIC_SLURM", "auto", "auto (use Slurm when scontrol is on PATH), on, or off"),
    EnvVar("SLURM_CONF", "(Slurm's default /etc/slurm/slurm.conf)", "slurm.conf used by scontrol/sinfo/squeue"),
    EnvVar("FLEETMEDIC_SLURMRESTD_URL", "(none: read through the CLI)", "slurmrestd base URL for reads"),
    EnvVar("SLURM_JWT", "(none)", "JWT for slurmrestd"),
    EnvVar("FLEETMEDIC_SLURM_USER", "root", "X-SLURM-USER-NAME sent to slurmrestd"),
    EnvVar("FLEETMEDIC_SLURM_TIMEOUT", "15", "seconds per Slurm command or request"),
    EnvVar("SLACK_BOT_TOKEN", "(none: notifications are logged only)", "Slack bot token"),
    EnvVar("FLEETMEDIC_SLACK_CHANNEL", "(none)", "Slack channel for runbook threads"),
    EnvVar("FLEETMEDIC_SLACK_API_URL", "https://slack.com/api/", "Slack Web API base URL"),
    EnvVar("FLEETMEDIC_WEBHOOK_TOKEN", "(none: the webhook refuses to start)", "bearer token for alerts"),
    EnvVar("FLEETMEDIC_PROVIDER_TOKEN", "(none)", "bearer token for the http provider"),
    EnvVar("FLEETMEDIC_AGENT_URL", "(none: validation is skipped)",
           "node agent URL template, e.g. http://{node}:9400"),
    EnvVar("FLEETMEDIC_AGENT_TOKEN", "(none)", "token for the node agent's reset endpoint"),
    EnvVar("FLEETMEDIC_PROMETHEUS_URL", "(none: the SLO gate checks ready replicas only)",
           "Prometheus for migrate-back's SLO query"),
    EnvVar("NODE_NAME", "(none: the agent refuses to start)", "agent: the node it runs on (downward API)"),
    EnvVar("FLEETMEDIC_AGENT_EXPECTED_GPUS", "(none: any count passes)",
           "agent: GPUs the node should have (metric and validation)"),
    EnvVar("FLEETMEDIC_INFINIBAND_ROOT", "/sys/class/infiniband", "agent: where InfiniBand devices are read"),
    EnvVar("FLEETMEDIC_METRICS_PORT", "9464", "worker Prometheus metrics port (0 disables)"),
    EnvVar("FLEETMEDIC_METRICS_HOST", "0.0.0.0", "address the worker's metrics port listens on"),
    EnvVar("FLEETMEDIC_WEBHOOK_TEMPORAL_TIMEOUT", "10",
           "webhook: seconds Temporal gets to answer an alert, and apart the longest an alert waits for one of "
           "the webhook's call slots, before the webhook answers 503"),
    EnvVar("FLEETMEDIC_ACTIVITY_THREADS", "64", "threads for blocking activity calls"),
    EnvVar("FLEETMEDIC_PROTECTIVE_SLOTS", "64",
           "protective steps (cordon + Slurm DRAIN) a worker runs at once, on their own task queue"),
    EnvVar("FLEETMEDIC_WORKFLOW_CACHE", "auto",
           "runs a worker keeps in memory between their steps (more in flight are replayed from history at their "
           "next step); auto: as many as its memory holds, ~256 KiB each beyond 320 MiB, at most 10000"),
    EnvVar("FLEETMEDIC_WORKER_MEMORY", "(the cgroup's limit; none: no limit)",
           "memory the worker may use, in bytes or as a Kubernetes quantity (1Gi); the manifests set the "
           "container's limit (downward API)"),
    EnvVar("FLEETMEDIC_WAIT_SLOTS", "10000",
           "runs a worker lets wait for a node to come back at once (no thread each), on their own task queue"),
    EnvVar("FLEETMEDIC_DRY_RUN", "false", "force shadow mode for every runbook of this process"),
    EnvVar("FLEETMEDIC_EVENT_LOOP", "uvloop",
           "event loop of the worker, the webhook and the agent: uvloop, or asyncio (Python's own)"),
)


class SettingsError(ValueError):
    pass


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True)

    task_queue: str = "fleetmedic"
    cluster: str = "default"
    policy_path: str | None = None
    kubeconfig: str | None = None
    kube_timeout_s: float = Field(10.0, gt=0)
    slurm: str = Field("auto", pattern="^(auto|on|off)$")
    slurm_conf: str | None = None
    slurmrestd_url: str | None = None
    slurm_jwt: str | None = Field(None, repr=False)
    slurm_user: str = "root"
    slurm_timeout_s: float = Field(15.0, gt=0)
    slack_bot_token: str | None = Field(None, repr=False)
    slack_channel: str | None = None
    slack_api_url: str = "https://slack.com/api/"
    webhook_token: str | None = Field(None, repr=False)
    provider_token: str | None = Field(None, repr=False)
    agent_url: str | None = None
    agent_token: str | None = Field(None, repr=False)
    prometheus_url: str | None = None
    node_name: str | None = None
    agent_expected_gpus: int | None = Field(None, ge=0, le=64)
    infiniband_root: str = "/sys/class/infiniband"
    metrics_port: int = Field(9464, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"
    # Temporal's SDKs' own default call deadline (10 s), and Alertmanager's least notify budget
    # (max(group_interval, 10 s)). At 5 s a burst of 500 starts, which a 2-core production server
    # queues ~5 s, had its tail answered 503 and sent again (13–40 of 500; bench/alert_storm).
    webhook_temporal_timeout_s: float = Field(10.0, gt=0, le=60)
    activity_threads: int = Field(64, ge=1, le=4096)
    # A storm's cordons at once: at 16, 50 nodes failing together waited ~1 s for a slot. A slot is a
    # thread that mostly waits on the API and slurmctld, and the runs asking at once share their
    # reads, so more slots do not mean more load on either.
    protective_slots: int = Field(64, ge=1, le=1024)
    wait_slots: int = Field(10000, ge=1, le=100000)
    # Runs kept in memory between their steps. A run not kept is replayed from its whole history at
    # its next step (~70 ms for a saved xid-recovery history here, against a few ms for a kept run's
    # step), but a waiting run takes no step. None (auto): as many as the worker's memory holds
    # (workers/memory.py), since each kept run costs ~200 KB and a worker killed for memory replays
    # every run it had.
    workflow_cache: int | None = Field(None, ge=0, le=1000000)
    worker_memory: int | None = Field(None, ge=1)
    dry_run: bool = False
    # workers/event_loop.py: the loop that hands the Temporal client's answers, HTTP requests and
    # threads' results back and forth; no workflow code runs on it.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"

    @field_validator("worker_memory", mode="before")
    @classmethod
    def memory_quantity(cls, value: object) -> object:
        """A memory quantity as Kubernetes writes it: the downward API gives bytes, a person 1Gi."""
        if not isinstance(value, str):
            return value
        # Kubernetes' own parser, as the activities read quantities; imported here, where the worker
        # (which has it loaded) is configured, so the CLI and the webhook do not pay its import.
        from kubernetes.utils.quantity import parse_quantity

        try:
            memory = parse_quantity(value.strip())
        except ValueError:
            memory = None
        if memory is None or memory < 1:
            raise ValueError(f"not a memory quantity (bytes, or such as 1Gi or 512Mi): {value!r}")
        return int(memory)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        mapping = {
            "task_queue": "FLEETMEDIC_TASK_QUEUE",
            "cluster": "FLEETMEDIC_CLUSTER",
            "policy_path": "FLEETMEDIC_POLICY",
            "kubeconfig": "KUBECONFIG",
            "kube_timeout_s": "FLEETMEDIC_KUBE_TIMEOUT",
            "slurm": "FLEETMEDIC_SLURM",
            "slurm_conf": "SLURM_CONF",
            "slurmrestd_url": "FLEETMEDIC_SLURMRESTD_URL",
            "slurm_jwt": "SLURM_JWT",
            "slurm_user": "FLEETMEDIC_SLURM_USER",
            "slurm_timeout_s": "FLEETMEDIC_SLURM_TIMEOUT",
            "slack_bot_token": "SLACK_BOT_TOKEN",
            "slack_channel": "FLEETMEDIC_SLACK_CHANNEL",
            "slack_api_url": "FLEETMEDIC_SLACK_API_URL",
            "webhook_token": "FLEETMEDIC_WEBHOOK_TOKEN",
            "provider_token": "FLEETMEDIC_PROVIDER_TOKEN",
            "agent_url": "FLEETMEDIC_AGENT_URL",
            "agent_token": "FLEETMEDIC_AGENT_TOKEN",
            "prometheus_url": "FLEETMEDIC_PROMETHEUS_URL",
            "node_name": "NODE_NAME",
            "agent_expected_gpus": "FLEETMEDIC_AGENT_EXPECTED_GPUS",
            "infiniband_root": "FLEETMEDIC_INFINIBAND_ROOT",
            "metrics_port": "FLEETMEDIC_METRICS_PORT",
            "metrics_host": "FLEETMEDIC_METRICS_HOST",
            "webhook_temporal_timeout_s": "FLEETMEDIC_WEBHOOK_TEMPORAL_TIMEOUT",
            "activity_threads": "FLEETMEDIC_ACTIVITY_THREADS",
            "protective_slots": "FLEETMEDIC_PROTECTIVE_SLOTS",
            "wait_slots": "FLEETMEDIC_WAIT_SLOTS",
            "workflow_cache": "FLEETMEDIC_WORKFLOW_CACHE",
            "worker_memory": "FLEETMEDIC_WORKER_MEMORY",
            "dry_run": "FLEETMEDIC_DRY_RUN",
            "event_loop": "FLEETMEDIC_EVENT_LOOP",
        }
        values = {field: env[var] for field, var in mapping.items() if env.get(var, "") != ""}
        if values.get("workflow_cache") == "auto":
            del values["workflow_cache"]
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            where, why = validation_errors(exc)[0]
            field = where.split(".")[0] or "?"
            raise SettingsError(f"environment variable {mapping.get(field, field)}: {why}") from None
