"""The benchmarks' Alertmanager: JSON POSTs on one kept-alive HTTP/1.1 connection, written and read
with asyncio's streams.

Alertmanager is a Go program on a machine of its own. Here its stand-in shares the machine's 2 cores
with the webhook, the worker and Temporal, so whatever CPU it spends is taken from what is measured.
httpx spent about 2 ms of CPU a request (0.94 CPU-s for a burst of 500, more than the webhook
answering them): the benchmark measured its own client beside FleetMedic. This writes a request
as bytes and reads the answer by its Content-Length, and nothing more.

What it does not handle it refuses rather than guesses: an answer without Content-Length (uvicorn
gives one for every JSON answer) is an error. A connection that broke (the server closed a kept-alive
one as it was reused, a reset, no answer within the timeout) raises `Broken`, and the caller sends
the request again, as Alertmanager does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit


class Broken(Exception):
    """The connection broke before the whole answer came: the request may be sent again."""


class Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self.body = status, body

    def json(self) -> Any:
        return json.loads(self.body)


class Poster:
    """POSTs to one server, one at a time, on a connection opened at the first and kept alive."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout_s: float = 60) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.timeout_s = timeout_s
        fields = {"Host": f"{self.host}:{self.port}", **headers, "Content-Type": "application/json"}
        self.head = "".join(f"{name}: {value}\r\n" for name, value in fields.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: Mapping[str, object]) -> Response:
        data = json.dumps(body).encode()
        try:
            return await asyncio.wait_for(self._post(path, data), self.timeout_s)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            await self.aclose()
            raise Broken(type(exc).__name__) from exc

    async def _post(self, path: str, data: bytes) -> Response:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await self.writer.drain()
        status = int((await self.reader.readuntil(b"\r\n")).split()[1])
        length, close = None, False
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                close = value == "close"
        if length is None:
            raise ValueError(f"POST {path}: an answer ({status}) without Content-Length")
        body = await self.reader.readexactly(length)
        if close:
            await self.aclose()
        return Response(status, body)

    async def aclose(self) -> None:
        writer, self.reader, self.writer = self.writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass  # it was broken already

    async def __aenter__(self) -> Poster:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.aclose()
