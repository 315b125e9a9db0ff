"""Debian's Prometheus, started by a test on a loopback port in a temp dir, scraping what the test
names every second and evaluating the rule files it is given; stopped by its PID."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from devstack.slurm_cluster import free_port
from tests.conftest import require


class LocalPrometheus:
    def __init__(self, root: Path, targets: dict[str, str], rule_files: Sequence[Path] = ()) -> None:
        """`targets`: job name -> base URL whose `/metrics` (or the URL's own path) is scraped."""
        binary = shutil.which("prometheus")
        require(binary is not None, "Debian's prometheus")
        assert binary is not None
        root.mkdir(parents=True, exist_ok=True)
        jobs = []
        for job, url in targets.items():
            scheme, rest = url.split("://", 1)
            host, _, path = rest.partition("/")
            jobs.append({"job_name": job, "scheme": scheme, "metrics_path": f"/{path}" if path else "/metrics",
                         "static_configs": [{"targets": [host]}]})
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files], "scrape_configs": jobs}
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.log = root / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalPrometheus:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise AssertionError(f"Prometheus did not get ready: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params: str) -> Any:
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = answer.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query, as a dashboard panel asks it; the result vector."""
        data = self.api("query", query=expr)
        return list(data["result"]) if data["resultType"] == "vector" else []
