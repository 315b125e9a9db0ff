"""A real Slurm cluster from Debian's packages, on loopback, in a temp dir (tests and `fleetmedic dev`).

munged, slurmctld, one `slurmd -N <name>` per node name (each on its own port) and optionally
slurmrestd run in the foreground as children of this object, so nothing outlives it. Settings
are chosen to make remediation fast to observe: a requeued job restarts within seconds
(`cred_expire`, `sched_interval`), SIGTERM grace is `KillWait`, and a node set DOWN by hand stays
DOWN (`ReturnToService=1`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from devstack.processes import die_with_parent

REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch")


def missing_binaries(with_rest: bool = False) -> list[str]:
    needed = REQUIRED_BINARIES + (("slurmrestd",) if with_rest else ())
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [b for b in needed if shutil.which(b, path=search) is None]


# Ports this process has handed out: two callers in one test never get the same one.
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nothing listens on, for a server we are about to start.

    Chosen below the kernel's ephemeral range: a port from there (what binding port 0 gives) can
    be taken by any outgoing connection on the machine between our check and the server's bind,
    which once made slurmctld fail with "Address already in use" in the middle of a CI run. A port
    outside it can only be lost to another server picking the same number."""
    low = _ephemeral_range()[0]
    if low > 20000 + 1000:
        rng = secrets.SystemRandom()
        for _ in range(200):
            port = rng.randrange(20000, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def hostlists(names: Sequence[str]) -> list[str]:
    """`names` as Slurm hostlist expressions (`gpu-f-[0-999]`), as a site writes a fleet's node
    lines: every Slurm command parses all of slurm.conf when it starts, and a line per node made
    each `scontrol` of a 1,160-node benchmark fleet take ~50 ms before it did anything (~4 ms with
    ranges). A name without a plain number at its end (or with a leading zero) keeps its own line."""
    numbered: dict[str, list[int]] = {}
    alone = []
    for name in names:
        match = re.fullmatch(r"(.*?[^0-9])(0|[1-9][0-9]*)", name)
        if match and not any(c in match.group(1) for c in "[],"):
            numbered.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            alone.append(name)
    out = []
    for prefix, numbers in numbered.items():
        ranges: list[list[int]] = []
        for n in sorted(set(numbers)):
            if ranges and n == ranges[-1][1] + 1:
                ranges[-1][1] = n
            else:
                ranges.append([n, n])
        out.append(prefix + "[" + ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges) + "]")
    return out + alone


class SlurmStartError(RuntimeError):
    pass


