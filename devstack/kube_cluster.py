"""A real Kubernetes control plane on loopback: etcd, kube-apiserver (RBAC on), controller-manager,
scheduler, and kwok for fake GPU nodes and pod lifecycles. Started from the binaries that
`scripts/install-kube` builds and caches (~/.cache/fleetmedic/kube/<version>/), in a fresh temp
dir, on free ports; stopped by the PIDs it started and nothing else.

Identities: `admin` (system:masters) for the tests and the controllers, and one static token per
FleetMedic process named as the ServiceAccount deploy/kubernetes binds (worker, webhook, agent),
so the apiserver's RBAC authorizer judges FleetMedic exactly as in a cluster. Every request is in
the audit log (`audit_log`), which is how tests count what FleetMedic did from the outside.

kwok stages (`STAGES`): nodes become Ready and heartbeat; a node annotated `fleetmedic.test/not-ready`
goes NotReady and comes back Ready when the annotation goes; pods run and are Ready on their node;
a deleted pod goes away when its grace period (deletionTimestamp) has passed, as a kubelet does.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devstack.processes import die_with_parent
from devstack.slurm_cluster import free_port

KUBE_VERSION = os.environ.get("FLEETMEDIC_KUBE_VERSION", "v1.36.3")
NOT_READY_ANNOTATION = "fleetmedic.test/not-ready"
# The ServiceAccounts deploy/kubernetes/base binds its roles to.
IDENTITIES = {
    "worker": ("fleetmedic", "fleetmedic-worker"),
    "webhook": ("fleetmedic", "fleetmedic-webhook"),
    "agent": ("fleetmedic", "fleetmedic-agent"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FLEETMEDIC_KUBE_CACHE", Path.home() / ".cache/fleetmedic/kube")) / KUBE_VERSION


BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def missing_binaries() -> list[str]:
    """What `scripts/install-kube` has not built yet."""
    return [b for b in BINARIES if not (cache_dir() / b).is_file()]


BUILD_HINT = ("run scripts/install-kube (builds etcd, kube-apiserver, controller-manager, scheduler and kwok "
              "from Go modules)")

# Node and pod lifecycles of a fake cluster that behaves like a real one where FleetMedic cares.
STAGES = Path(__file__).with_name("kwok-stages.yaml")




@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


def spawn(workdir: Path, name: str, argv: list[str], *, user: str | None = None, cwd: Path | None = None) -> Process:
    """A server of the test world, its output in `workdir/<name>.log`, in a session of its own and
    ended with its parent; as `user` where given (a server that refuses to run as root)."""
    log = workdir / f"{name}.log"
    popen = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd or workdir,
                             start_new_session=True, preexec_fn=die_with_parent(), user=user)
    return Process(name, popen, log)


def stop_processes(processes: list[Process], grace_s: float) -> None:
    """Stop what we started, by PID, newest first: SIGTERM, then SIGKILL past `grace_s`."""
    for proc in reversed(processes):
        if proc.popen.poll() is None:
            proc.popen.terminate()
    for proc in reversed(processes):
        try:
            proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)
    processes.clear()


class LocalKubeCluster:
    """The control plane and kwok, once per test session (or per `fleetmedic dev`)."""

    def __init__(self, workdir: Path | None = None, *, node_lease_s: int = 40,
                 identities: dict[str, tuple[str, str]] | None = None, garbage_collector: bool = False) -> None:
        """`node_lease_s`: kwok's node lease, renewed every quarter of it. A benchmark of thousands
        of nodes on two cores lengthens it: 5,000 leases renewed every 10 s are 500 writes a second,
        which kept the API server busier than everything FleetMedic did. `identities`: more
        ServiceAccounts with a token (name: (namespace, account)), e.g. Kueue's manager.
        `garbage_collector`: run the owner-reference garbage collector (off by default, below);
        Kueue relies on it to delete a pod's Workload once the pod is gone."""
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fleetmedic-kube-"))
        self.node_lease_s = node_lease_s
        self.bin = cache_dir()
        self.processes: list[Process] = []
        self.identities = {**IDENTITIES, **(identities or {})}
        self.garbage_collector = garbage_collector
        self.tokens = {name: secrets.token_hex(16) for name in ("admin", *self.identities)}
        self.port = 0
        self.audit_log = self.workdir / "audit.log"

    # --- start / stop -----------------------------------------------------------------------------

    def start(self, timeout: float = 90) -> LocalKubeCluster:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)}: {BUILD_HINT}")
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd()
            self._start_apiserver()
            self._wait_ready(timeout)
            self._write_kubeconfigs()
            self._start_controllers()
            self.started_in_s = round(time.monotonic() - began, 1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_processes(self.processes, grace_s=10)

    def __enter__(self) -> LocalKubeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str]) -> Process:
        proc = spawn(self.workdir, name, argv)
        self.processes.append(proc)
        return proc

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            str(self.bin / "etcd"), "--name", "fleetmedic-test", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"fleetmedic-test=http://127.0.0.1:{peer}",
            # A throwaway store: no fsync (a test cluster outlives no crash).
            "--quota-backend-bytes", str(4 * 1024**3), "--unsafe-no-fsync", "--log-level", "warn"])

    def _start_apiserver(self) -> None:
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        key = certs / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(certs / "sa.pub")], check=True,
                       capture_output=True)
        rows = [f'{self.tokens["admin"]},admin,admin,"system:masters"']
        for identity, (namespace, account) in self.identities.items():
            groups = f"system:serviceaccounts,system:serviceaccounts:{namespace}"
            rows.append(f'{self.tokens[identity]},system:serviceaccount:{namespace}:{account},{identity},"{groups}"')
        (self.workdir / "tokens.csv").write_text("\n".join(rows) + "\n")
        (self.workdir / "audit-policy.yaml").write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            # ResponseStarted is kept: a watch is seen when it starts, not only when it ends.
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "None", "users": ["admin"]},  # the tests' and controllers' own traffic
                      {"level": "Request"}]}))
        self.port = free_port()
        self._spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"), "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            "--cert-dir", str(certs), "--token-auth-file", str(self.workdir / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            # As kubeadm and every managed control plane set it: the node agent runs privileged (NVML, reset).
            "--allow-privileged=true",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(certs / "sa.pub"),
            "--service-account-signing-key-file", str(key),
            "--service-cluster-ip-range", "10.96.0.0/16",
            # Pods in the tests carry no ServiceAccount tokens: nothing in them runs.
            "--disable-admission-plugins", "ServiceAccount",
            "--audit-log-path", str(self.audit_log), "--audit-policy-file", str(self.workdir / "audit-policy.yaml"),
            # blocking: a request's audit line is written before its answer, so a test reads what happened.
            "--audit-log-mode", "blocking",
            "--audit-log-format", "json", "--audit-log-maxsize", "0",
            "--v", "1"])

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        import ssl
        import urllib.error
        import urllib.request

        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): {_tail(proc.log)}")
            try:
                request = urllib.request.Request(f"{self.server}/readyz", headers={
                    "Authorization": f"Bearer {self.tokens['admin']}"})
                with urllib.request.urlopen(request, context=context, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"kube-apiserver not ready within {timeout:g}s ({last}): "
                           f"{_tail(self.workdir / 'kube-apiserver.log')}")

    def kubeconfig(self, identity: str = "admin") -> Path:
        return self.workdir / f"{identity}.kubeconfig"

    def _write_kubeconfigs(self) -> None:
        ca = self.workdir / "certs" / "apiserver.crt"
        for identity, token in self.tokens.items():
            config = {
                "apiVersion": "v1", "kind": "Config", "current-context": identity,
                "clusters": [{"name": "local", "cluster": {"server": self.server, "certificate-authority": str(ca)}}],
                "users": [{"name": identity, "user": {"token": token}}],
                "contexts": [{"name": identity, "context": {"cluster": "local", "user": identity}}],
            }
            self.kubeconfig(identity).write_text(yaml.safe_dump(config))

    def _start_controllers(self) -> None:
        admin = str(self.kubeconfig("admin"))
        self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), "--kubeconfig", admin, "--leader-elect=false",
            "--secure-port", "0", "--use-service-account-credentials=false",
            "--service-account-private-key-file", str(self.workdir / "certs" / "sa.key"),
            # Nodes whose kwok heartbeat stops are noticed in seconds, not the default 40 s (a longer
            # lease is renewed less often: its grace grows with it).
            "--node-monitor-period", "1s", "--node-monitor-grace-period", f"{max(20, self.node_lease_s // 2)}s",
            # No owner-reference garbage collector unless asked: test pods name owners (a DaemonSet, a
            # Job) that are not simulated, and it would delete them as orphans. PodGC (pods of deleted
            # nodes), disruption, deployment/replicaset, node lifecycle and taint eviction all run.
            "--controllers", ("*," if self.garbage_collector else "*,-garbage-collector-controller,")
                             + "-node-ipam-controller,-service-lb-controller,"
                             "-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller,"
                             "-ttl-after-finished-controller,-bootstrap-signer-controller,-token-cleaner-controller",
            "--v", "1"])
        self._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), "--kubeconfig", admin, "--leader-elect=false", "--secure-port", "0",
            "--v", "1"])
        self._spawn("kwok", [
            str(self.bin / "kwok"), "--kubeconfig", admin, "--manage-all-nodes=true", "--config", str(STAGES),
            "--node-lease-duration-seconds", str(self.node_lease_s), "--cidr", "10.0.0.0/16", "--node-ip", "10.1.0.1"])

    # --- what tests read ---------------------------------------------------------------------------

    def identity_user(self, identity: str) -> str:
        namespace, account = self.identities[identity]
        return f"system:serviceaccount:{namespace}:{account}"


