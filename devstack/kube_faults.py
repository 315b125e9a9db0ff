"""A fault-injecting HTTP proxy in front of the real kube-apiserver (tests only).

The control plane is real; what it cannot do on demand is fail. FleetMedic's processes reach the
apiserver through this proxy, which forwards every request unchanged (streaming watches too)
except those a test asked to fail: answered with a Kubernetes `Status` of the given code, or held
for `delay_s` (status 0: held, then forwarded), as an overloaded or partitioned API would.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from devstack.slurm_cluster import free_port

REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 422: "Invalid",
           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


@dataclass
class Fault:
    method: str | None
    plural: str | None
    name: str | None = None
    subresource: str | None = None
    status: int = 500
    times: int = 1
    delay_s: float = 0.0

    def matches(self, method: str, plural: str | None, name: str | None, subresource: str | None) -> bool:
        # name None: any request of the kind; name "": only requests on the collection (list, watch).
        return ((self.method is None or self.method == method) and (self.plural is None or self.plural == plural)
                and (self.name is None or self.name == (name or ""))
                and (self.subresource is None or self.subresource == subresource) and self.times > 0)


def parse_path(path: str) -> tuple[str | None, str | None, str | None]:
    """(plural, name, subresource) of an API path."""
    parts = [p for p in urlsplit(path).path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        return None, None, None
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    return plural, name, sub


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        self.connections = 0  # accepted from clients: a client that keeps its connections alive opens few
        self.context = ssl.create_default_context()
        # Loopback to our own apiserver: its self-signed certificate is for the tests' clients.
        self.context.check_hostname, self.context.verify_mode = False, ssl.CERT_NONE
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:  # once per client connection
                super().setup()
                with proxy.lock:
                    proxy.connections += 1

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy.take_fault(self.command, self.path)
                if fault is not None:
                    if fault.delay_s:
                        time.sleep(fault.delay_s)
                    if fault.status:
                        payload = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "message": f"injected {fault.status}", "code": fault.status,
                                              "reason": REASONS.get(fault.status, "InternalError")}).encode()
                        self.send_response(fault.status)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                upstream = http.client.HTTPSConnection("127.0.0.1", proxy.upstream_port, context=proxy.context,
                                                       timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                streaming = "watch=true" in self.path or "watch=1" in self.path
                if not streaming:
                    data = response.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    upstream.close()
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")  # a watch ends its connection with it
                self.end_headers()
                try:
                    while chunk := response.read1(65536):
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    upstream.close()
                self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="kube-fault-proxy")

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def inject(self, method: str | None, plural: str | None, *, name: str | None = None,
               subresource: str | None = None, status: int = 500, times: int = 1, delay_s: float = 0.0) -> Fault:
        fault = Fault(method.upper() if method else None, plural, name, subresource, status, times, delay_s)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def take_fault(self, method: str, path: str) -> Fault | None:
        plural, name, sub = parse_path(path)
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, plural, name, sub):
                    fault.times -= 1
                    return fault
        return None