class LocalSlurmCluster:
    def __init__(self, nodes: Sequence[str] = ("gpu-a", "gpu-b", "gpu-c"), *, workdir: Path | None = None,
                 kill_wait_s: int = 5, with_rest: bool = False, cpus: int = 2,
                 silent_nodes: Sequence[str] = (), spare_nodes: Sequence[str] = (),
                 job_comp_script: Path | None = None) -> None:
        self.nodes = list(nodes)
        # slurmctld runs it at every job's end (JobCompType=jobcomp/script), as a site that posts job
        # ends to FleetMedic does (deploy/slurm/fleetmedic-jobcomp).
        self.job_comp_script = job_comp_script
        # Hosts that do not exist yet (a replacement a provider will bring): in the configuration
        # with a port of their own, their slurmd started by `boot` when the machine comes up.
        self.spare_nodes = list(spare_nodes)
        # Nodes in the configuration without a slurmd (a fleet's worth, for benchmarks): their state
        # and reason change as on any node, no job runs there, and slurmctld never marks them
        # "Not responding" (SlurmdTimeout=0 when there are any).
        self.silent_nodes = list(silent_nodes)
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="fleetmedic-slurm-"))
        self.kill_wait_s = kill_wait_s
        self.with_rest = with_rest
        self.cpus = cpus
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conf = self.dir / "slurm.conf"
        self._choose_ports()
        self.jwt_key = self.dir / "jwt.key"
        self.cluster_name = "fm" + secrets.token_hex(3)
        # Unix sockets (munge, slurmstepd) live under a short path: sun_path holds 108 bytes, and
        # slurmstepd's socket names are long (`<spool>/<node>_<job>.4294967291`).
        self.sockets = Path(tempfile.mkdtemp(prefix="fm-", dir="/tmp"))

    # -- paths and environment --

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster (scontrol, the activities) needs in its environment."""
        env = {"SLURM_CONF": str(self.conf)}
        if self.with_rest:
            env["FLEETMEDIC_SLURMRESTD_URL"] = self.rest_url
            env["SLURM_JWT"] = self.token()
        return env

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def _write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # slurmrestd runs as nobody and must read slurm.conf: mkdtemp's 0700 would hide it.
        self.dir.chmod(0o755)
        munge = self.sockets / "munge"
        for sub in ("state", "log", "checkpoints"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.sockets.chmod(0o755)
        munge.mkdir(exist_ok=True)
        munge.chmod(0o755)  # munged refuses a socket dir others cannot traverse
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        self.jwt_key.write_bytes(secrets.token_bytes(32))
        self.jwt_key.chmod(0o600)
        d = self.dir
        lines = [
            f"ClusterName={self.cluster_name}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={self.sockets}/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            # A node FleetMedic set DOWN stays DOWN until FleetMedic resumes it.
            "ReturnToService=1",
            "AuthType=auth/munge", "CredType=cred/munge",
            # A short credential lifetime lets a requeued job start again within seconds.
            f"AuthInfo=socket={munge}/munge.socket,cred_expire=5",
            "AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={self.jwt_key}",
            *(["JobCompType=jobcomp/script", f"JobCompLoc={self.job_comp_script}"] if self.job_comp_script
              else ["JobCompType=jobcomp/none"]),
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            f"KillWait={self.kill_wait_s}", "MinJobAge=600", "JobRequeue=1",
            "SlurmctldTimeout=10", f"SlurmdTimeout={0 if self.silent_nodes else 30}", "InactiveLimit=0",
            "Waittime=0",
        ]
        for name, port in self.node_ports.items():
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        for names in hostlists(self.silent_nodes):
            lines.append(f"NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "SLURM_CONF": str(self.conf), **(env or {})}, preexec_fn=die_with_parent(),
        )

    def run(self, *argv: str, check: bool = True, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env={**os.environ, "SLURM_CONF": str(self.conf)}, text=True,
                              capture_output=True, check=check, timeout=timeout)

    # -- lifecycle --

    def start(self, timeout_s: float = 20) -> LocalSlurmCluster:
        missing = missing_binaries(self.with_rest)
        if missing:
            raise SlurmStartError(f"Slurm is not installed here: missing {', '.join(missing)}")
        if self.with_rest:
            hidden = [p for p in self.dir.resolve().parents if not p.stat().st_mode & 0o001]
            if hidden:
                raise SlurmStartError(f"slurmrestd runs as nobody and cannot reach {self.dir}: {hidden[0]} "
                                      "is not world-traversable; leave workdir unset for a /tmp dir")
        # A port chosen free can still be taken before a daemon binds it (another server on the
        # machine picking the same number): then start again on new ports, 3 tries in all.
        for _ in range(2):
            try:
                return self._start_daemons(timeout_s)
            except SlurmStartError as exc:
                if "Address already in use" not in str(exc):
                    raise
                self._stop_daemons()
                self._choose_ports()
        return self._start_daemons(timeout_s)

    def _choose_ports(self) -> None:
        self.ctld_port = free_port()
        self.node_ports = {name: free_port() for name in [*self.nodes, *self.spare_nodes]}
        self.rest_port = free_port() if self.with_rest else None

    def _start_daemons(self, timeout_s: float) -> LocalSlurmCluster:
        self._write_config()
        munge = self.sockets / "munge"
        (munge / "munge.socket").unlink(missing_ok=True)  # a try before this one left it
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={munge}/munge.socket",
                               f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                               f"--seed-file={munge}/munged.seed", "--num-threads=4"])
        self._wait_for(lambda: (munge / "munge.socket").exists(), 5, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait_for(self._all_idle, timeout_s, "all nodes idle")
        if self.with_rest:
            # slurmrestd refuses to run as root; it drops to nobody and reads the JWT key as root
            # at start. Data parser v0.0.38 is the newest one 22.05 ships.
            self._spawn("slurmrestd", ["slurmrestd", "-u", "nobody", "-g", "nogroup", "-a", "rest_auth/jwt",
                                       "-s", "openapi/v0.0.38", f"127.0.0.1:{self.rest_port}"],
                        env={"SLURM_JWT": "daemon"})
            self._wait_for(self._rest_up, timeout_s, "slurmrestd")
        return self

    def boot(self, name: str) -> None:
        """A spare host comes up: its slurmd starts and registers with slurmctld."""
        if name not in self.spare_nodes:
            raise KeyError(f"{name} is not a spare node of this cluster")
        if f"slurmd-{name}" not in self.procs:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def stop_slurmd(self, name: str) -> None:
        """Stop node `name`'s slurmd (ours, by its PID): its pod or machine went away."""
        proc = self.procs.pop(f"slurmd-{name}", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.dir / "log" / f"{name}.out").read_text(errors="replace")[-2000:]
                raise SlurmStartError(f"{name} exited with {proc.returncode}:\n{log}")

    def _wait_for(self, predicate: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if predicate():  # type: ignore[operator]
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            time.sleep(0.1)
        raise SlurmStartError(f"timed out waiting for {what} in {self.dir}")

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=5).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return (bool(states) or not self.nodes) and all(states.get(n) == "idle" for n in self.nodes)

    def _rest_up(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.rest_port or 0)) == 0

    def token(self, lifespan_s: int = 86400) -> str:
        out = self.run("scontrol", "token", f"lifespan={lifespan_s}").stdout.strip()
        return out.split("=", 1)[1]

    def stop_controller(self) -> None:
        """Stop slurmctld (ours, by its PID), as a crash or an outage would: clients then time out."""
        proc = self.procs.get("slurmctld")
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(10)

    def stop(self) -> None:
        self._stop_daemons()
        shutil.rmtree(self.sockets, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_daemons(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        self._kill_job_processes()

    def _kill_job_processes(self) -> None:
        """slurmstepd and the job scripts it runs outlive slurmd (they are reparented to init).
        They carry this cluster's SLURM_CONF in their environment: that finds exactly ours."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)

    def __enter__(self) -> LocalSlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test helpers --

    def node_state(self, node: str, timeout: float = 15) -> tuple[str, str]:
        """Slurm's short state of `node` (e.g. `down`, `idle*` when not pinged since) and its reason."""
        out = self.run("sinfo", "-h", "-n", node, "-o", "%t|%E", timeout=timeout).stdout.strip()
        state, _, reason = out.partition("|")
        return state, reason

    def node_states(self, node: str, timeout: float = 15) -> set[str]:
        """Every state and flag of `node` as scontrol gives them (`DOWN+DRAIN` → {DOWN, DRAIN}):
        sinfo's short state shows one (`drain` for a node DOWN and DRAINed)."""
        out = self.run("scontrol", "show", "node", "-o", node, timeout=timeout).stdout
        state = next((f.partition("=")[2] for f in out.split() if f.startswith("State=")), "")
        return {s.rstrip("*") for s in state.split("+") if s}

    def submit(self, script: str, *args: str) -> int:
        path = self.dir / f"job-{secrets.token_hex(4)}.sh"
        path.write_text(script)
        path.chmod(0o755)
        out = self.run("sbatch", "--parsable", "--requeue", "-o", str(self.dir / "log" / "job-%j.out"),
                       *args, str(path)).stdout.strip()
        return int(out.split(";")[0])
