"""Slurm: node state with `fleetmedic:` reasons, jobs on a node, the checkpoint signal, requeue.

Writes go through `scontrol` (slurmrestd 22.05's API, v0.0.38, cannot update nodes or requeue;
node updates arrive with v0.0.39). Reads go through slurmrestd when FLEETMEDIC_SLURMRESTD_URL is
set (JWT auth), else through the CLI's text: sinfo for a node alone, `scontrol show node` for
several, squeue for the jobs that hold nodes, for jobs by ID and for those that ended
(`sinfo/squeue --json` print everything of every node or job and ignore their filters in 22.05).

FleetMedic only changes or clears reasons it owns: a node DOWN or DRAINed by a person is left
alone and the activity says so. Nodes are named as Kubernetes names them; `names`
(activities/slurm_names.py, policy `slurm.mapping`) says which Slurm node each is. With Slinky,
the operator's drains (`slurm-operator:`, from a cordon it syncs) are worked with, never undone:
FleetMedic's DRAIN or DOWN keeps the operator's reason inside its own, and its RESUME puts that
drain back for the operator to clear.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, Protocol

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import fail, http_errors, raise_for_status
from activities.metrics import count
from activities.shared_reads import SharedReads
from activities.slurm_names import OPERATOR_PREFIX, SameName, SlurmNames
from fleetmedic.errors import ErrorKind
from fleetmedic.job_failures import ENDED_STATES, expand_hostlist
from fleetmedic.listing import first_few
from fleetmedic.models import (
    ActionResult,
    RequeueJob,
    SetSlurmNodeState,
    SignalJob,
    SlurmJob,
    SlurmNode,
    SlurmNodeState,
)

REASON_PREFIX = "fleetmedic:"
ACTIVE_JOB_STATES = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")
# How a job ends after the checkpoint signal: most exit 0 once their checkpoint is written.
ENDED_AFTER_SIGNAL = ("COMPLETED", "FAILED", "CANCELLED")
HOSTLISTS_KEPT = 4096  # expanded hostlist expressions kept (`SlurmActivities._expand`)
NOT_FOUND_NODE = re.compile(r"Node \S+ not found")
# FleetMedic's DRAIN or DOWN over the operator's drain keeps the operator's reason after its own
# (the operator leaves a reason that is not its own alone): FleetMedic's RESUME puts that drain
# back, and the operator clears it when its cause (a cordon) is gone.
KEPT = " | kept: "

log = logging.getLogger(__name__)


def kept_drain(reason: str) -> str:
    """The operator's drain reason that FleetMedic's `reason` keeps ("" when none)."""
    kept = reason.partition(KEPT)[2]
    return kept if kept.startswith(OPERATOR_PREFIX) else ""


def _classify_cli_error(text: str) -> ErrorKind:
    lowered = text.lower()
    if "invalid node name" in lowered or "invalid job id" in lowered or "not found" in lowered:
        return ErrorKind.NOT_FOUND
    if "access/permission denied" in lowered or "permission denied" in lowered:
        return ErrorKind.FORBIDDEN
    if "already pending" in lowered or "pending execution" in lowered:
        return ErrorKind.CONFLICT
    if "invalid" in lowered:
        return ErrorKind.INVALID
    return ErrorKind.UNAVAILABLE  # "Unable to contact slurm controller", socket errors ...


def raise_slurm_errors(data: dict[str, Any], where: str) -> None:
    """Slurm's JSON answers (CLI and REST alike) report failures in an `errors` list: an error,
    retried and then escalated, never an empty answer."""
    errors = [e for e in data.get("errors") or [] if isinstance(e, dict) and (e.get("error_number")
                                                                              or e.get("error"))]
    if errors:
        first = errors[0]
        text = first.get("error") or first.get("description") or f"error {first.get('error_number')}"
        raise fail(ErrorKind.UNAVAILABLE, f"{where}: {text}")


def node_from_json(raw: dict[str, Any]) -> SlurmNode:
    state = raw.get("state", "")
    flags = [str(f).upper() for f in raw.get("state_flags") or []]
    if isinstance(state, list):  # newer data parsers give a list of flags
        flags += [str(s).upper() for s in state[1:]]
        state = state[0] if state else ""
    return SlurmNode(name=raw["name"], state=str(state).lower(), flags=flags, reason=raw.get("reason") or "")


def _nodes_of(raw: dict[str, Any]) -> list[str]:
    """The job's nodes. Slurm names a job's nodes by a hostlist expression (`gpu-[001-064]`), and
    each one by name in `job_resources.allocated_nodes` (squeue --json and slurmrestd v0.0.38
    alike): those, where the job has them. Else the expression's parts, which `_expand` expands
    when they have brackets: squeue's text (JOB_FORMAT) gives only the expression."""
    allocated = (raw.get("job_resources") or {}).get("allocated_nodes") or []
    if isinstance(allocated, dict):  # keyed by index in some data parsers
        allocated = list(allocated.values())
    named = [str(n["nodename"]) for n in allocated if isinstance(n, dict) and n.get("nodename")]
    if named:
        return named
    text = raw.get("nodes") or ""
    return [n for n in text.split(",") if n]


