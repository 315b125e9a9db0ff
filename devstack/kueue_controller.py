"""Kueue's own controller-manager in a local control plane: built from sigs.k8s.io/kueue (the version
whose CRDs scripts/install-kube installs), run under its own ServiceAccount identity with Kueue's
ClusterRole (RBAC enforced), its admission webhooks called by the apiserver on loopback.

Kueue is deployed as a Deployment behind a Service in a real cluster, and its webhooks name that
Service. Here nothing routes a ClusterIP, so the webhook configurations Kueue ships
(config/components/webhook/manifests.yaml) are applied with a URL client config
(https://127.0.0.1:<port>/<path>, the same paths) and the CA bundle of a serving certificate made
for 127.0.0.1; Kueue's internal certificate management, which writes a Secret and patches the
Service's webhooks, is off (`internalCertManagement.enable: false`, certDir given), as Kueue's docs
describe for cert-manager or any external CA.

Only the integrations FleetMedic's traffic runbooks meet are on: batch/job (training), pod and
deployment (serving). Kueue manages pods only in namespaces labelled `MANAGED_LABEL` (its
`managedJobsNamespaceSelector`, and the namespace selector of the pod and Deployment webhooks, as
Kueue's own kustomization narrows them to leave kube-system alone).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from devstack.kube_cluster import (
    LocalKubeCluster,
    Process,
    _tail,
    apply_crds,
    apply_documents,
    cache_dir,
    install_rbac_and_crds,
)
from devstack.slurm_cluster import free_port

NAMESPACE = "kueue-system"
ACCOUNT = "kueue-controller-manager"
IDENTITY = {"kueue": (NAMESPACE, ACCOUNT)}
MANAGED_LABEL = "kueue.fleetmedic.test/managed"
FRAMEWORKS = ("batch/job", "pod", "deployment")
# The webhook paths of what is on: Kueue's own kinds and those of the integrations above.
WEBHOOK_PATHS = ("-kueue-x-k8s-io-", "-batch-v1-job", "--v1-pod", "-apps-v1-deployment")
POD_BASED = ("--v1-pod", "-apps-v1-deployment")
# With internalCertManagement off, Kueue 0.17's main.go reads a metrics serving certificate from this
# fixed path (whatever metrics.bindAddress says) and exits without one. Metrics are off here, so any
# valid pair will do: ours is copied there when the path has none.
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
BUILD_HINT = "run scripts/install-kube (builds Kueue's manager from sigs.k8s.io/kueue, about 3 minutes cold)"


def binary() -> Path:
    return cache_dir() / "kueue"


def manifests() -> Path:
    """Kueue's own RBAC and webhook manifests, copied from its module by scripts/install-kube."""
    return cache_dir() / "kueue-manifests"


def missing() -> list[str]:
    return [str(p) for p in (binary(), manifests() / ".complete") if not p.exists()]


@contextmanager
def kueue_control_plane(workdir: Path) -> Iterator[LocalKubeCluster]:
    """A control plane of its own with FleetMedic's roles and CRDs and Kueue's manager running, its
    garbage collector on (Kueue relies on it: a pod's Workload goes with the pod); stopped on the way
    out."""
    with LocalKubeCluster(workdir, identities=IDENTITY, garbage_collector=True) as cluster:
        install_rbac_and_crds(cluster)
        start_kueue(cluster)
        yield cluster


def start_kueue(cluster: LocalKubeCluster, timeout: float = 90) -> Process:
    """Kueue's manager beside `cluster`'s controllers (stopped with them, by PID); returns once its
    webhooks answer the apiserver and it reconciles."""
    if missing():
        raise RuntimeError(f"missing {', '.join(missing())}: {BUILD_HINT}")
    workdir = cluster.workdir / "kueue"
    certs = workdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca = _serving_certificate(certs)
    _metrics_certificate(certs)
    port, health = free_port(), free_port()
    # All of Kueue's CRDs (its manager indexes every kind at start, MultiKueue's too), then its
    # namespace, RBAC and webhooks.
    apply_crds(cluster, sorted((manifests() / "crds").glob("*.yaml")))
    apply_documents(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                     *_rbac(), *_webhooks(port, ca)])
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "true"}},
        "integrations": {"frameworks": list(FRAMEWORKS)},
        # The on-demand visibility API is an aggregated apiserver of its own: off (feature gate below).
        "visibilityServer": {"bindPort": free_port()},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    process = cluster._spawn("kueue", [
        str(binary()), "--config", str(workdir / "config.yaml"), "--kubeconfig", str(cluster.kubeconfig("kueue")),
        "--feature-gates", "VisibilityOnDemand=false"])
    _wait_serving(cluster, process, timeout)
    return process


def _serving_certificate(certs: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 signed by it (tls.crt/tls.key, where Kueue looks)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=certs, timeout=30)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=kueue-webhook-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", "/CN=127.0.0.1")
    (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "2", "-extfile", "san.ext")
    return (certs / "ca.crt").read_bytes()


def _metrics_certificate(certs: Path) -> None:
    if (METRICS_CERTS / "tls.crt").exists() and (METRICS_CERTS / "tls.key").exists():
        return
    try:
        METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(certs / name, METRICS_CERTS / name)
    except OSError as exc:
        raise RuntimeError(f"Kueue needs a certificate in {METRICS_CERTS} (it reads one there when its internal "
                           f"certificate management is off): {exc}; create it once as root") from exc


def _rbac() -> list[dict[str, Any]]:
    """Kueue's manager roles (config/components/rbac: its ClusterRole, and a Role for Secrets in its
    namespace) bound to its ServiceAccount, named and placed as its kustomization does (namespace
    kueue-system, names prefixed kueue-)."""
    documents: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}}]
    for path in sorted(manifests().glob("rbac-*.yaml")):
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        if "namespace" in doc["metadata"]:
            doc["metadata"]["namespace"] = NAMESPACE
        if "roleRef" in doc:
            doc["roleRef"]["name"] = "kueue-" + doc["roleRef"]["name"]
            doc["subjects"] = [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]
        documents.append(doc)
    return documents


def _webhooks(port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, each webhook called at its path on loopback."""
    bundle = base64.b64encode(ca).decode()
    documents = []
    for doc in yaml.safe_load_all((manifests() / "webhooks.yaml").read_text()):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if not any(part in path for part in WEBHOOK_PATHS):
                continue
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            if any(path.endswith(part) for part in POD_BASED):
                hook["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "true"}}
            kept.append(hook)
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        doc["webhooks"] = kept
        documents.append(doc)
    return documents


def _wait_serving(cluster: LocalKubeCluster, process: Process, timeout: float) -> None:
    """Until the apiserver's call of Kueue's ResourceFlavor webhook succeeds (a server-side dry run)."""
    probe = yaml.safe_dump({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                            "metadata": {"name": "fleetmedic-probe"}})
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"kueue exited ({process.popen.returncode}): {_tail(process.log)}")
        done = subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig("admin")), "create",
                               "--dry-run=server", "-f", "-"], input=probe, text=True, capture_output=True,
                              timeout=30)
        if done.returncode == 0:
            return
        last = done.stderr.strip()
        time.sleep(0.5)
    raise RuntimeError(f"Kueue's webhooks not served within {timeout:g} s ({last}): {_tail(process.log)}")