REPO = Path(__file__).resolve().parents[1]
RBAC_KINDS = frozenset({"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})


def install_rbac_and_crds(cluster: LocalKubeCluster) -> None:
    """deploy/kubernetes/base's namespace, ServiceAccounts and roles (as kustomize renders them),
    and the CRDs scripts/install-kube fetched, applied as the admin; waits until the CRDs serve."""
    rendered = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/kubernetes/base")], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    apply_documents(cluster, [doc for doc in yaml.safe_load_all(rendered) if doc and doc.get("kind") in RBAC_KINDS])
    # ... and those written here for what cannot be fetched (Slinky's NodeSet: devstack/crds).
    apply_crds(cluster, sorted((cache_dir() / "crds").glob("*.yaml"))
               + sorted((REPO / "devstack" / "crds").glob("*.yaml")))


def apply_documents(cluster: LocalKubeCluster, documents: list[dict[str, Any]]) -> None:
    """Apply objects as the admin, server-side."""
    subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig("admin")), "apply", "--server-side", "-f", "-"],
                   input=yaml.safe_dump_all(documents), text=True, check=True, capture_output=True, timeout=60)


def apply_crds(cluster: LocalKubeCluster, crds: list[Path]) -> None:
    """Apply CRD files as the admin (server-side, so applying one again is a no-op) and wait until
    they serve."""
    if not crds:
        return
    kubectl = ["kubectl", "--kubeconfig", str(cluster.kubeconfig("admin"))]
    args = [a for crd in crds for a in ("-f", str(crd))]
    subprocess.run([*kubectl, "apply", "--server-side", *args], check=True, capture_output=True, timeout=120)
    subprocess.run([*kubectl, "wait", "--for", "condition=Established", "--timeout", "60s", *args], check=True,
                   capture_output=True, timeout=90)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