def _state_of(raw: dict[str, Any]) -> str:
    state = raw.get("job_state", "")
    if isinstance(state, list):
        state = state[0] if state else ""
    return str(state).upper()


def job_from_json(raw: dict[str, Any]) -> SlurmJob:
    return SlurmJob(job_id=int(raw["job_id"]), name=raw.get("name", ""), state=_state_of(raw),
                    nodes=_nodes_of(raw), restart_count=int(raw.get("restart_cnt") or 0),
                    requeue=bool(raw.get("requeue", True)), work_dir=raw.get("current_working_directory", ""),
                    state_reason=raw.get("state_reason") or "")


# The jobs' fields as squeue prints them (`squeue --Format`), each followed by the unit separator:
# a field is printed whole, not padded, when it has no width. Name and WorkDir are free text (a
# user's), so a line splits into exactly these fields, and an empty rest, or is not read at all.
# Each has the key of `squeue --json`'s job that holds the same value.
JOB_FIELDS = (("JobID", "job_id"), ("State", "job_state"), ("RestartCnt", "restart_cnt"), ("Requeue", "requeue"),
              ("Reason", "state_reason"), ("NodeList", "nodes"), ("Name", "name"),
              ("WorkDir", "current_working_directory"))
# The ended jobs' fields, for the job-failures runbook's reconciliation (activities/jobs.py): the
# wait status as --json gives it (768: exit 3), times as seconds since the epoch (SLURM_TIME_FORMAT).
END_FIELDS = (("JobID", "job_id"), ("State", "job_state"), ("exit_code", "exit_code"), ("StartTime", "start_time"),
              ("EndTime", "end_time"), ("NodeList", "nodes"), ("RestartCnt", "restart_cnt"), ("Name", "name"))
SEPARATOR = "\x1f"
# A strftime format (squeue(1), SLURM_TIME_FORMAT): each time as the epoch's seconds, whatever the
# worker's time zone or its own setting; a time Slurm has not set prints as a word ("Unknown").
EPOCH_SECONDS = {"SLURM_TIME_FORMAT": "%s"}
# Fields whose text must be a number: a line where one is not was misread. A time Slurm has not
# set (a word) is 0, as --json has it. Requeue is 0 or 1.
NUMBERS = ("job_id", "restart_cnt", "exit_code")
TIMES = ("start_time", "end_time")


def job_format(fields: Sequence[tuple[str, str]]) -> str:
    return ",".join(f"{field}:{SEPARATOR}" for field, _ in fields)


JOB_FORMAT, END_FORMAT = job_format(JOB_FIELDS), job_format(END_FIELDS)


def split_fields(line: str, count: int) -> list[str] | None:
    """A line of a --Format read: its `count` fields, each followed by SEPARATOR; None when the line
    does not split into exactly those and an empty rest (free text holding the separator, or cut by
    a line break)."""
    values = line.split(SEPARATOR)
    return values[:-1] if len(values) == count + 1 and not values[-1] else None


def jobs_from_format(text: str, fields: Sequence[tuple[str, str]] = JOB_FIELDS) -> list[dict[str, Any]] | None:
    """squeue's lines in `fields` (job_format) as `squeue --json` jobs (the keys FleetMedic reads);
    None when a line does not split into the fields, or its numbers are not numbers: the caller
    reads JSON."""
    keys = tuple(key for _, key in fields)
    numbers = [key for key in keys if key in NUMBERS]
    times = [key for key in keys if key in TIMES]
    requeue = "requeue" in keys
    jobs: list[dict[str, Any]] = []
    for line in text.splitlines():  # thousands in a fleet's queue: one dict each, made once
        if (values := split_fields(line, len(keys))) is None:
            return None
        job: dict[str, Any] = dict(zip(keys, values, strict=True))
        for key in numbers:
            if not (value := job[key]).isdigit():
                return None
            job[key] = int(value)
        for key in times:
            job[key] = int(value) if (value := job[key]).isdigit() else 0
        if requeue:
            if job["requeue"] not in ("0", "1"):
                return None
            job["requeue"] = job["requeue"] == "1"
        jobs.append(job)
    return jobs


