"""Job ends as they arrive from outside: Slurm's jobcomp script, a training framework's own hook,
the reconciliation over Slurm's recently ended jobs. Pure: parsing and validation only.

Everything here is untrusted input under the same rules as alerts (fleetmedic/trust.py): node
names must be valid Kubernetes node names, the cluster only selects among configured ones, every
list and string is bounded, and a malformed entry is refused on its own, with its reason, without
losing the others of its batch.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetmedic.trust import checked_node

# Slurm job states (squeue(1) "JOB STATE CODES") that end a job. Anything else (PENDING after a
# requeue, which jobcomp/script also reports, RUNNING) is not an end and is not counted as one.
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "CANCELLED", "PREEMPTED",
                          "DEADLINE", "BOOT_FAIL"})
# Ends that say nothing against the hardware: the job's own limit, a person, the scheduler.
NOT_EVIDENCE_STATES = {
    "TIMEOUT": "the job ran into its own time limit",
    "DEADLINE": "the job ran past its deadline",
    "CANCELLED": "the job was cancelled",
    "PREEMPTED": "the job was preempted",
    "OUT_OF_MEMORY": "the job ran out of host memory (its own size)",
}
# FleetMedic's own burn-in jobs (activities/burn_in.py) end like any job: never a training failure.
BURN_IN_JOB_PREFIX = "fleetmedic-burnin-"
MAX_NODES = 4096  # one allocation; larger is a misbehaving sender
MAX_LINES = 20
MAX_LINE = 500
MAX_ENTRIES = 500
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")


class JobEnd(BaseModel):
    """One job's end, the schema every source posts (`POST /v1/jobs/ended`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["slurm", "kubernetes", "framework"] = "framework"
    cluster: str | None = Field(None, max_length=63)
    # The job's identity across restarts: the Slurm job ID, the Kubernetes Job's namespace/name.
    job: str
    name: str = Field("", max_length=200)
    state: str = Field("FAILED", max_length=32)
    exit_code: int | None = Field(None, ge=-255, le=255)
    nodes: list[str] = Field(min_length=1, max_length=MAX_NODES)
    started_at: datetime | None = None
    ended_at: datetime
    # The last complete checkpoint before the end, when the job knows it: the work after it is lost.
    last_checkpoint_at: datetime | None = None
    # Lines of the job's output a framework already picked (the Slurm path reads them itself).
    output_lines: list[str] = Field(default_factory=list, max_length=MAX_LINES)
    restart_count: int = Field(0, ge=0, le=100000)

    @field_validator("job")
    @classmethod
    def _job(cls, value: str) -> str:
        if not _JOB_ID.fullmatch(value):
            raise ValueError("job must be 1-128 of letters, digits and '_.:/-', starting with a letter or digit")
        return value

    @field_validator("state")
    @classmethod
    def _state(cls, value: str) -> str:
        state = value.upper().split()[0] if value.strip() else ""
        if state not in ENDED_STATES and state not in ("PENDING", "REQUEUED", "RUNNING"):
            raise ValueError(f"state must be a Slurm job state ({', '.join(sorted(ENDED_STATES))})")
        return state

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, value: list[str]) -> list[str]:
        return sorted({checked_node(n) for n in value})

    @field_validator("output_lines")
    @classmethod
    def _lines(cls, value: list[str]) -> list[str]:
        return [line[:MAX_LINE] for line in value]

    @field_validator("started_at", "ended_at", "last_checkpoint_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    @property
    def key(self) -> str:
        """The same end from two sources (the push and the reconciliation) is one end."""
        return f"{self.source}:{self.job}:{int(self.ended_at.timestamp())}"

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    @property
    def failed(self) -> bool:
        return self.ended and self.state != "COMPLETED"

    @property
    def fleetmedics_own(self) -> bool:
        return self.name.startswith(BURN_IN_JOB_PREFIX)


class JobEndsPost(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Entries are validated one by one (a bad one is refused alone): here they are only bounded.
    jobs: list[dict[str, object]] = Field(max_length=MAX_ENTRIES)


class JobEndAnswer(BaseModel):
    index: int
    job: str | None = None
    action: Literal["recorded", "ignored", "refused"]
    reason: str = ""


# --- Slurm -----------------------------------------------------------------------------------------

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
MAX_EXPANDED = MAX_NODES


def expand_hostlist(expression: str) -> list[str]:
    """Slurm's hostlist expression (`gpu-[01-03,07],cpu1`) as names, without asking scontrol: the
    webhook expands what jobcomp posts. Bounded; raises ValueError on what is not a hostlist."""
    names: list[str] = []
    for part in _split_top(expression.strip()):
        if not part:
            continue
        match = re.fullmatch(r"([^\[\]]*)\[([0-9,\-]+)\]([^\[\]]*)", part)
        if match is None:
            if "[" in part or "]" in part:
                raise ValueError(f"not a Slurm hostlist: {part[:80]!r}")
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            bounds = _RANGE.fullmatch(item)
            if bounds is None:
                raise ValueError(f"not a Slurm hostlist range: {item[:40]!r}")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            if int(high) < int(low) or int(high) - int(low) >= MAX_EXPANDED:
                raise ValueError(f"hostlist range {item[:40]!r} is backwards or too large")
            for number in range(int(low), int(high) + 1):
                names.append(f"{prefix}{str(number).zfill(len(low))}{suffix}")
                if len(names) > MAX_EXPANDED:
                    raise ValueError(f"hostlist names more than {MAX_EXPANDED} nodes")
    return names


def _split_top(expression: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in expression:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def from_jobcomp(fields: dict[str, str], cluster: str | None = None) -> JobEnd:
    """What Slurm 22.05's jobcomp/script puts in its script's environment (JOBID, JOBSTATE, NODES,
    EXITCODE `code:signal`, START and END in epoch seconds, JOBNAME), as the shipped script posts it
    (deploy/slurm/fleetmedic-jobcomp). Slurm also runs the script when it requeues a job, with
    JOBSTATE=PENDING: that is not an end, and the caller ignores it."""
    def epoch(name: str) -> datetime | None:
        raw = fields.get(name, "")
        return datetime.fromtimestamp(int(raw), UTC) if raw.isdigit() and int(raw) > 0 else None

    ended = epoch("END")
    if ended is None:
        raise ValueError("END must be the job's end time in epoch seconds")
    code, _, _signal = fields.get("EXITCODE", "").partition(":")
    return JobEnd.model_validate({
        "source": "slurm", "cluster": cluster, "job": fields.get("JOBID", ""), "name": fields.get("JOBNAME", "")[:200],
        "state": fields.get("JOBSTATE", ""), "exit_code": int(code) if code.lstrip("-").isdigit() else None,
        "nodes": expand_hostlist(fields.get("NODES", "")), "started_at": epoch("START"), "ended_at": ended})


# --- what the job-failures runbook asks its activities -----------------------------------------------

class OutputRequest(BaseModel):
    """The lines of a Slurm job's output that match `patterns`: the path is the one Slurm gives for
    the job (never one from a post), read only under `roots`, its last `tail_bytes` only."""

    job_id: int
    patterns: list[str]
    roots: list[str]
    tail_bytes: int = 65536


class RestartJob(BaseModel):
    """Restart a failed Slurm job from its checkpoint (`scontrol requeue`), unless it already was:
    Slurm requeues NODE_FAIL jobs itself, and a retried activity must not requeue twice."""

    job_id: int
    ended_at: datetime
    dry_run: bool = False


class SuspectRequest(BaseModel):
    cluster: str
    node: str
    evidence: str
    dry_run: bool = False


class SuspectNodeInput(BaseModel):
    """What starts a suspect-node run (the job-failures runbook, or a person in the UI):
    {"cluster": "prod", "node": "gpu-node-7", "evidence": "in 3 of the last 3 failed allocations of job 4412"}."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: str = Field(min_length=1)
    node: str = Field(min_length=1)
    evidence: str = Field("", max_length=2000)
    dry_run: bool = False
    requested_by: str = "job-failures"


def slurm_exit_code(status: int | None) -> int | None:
    """squeue --json gives the wait status (768 for exit code 3); jobcomp gives `3:0`."""
    if status is None:
        return None
    return (status >> 8) & 0xFF if status & 0x7F == 0 else -(status & 0x7F)


def from_squeue(raw: dict[str, object], cluster: str | None = None) -> JobEnd | None:
    """One job of `squeue --json --states=all` as an end, or None when it has not ended."""
    state = raw.get("job_state")
    if isinstance(state, list):
        state = state[0] if state else ""
    state = str(state).upper()
    end = raw.get("end_time")
    if state not in ENDED_STATES or not isinstance(end, int) or end <= 0:
        return None
    start = raw.get("start_time")
    code = raw.get("exit_code")
    return JobEnd.model_validate({
        "source": "slurm", "cluster": cluster, "job": str(raw.get("job_id")), "name": str(raw.get("name") or "")[:200],
        "state": state, "exit_code": slurm_exit_code(code if isinstance(code, int) else None),
        "nodes": expand_hostlist(str(raw.get("nodes") or "")),
        "started_at": datetime.fromtimestamp(start, UTC) if isinstance(start, int) and start > 0 else None,
        "ended_at": datetime.fromtimestamp(end, UTC), "restart_count": int(str(raw.get("restart_cnt") or 0))})