# One node as sinfo prints it (`sinfo --Format`), fields as the jobs': the reason is free text.
NODE_FIELDS = ("NodeList", "StateComplete", "Reason")
NODE_FORMAT = ",".join(f"{field}:{SEPARATOR}" for field in NODE_FIELDS)


def node_from_format(text: str, name: str) -> SlurmNode | None:
    """sinfo's NODE_FORMAT lines of node `name` (one a partition it is in) as the node, read as
    `node_from_scontrol` reads scontrol's `State=IDLE+DRAIN+NOT_RESPONDING` (sinfo prints it in
    lower case) and its reason ("none": none); None when there is no line, or a line that does not
    split into NODE_FIELDS or names another node."""
    seen = set()
    for line in text.splitlines():
        if (values := split_fields(line, len(NODE_FIELDS))) is None or values[0] != name:
            return None
        seen.add((values[1], values[2].strip()))
    if len(seen) != 1:
        return None
    state, reason = seen.pop()
    return slurm_node(name, state, reason)


def slurm_node(name: str, state: str, reason: str) -> SlurmNode:
    """A node as Slurm's CLI states it, scontrol's `IDLE+DRAIN+NOT_RESPONDING` (`*`: not
    responding, in older forms) or sinfo's same words in lower case: the base state and its flags;
    a reason "none" is none."""
    parts = [p for p in state.split("+") if p]
    return SlurmNode(name=name, state=parts[0].rstrip("*").lower() if parts else "",
                     flags=[p.rstrip("*").upper() for p in parts[1:]], reason="" if reason == "none" else reason)


# One node update: (node, state, reason — "" for none).
NodeUpdate = tuple[str, str, str]


def update_argv(update: NodeUpdate) -> tuple[str, ...]:
    node, state, reason = update
    return ("scontrol", "update", f"nodename={node}", f"state={state}", *((f"reason={reason}",) if reason else ()))


def _line_safe(text: str) -> bool:
    # scontrol's own line parser quotes a value with "…" and has no escape for a quote inside one.
    return text.isprintable() and '"' not in text


class SlurmReader(Protocol):
    def nodes(self, names: Collection[str]) -> dict[str, SlurmNode]: ...  # those that exist
    def active_jobs(self) -> list[dict[str, Any]]: ...  # every job that may hold nodes (ACTIVE_JOB_STATES), or more
    def jobs_by_id(self, ids: Collection[int]) -> dict[int, dict[str, Any]]: ...  # those Slurm still holds


def by_id(jobs: list[dict[str, Any]], ids: Collection[int]) -> dict[int, dict[str, Any]]:
    """Jobs `ids` of a list of jobs read (`squeue --json`'s keys)."""
    return {job_id: job for job in jobs if (job_id := int(job.get("job_id", -1))) in ids}


def scontrol_fields(line: str) -> dict[str, str]:
    """`Key=value` fields of one `scontrol show … -o` line (a value with spaces keeps its first word)."""
    return dict(f.partition("=")[::2] for f in line.split() if "=" in f)


def node_from_scontrol(line: str) -> SlurmNode:
    """One node of `scontrol show node -o NAME`: `State=IDLE+DRAIN` gives the state and its flags
    (`*`: not responding); `Reason=` runs to the end of the line, less its `[user@time]`."""
    fields = scontrol_fields(line)
    reason = line.partition(" Reason=")[2].strip() if " Reason=" in line else ""
    return slurm_node(fields.get("NodeName", ""), fields.get("State", ""),
                      re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason))


def slurmctld_address(slurm_conf: str) -> str:
    """`host:port` of the (first) slurmctld that `slurm_conf` names, for error messages; the path
    itself when it cannot be read."""
    try:
        text = open(slurm_conf, encoding="utf-8").read()
    except OSError:
        return f"(per {slurm_conf})"
    host = re.search(r"^\s*(?:SlurmctldHost|ControlMachine)\s*=\s*([^\s(#]+)(?:\(([^)]+)\))?", text, re.M | re.I)
    port = re.search(r"^\s*SlurmctldPort\s*=\s*(\d+)", text, re.M | re.I)
    where = (host.group(2) or host.group(1)) if host else "localhost"
    return f"{where}:{port.group(1) if port else '6817'}"


class SlurmCli:
    """scontrol/sinfo/squeue with SLURM_CONF from settings, each call under a timeout."""

    def __init__(self, slurm_conf: str | None, timeout_s: float) -> None:
        self.env = {**os.environ, **({"SLURM_CONF": slurm_conf} if slurm_conf else {})}
        self.timeout = timeout_s
        self.jobs_read_as_json = 0  # job reads squeue's text could not give (`_jobs_read`)
        self.controller = slurmctld_address(self.env.get("SLURM_CONF", "/etc/slurm/slurm.conf"))

    def run(self, *argv: str, env: Mapping[str, str] | None = None) -> str:
        done = self._run(argv, env=env)
        if done.returncode != 0:
            self._raise(argv, done, (done.stderr or done.stdout).strip())
        return done.stdout

    def _run(self, argv: Sequence[str], stdin: str | None = None,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        if shutil.which(argv[0]) is None:
            raise fail(ErrorKind.UNAVAILABLE, f"{argv[0]} is not installed on this worker")
        try:
            return subprocess.run(list(argv), env={**self.env, **env} if env else self.env, capture_output=True,
                                  text=True, timeout=self.timeout, input=stdin)
        except subprocess.TimeoutExpired:
            raise fail(ErrorKind.TIMEOUT, f"slurmctld at {self.controller} did not answer {' '.join(argv[:2])} "
                                          f"within {self.timeout}s") from None

    def _raise(self, argv: Sequence[str], done: subprocess.CompletedProcess[str], message: str) -> NoReturn:
        message = message or f"exit {done.returncode}"
        kind = _classify_cli_error(message)
        if kind in (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT):  # say which system, as an operator needs it
            raise fail(kind, f"slurmctld at {self.controller} unreachable: {' '.join(argv[:3])}: {message}")
        raise fail(kind, f"{' '.join(argv[:3])}: {message}")

    def _json(self, *argv: str) -> dict[str, Any]:
        out = self.run(*argv)
        try:
            data: dict[str, Any] = json.loads(out)
        except json.JSONDecodeError:
            raise fail(ErrorKind.UNAVAILABLE, f"{argv[0]} --json gave no JSON: {out[:200]}") from None
        # Slurm 22.05's squeue/sinfo --json exit 0 with an `errors` list when slurmctld cannot be
        # reached: read as data, that is "no jobs" (no grace, drain at once) and "no such node".
        raise_slurm_errors(data, f"{argv[0]} --json")
        return data

    def nodes(self, names: Collection[str]) -> dict[str, SlurmNode]:
        """These nodes: one alone through sinfo, which asks slurmctld for that node only
        (`node_alone`); several through `scontrol show node -o A,B,…`, which loads every node of the
        cluster once for them all (15 ms of CPU with 8,000 nodes; sinfo's one node, 3 ms whatever
        the size: bench/slurm_reads.py). Never `sinfo --json`, which dumps every node and ignores
        its filters in 22.05. A name Slurm does not know is left out (scontrol prints `Node X not
        found` and exits 1, still printing the others); any other failure, such as an unreachable
        slurmctld, is raised."""
        if len(names) == 1 and (alone := self.node_alone(next(iter(names)))) is not None:
            return {alone.name: alone}
        argv = ("scontrol", "show", "node", "-o", ",".join(sorted(names)))
        done = self._run(argv)
        # `Node X not found` comes on stdout or stderr, depending on where the name is in the list.
        lines = [ln.strip() for ln in (done.stdout + "\n" + done.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if not ln.startswith("NodeName=") and not NOT_FOUND_NODE.fullmatch(ln)]
        if done.returncode != 0 and (errors or not lines):
            self._raise(argv, done, "\n".join(errors))
        found = (node_from_scontrol(ln) for ln in done.stdout.splitlines() if ln.startswith("NodeName="))
        return {node.name: node for node in found if node.name in names}

    def node_alone(self, name: str) -> SlurmNode | None:
        """Node `name` as sinfo prints it (NODE_FORMAT), a line a partition it is in; None when
        sinfo says nothing of it (a name Slurm does not know, a node in no partition or FUTURE) or
        its lines do not split into their fields (a line break in the reason): scontrol then reads
        it as it reads several. Its state is scontrol's but for a partly used node, which sinfo
        calls allocated and scontrol mixed: busy either way, neither out of service."""
        text = self.run("sinfo", "--noheader", "--all", "--Node", f"--nodes={name}", f"--Format={NODE_FORMAT}")
        return node_from_format(text, name)

    def active_jobs(self) -> list[dict[str, Any]]:
        """The jobs that hold nodes (ACTIVE_JOB_STATES), as squeue's own text (JOB_FORMAT), in the
        fields of `squeue --json` that FleetMedic reads: a node's jobs are among them. squeue loads
        every job from slurmctld, and prints these alone: a long queue of pending jobs is not
        printed, nor parsed here. The JSON had every field of every job (3 KB each; 22.05's --json
        ignores every filter): with 2,000 jobs queued, 6 MB and 260 ms of CPU a read, squeue's and
        the worker's parsing (bench/slurm_reads.py)."""
        text = self.run("squeue", "--noheader", "--all", f"--states={','.join(ACTIVE_JOB_STATES)}",
                        f"--Format={JOB_FORMAT}")
        return self._jobs_read(text, JOB_FIELDS, "the jobs on nodes")

    def jobs_by_id(self, ids: Collection[int]) -> dict[int, dict[str, Any]]:
        """These jobs in any state (an ended one, within MinJobAge), read as `active_jobs` reads
        them. squeue asks slurmctld for one job alone (`--jobs=ID`: 3 ms of CPU whatever the
        queue), and loads every job once for several. None of them known: nothing, not an error.
        With slurmctld unreachable, squeue tries the one job, then every job, each for ~9 s: past
        the call's timeout, a Timeout naming slurmctld, where a read of every job is Unavailable."""
        try:
            text = self.run("squeue", "--noheader", "--all", "--states=all",
                            f"--jobs={','.join(map(str, sorted(ids)))}", f"--Format={JOB_FORMAT}")
        except ApplicationError as exc:
            if exc.type == ErrorKind.NOT_FOUND:  # "Invalid job id specified": none of the IDs is a job it holds
                return {}
            raise
        return by_id(self._jobs_read(text, JOB_FIELDS, "jobs by ID"), ids)

    def ended_jobs(self) -> list[dict[str, Any]]:
        """The jobs that ended and that slurmctld still holds (MinJobAge), read as `active_jobs`
        reads its jobs, in END_FIELDS: squeue prints these alone (--json ignores the filter and
        prints every job: 25 MB and 1 s of CPU with 8,000; bench/slurm_reads.py)."""
        text = self.run("squeue", "--noheader", "--all", f"--states={','.join(sorted(ENDED_STATES))}",
                        f"--Format={END_FORMAT}", env=EPOCH_SECONDS)
        return self._jobs_read(text, END_FIELDS, "the ended jobs")

    def _jobs_read(self, text: str, fields: Sequence[tuple[str, str]], what: str) -> list[dict[str, Any]]:
        """squeue's text in `fields` as jobs; when a line does not split into its fields (a name or
        directory with the separator or a line break), every job read again as JSON that one time,
        said and counted: never a job misread. The callers keep the jobs they asked for."""
        if (jobs := jobs_from_format(text, fields)) is not None:
            return jobs
        self.jobs_read_as_json += 1
        log.warning("squeue's text had a job it could not split into fields (a name or working directory with "
                    "a line break or \\x1f): %s read as JSON this time (%d so far)", what, self.jobs_read_as_json)
        count("fleetmedic_slurm_jobs_read_as_json",
              "job lists read as JSON: squeue's text had a line it could not split")
        return list(self._json("squeue", "--json", "--states=all").get("jobs", []))

    def update_nodes(self, updates: Collection[NodeUpdate]) -> dict[NodeUpdate, Exception]:
        """Node updates asked at the same time, through one `scontrol` reading them from its stdin:
        one process (and one read of slurm.conf) for the lot instead of one per node — in a storm,
        the processes cost more CPU than slurmctld's answers. One update alone runs as it always
        did. After any failure of the lot (its exit status, a word on stderr) each update is done
        again on its own, so each caller gets its own error; a DRAIN, DOWN or RESUME done twice is
        the same change. Returns the errors, by update."""
        batched = sorted(u for u in updates if all(_line_safe(part) for part in u))
        single = sorted(set(updates) - set(batched))
        if len(batched) > 1:
            lines = "".join(f'update nodename={node} state={state}' + (f' reason="{reason}"' if reason else "") + "\n"
                            for node, state, reason in batched)
            done = self._run(("scontrol",), stdin=lines)
            if done.returncode != 0 or done.stderr.strip():
                single += batched
        else:
            single += batched
        errors: dict[NodeUpdate, Exception] = {}
        for update in single:
            try:
                self.run(*update_argv(update))
            except Exception as exc:  # this caller's own error (retried by its activity)
                errors[update] = exc
        return errors


class SlurmRest:
    """Reads through slurmrestd (openapi/v0.0.38) with a JWT."""

    def __init__(self, url: str, token: str, user: str, timeout_s: float) -> None:
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s,
                                   headers={"X-SLURM-USER-NAME": user, "X-SLURM-USER-TOKEN": token})

    def _get(self, path: str) -> dict[str, Any]:
        with http_errors(f"slurmrestd {path}"):
            response = self.client.get(path)
        raise_for_status(response, f"slurmrestd {path}")
        data: dict[str, Any] = response.json()
        raise_slurm_errors(data, f"slurmrestd {path}")
        return data

    def nodes(self, names: Collection[str]) -> dict[str, SlurmNode]:
        found: dict[str, SlurmNode] = {}
        for name in names:  # v0.0.38 reads one node, or all of them (thousands)
            try:
                nodes = self._get(f"/slurm/v0.0.38/node/{name}").get("nodes", [])
            except ApplicationError as exc:
                if exc.type == ErrorKind.NOT_FOUND:
                    continue
                raise
            found.update((node.name, node) for node in map(node_from_json, nodes) if node.name == name)
        return found

    def active_jobs(self) -> list[dict[str, Any]]:
        return list(self._get("/slurm/v0.0.38/jobs").get("jobs", []))  # every job: v0.0.38 has no filter

    def jobs_by_id(self, ids: Collection[int]) -> dict[int, dict[str, Any]]:
        return by_id(self.active_jobs(), ids)


class SlurmActivities:
    def __init__(self, cli: SlurmCli, reader: SlurmReader | None = None, *, force_dry_run: bool = False,
                 names: SlurmNames | None = None) -> None:
        self.cli = cli
        self.reader: SlurmReader = reader or cli
        self.force_dry_run = force_dry_run
        self.names: SlurmNames = names or SameName()
        self.slinky = self.names.mapping == "slinky"
        # Runs asking at once share one read (activities/shared_reads.py): 50 nodes failing
        # together ask slurmctld twice, not 100 times, each answer still read after its question.
        self.shared_nodes: SharedReads[str, SlurmNode] = SharedReads(self.reader.nodes)
        self.shared_jobs: SharedReads[None, list[dict[str, Any]]] = SharedReads(
            lambda _: {None: self.reader.active_jobs()})
        self.shared_job_ids: SharedReads[int, dict[str, Any]] = SharedReads(self.reader.jobs_by_id)
        # Node updates asked at once go through one scontrol (`SlurmCli.update_nodes`); each caller
        # still waits for its own update, done by a process started after it asked.
        self.shared_updates: SharedReads[NodeUpdate, Exception] = SharedReads(cli.update_nodes, max_keys=100)
        self.hostnames: dict[str, list[str]] = {}  # hostlist expressions expanded (`_expand`)

    def slurm_name(self, node: str) -> str | None:
        """The Slurm node of Kubernetes node `node` (None: it has none, policy `slurm.mapping`)."""
        return self.names.slurm_node(node)

    def node_now(self, name: str) -> SlurmNode | None:
        """Kubernetes node `name`'s Slurm node as slurmctld has it now (None: there is none)."""
        slurm = self.slurm_name(name)
        return self.shared_nodes.get(slurm) if slurm is not None else None

    def _active_jobs(self) -> list[dict[str, Any]]:
        return self.shared_jobs.get(None) or []

    def _node(self, name: str) -> SlurmNode:
        node = self.node_now(name)
        if node is None:
            raise fail(ErrorKind.NOT_FOUND, self.names.missing(name))
        return node

    @activity.defn(name="slurm.get_node")
    def get_node(self, name: str) -> SlurmNode:
        if not self.slinky:
            return self._node(name)
        # A replacement's slurmd pod comes after its node, and registers after it starts: until
        # then the node is one Slurm does not know yet (a runbook waiting for it keeps waiting).
        slurm = self.slurm_name(name)
        node = self.shared_nodes.get(slurm) if slurm is not None else None
        if node is None:
            return SlurmNode(name=slurm or name, state="unknown", reason=self._no_slurm_node(name, slurm))
        return node

    def _no_slurm_node(self, node: str, slurm: str | None) -> str:
        """Why Kubernetes node `node` has no Slurm node to act on (Slinky): no slurmd pod, or its
        pod's slurmd (`slurm`) not registered yet."""
        if slurm is None:
            return self.names.missing(node)
        return f"slurmd pod {slurm} on {node} has not registered with slurmctld"

    @activity.defn(name="slurm.jobs_on_node")
    def jobs_on_node(self, node: str) -> list[SlurmJob]:
        slurm = self.slurm_name(node) if self.slinky else node
        if slurm is None:
            return []
        # Only this node's jobs become models: a fleet's job list has thousands, read by every run
        # asking at once (each read shared, each caller filtering it).
        jobs = [self._job(raw) for raw in self._active_jobs()
                if _state_of(raw) in ACTIVE_JOB_STATES and slurm in self._expand(_nodes_of(raw))]
        return self._as_kubernetes(jobs) if self.slinky else jobs

    def _job(self, raw: dict[str, Any]) -> SlurmJob:
        """A job as read, each of its nodes by name: a requeue for one of them finds it there."""
        job = job_from_json(raw)
        return job.model_copy(update={"nodes": self._expand(job.nodes)})

    def _as_kubernetes(self, jobs: list[SlurmJob]) -> list[SlurmJob]:
        """Jobs (their nodes by name, `_job`) with their nodes as Kubernetes names them (Slinky: the
        nodes their slurmd pods run on), from one read of the pods."""
        where = self.names.kube_nodes({n for j in jobs for n in j.nodes}) if jobs else {}
        return [j.model_copy(update={"nodes": [where[n] for n in j.nodes]}) for j in jobs]

    def _expand(self, nodes: list[str]) -> list[str]:
        if not any("[" in n for n in nodes):
            return nodes
        expression = ",".join(nodes)
        # A hostlist names the same nodes forever: each expression is expanded once, here, or by
        # scontrol where it is a form this reading does not take (two bracket groups in a name).
        if (known := self.hostnames.get(expression)) is None:
            try:
                known = expand_hostlist(expression)
            except ValueError:
                known = self.cli.run("scontrol", "show", "hostnames", expression).split()
            if len(self.hostnames) >= HOSTLISTS_KEPT:
                self.hostnames.clear()
            self.hostnames[expression] = known
        return known

    @activity.defn(name="slurm.get_job")
    def get_job(self, job_id: int) -> SlurmJob:
        if (raw := self.shared_job_ids.get(job_id)) is None:
            raise fail(ErrorKind.NOT_FOUND, f"Slurm has no job {job_id} (finished longer than MinJobAge ago?)")
        job = self._job(raw)
        return self._as_kubernetes([job])[0] if self.slinky else job

    @activity.defn(name="slurm.set_node_state")
    def set_node_state(self, request: SetSlurmNodeState) -> ActionResult:
        """DOWN/DRAIN with a `fleetmedic:` reason, or RESUME a node whose reason we own."""
        return self.set_state(request)

    def set_state(self, request: SetSlurmNodeState, current: SlurmNode | None = None) -> ActionResult:
        """`set_node_state`; `current`: the node as just read, if it was (the protective step reads
        it beside the Kubernetes node)."""
        verb = {SlurmNodeState.RESUME: "resume", SlurmNodeState.DOWN: "set DOWN"}.get(request.state, "set DRAIN")
        # The node as just read names itself: no second lookup of its slurmd pod.
        slurm = current.name if current is not None else self.slurm_name(request.node)
        node = current or (self.shared_nodes.get(slurm) if slurm is not None else None)
        if slurm is None or (node is None and self.slinky):
            # Slinky: no slurmd pod on the node (yet), or one slurmctld has not heard from: nothing to set.
            return self._result(verb, f"Slurm side of node {request.node}", changed=False, request=request,
                                detail=f"{self._no_slurm_node(request.node, slurm)}: nothing to set")
        if node is None:
            raise fail(ErrorKind.NOT_FOUND, self.names.missing(request.node))
        target = f"Slurm node {slurm}" + (f" (slurmd pod on {request.node})" if slurm != request.node else "")
        owned = node.reason.startswith(REASON_PREFIX)
        # Slinky's operator drained it, syncing a cordon (maybe ours): its drain, which it clears itself.
        theirs = self.slinky and node.out_of_service and node.reason.startswith(OPERATOR_PREFIX)
        if request.state is SlurmNodeState.RESUME:
            if not node.out_of_service:
                return self._result(verb, target, changed=False, request=request, detail="already in service")
            if theirs:
                return self._result(verb, target, changed=False, request=request, detail=(
                    f"drained by Slinky's operator ('{node.reason}'): left to it, which undrains the node once "
                    "its Kubernetes node is uncordoned"))
            if not owned:
                raise fail(ErrorKind.NOT_OWNED, f"{target} is out of service for '{node.reason}', "
                                                f"which FleetMedic does not own; not resuming it")
            if self._dry(request):
                return self._result(verb, target, changed=False, request=request, detail=node.reason)
            kept = kept_drain(node.reason) if self.slinky else ""
            self._update((slurm, "RESUME", ""))
            if kept:  # the operator's drain, as it was before FleetMedic's DOWN: the operator clears it
                self._update((slurm, "DRAIN", kept))
            return self._result(verb, target, changed=True, request=request, detail=f"was: {node.reason}" + (
                f"; Slinky's operator's drain put back for it to clear: {kept}" if kept else ""))

        if not request.reason.startswith(REASON_PREFIX):
            raise fail(ErrorKind.INVALID, f"a reason FleetMedic sets must start with '{REASON_PREFIX}'")
        if node.out_of_service and node.reason and not owned and not theirs:
            raise fail(ErrorKind.NOT_OWNED, f"{target} is already out of service for '{node.reason}', "
                                            f"which FleetMedic does not own; leaving it")
        kept = node.reason if theirs else kept_drain(node.reason) if self.slinky else ""
        reason = f"{request.reason}{KEPT}{kept}" if kept else request.reason
        already = (node.state == "down" if request.state is SlurmNodeState.DOWN
                   else node.state in ("drained", "draining") or "DRAIN" in node.flags)
        if already and node.reason == reason:
            return self._result(verb, target, changed=False, request=request, detail=reason)
        if self._dry(request):
            return self._result(verb, target, changed=False, request=request, detail=reason)
        if self.slinky and request.state is SlurmNodeState.DOWN and not (
                "DRAIN" in node.flags or node.state in ("drained", "draining")):
            # The operator drains a node whose Kubernetes node is cordoned and that lacks the DRAIN
            # flag, with a reason of its own that would replace ours: DRAIN first, so it finds one.
            self._update((slurm, "DRAIN", reason))
        self._update((slurm, request.state.value, reason))
        return self._result(verb, target, changed=True, request=request, detail=reason)

    def _update(self, update: NodeUpdate) -> None:
        if (error := self.shared_updates.get(update)) is not None:
            raise error

    @activity.defn(name="slurm.requeue_job")
    def requeue_job(self, request: RequeueJob) -> ActionResult:
        job = self.get_job(request.job_id)
        target = f"Slurm job {request.job_id}"
        if job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
            return self._result("requeue", target, changed=False, request=request,
                                detail=f"already {job.state.lower()} (restarts: {job.restart_count})")
        ended_after_signal = request.signalled and job.state in ENDED_AFTER_SIGNAL
        if job.state not in ACTIVE_JOB_STATES and not ended_after_signal:
            return self._result("requeue", target, changed=False, request=request,
                                detail=f"job is {job.state}: nothing to requeue")
        nodes = self._expand(job.nodes)
        if request.node and request.node not in nodes:
            # Checked right before the kill: Slurm requeued it already and it restarted elsewhere.
            where = first_few(nodes, 8, sep=",") or "no node"
            return self._result("requeue", target, changed=False, request=request,
                                detail=f"runs on {where} now, not {request.node}: left alone")
        if self._dry(request):
            return self._result("requeue", target, changed=False, request=request)
        try:
            self.cli.run("scontrol", "requeue", str(request.job_id))
        except Exception as exc:
            # Slurm requeued it between our read and our call: that is what we wanted.
            if getattr(exc, "type", None) == ErrorKind.CONFLICT:
                return self._result("requeue", target, changed=False, request=request, detail="already pending")
            raise
        return self._result("requeue", target, changed=True, request=request,
                            detail=f"it ended ({job.state}) after our signal" if ended_after_signal else "")

    @activity.defn(name="slurm.signal_job")
    def signal_job(self, request: SignalJob) -> ActionResult:
        """Ask a job to checkpoint before its node goes DOWN (Slurm's DOWN would SIGKILL it KillWait
        seconds after its SIGTERM). The batch shell and every step get the signal (`--full`), and
        only while the job runs on the bad node (`--nodelist`)."""
        job = self.get_job(request.job_id)
        target = f"Slurm job {request.job_id}"
        slurm = self.slurm_name(request.node)
        if job.state not in ACTIVE_JOB_STATES or slurm is None or request.node not in self._expand(job.nodes):
            return self._result("signal", target, changed=False, request=request,
                                detail=f"{job.state.lower()} on {','.join(job.nodes) or 'no node'}: not signalled")
        signal = request.signal.removeprefix("SIG")
        if self._dry(request):
            return self._result("signal", target, changed=False, request=request, detail=f"SIG{signal}")
        self.cli.run("scancel", f"--signal={signal}", "--full", f"--nodelist={slurm}", str(request.job_id))
        return self._result("signal", target, changed=True, request=request, detail=f"SIG{signal}")

    def _dry(self, request: SetSlurmNodeState | RequeueJob | SignalJob) -> bool:
        return request.dry_run or self.force_dry_run

    def _result(self, verb: str, target: str, *, changed: bool,
                request: SetSlurmNodeState | RequeueJob | SignalJob,
                detail: str = "") -> ActionResult:
        dry = self._dry(request)
        return ActionResult(system="slurm", action=verb, target=target, changed=changed and not dry,
                            dry_run=dry, detail=detail)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.jobs_on_node, self.get_job, self.get_node, self.set_node_state, self.requeue_job,
                self.signal_job]
