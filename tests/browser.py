"""Debian's Chromium, headless, driven over the DevTools protocol: open a page, read its text, save a PNG."""
from __future__ import annotations

import asyncio
import base64
import html
import itertools
import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

TEXT_OF_PAGE = """[document.body ? document.body.innerText : ''].concat(
  Array.from(document.querySelectorAll('iframe')).map(f => {
    try { return f.contentDocument.body.innerText } catch (e) { return f.srcdoc || '' }
  })).join('\\n')"""

PLAIN_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


class Page:
    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        await self.socket.send_json({"id": ident, "method": method, "params": params})
        async for message in self.socket:
            data = message.json()
            if data.get("id") == ident:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return dict(data.get("result", {}))
        raise RuntimeError("Chromium closed the DevTools connection")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def text(self) -> str:
        """What a person reads: the page's text and its frames' (the UI renders Markdown in sandboxed
        iframes, whose HTML is only readable from their `srcdoc`)."""
        result = await self.send("Runtime.evaluate", expression=TEXT_OF_PAGE, returnByValue=True)
        raw = str(result.get("result", {}).get("value", ""))
        text = html.unescape(re.sub(r"<[^>]+>", " ", raw))
        return text.translate(PLAIN_QUOTES)  # the Markdown renderer's typographic quotes, as typed

    async def wait_for_text(self, *needles: str, timeout: float = 60) -> str:
        """The page's text once it shows every needle (whitespace as a person reads it: collapsed)."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = " ".join((await self.text()).split())
            if all(" ".join(n.split()) in text for n in needles):
                return text
            await asyncio.sleep(0.5)
        missing = [n for n in needles if " ".join(n.split()) not in text]
        raise AssertionError(f"the page never showed {missing}; it shows:\n{text}")

    async def screenshot(self, path: Path) -> None:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(result["data"]))


@asynccontextmanager
async def headless_chromium(binary: str, profile: Path, width: int = 1600, height: int = 1200) -> AsyncIterator[Page]:
    profile.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                f"--window-size={width},{height}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Chromium did not open its DevTools port (rc {process.poll()})")
            await asyncio.sleep(0.1)
        port = port_file.read_text().split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as answer:
                targets = await answer.json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as socket:
                yield Page(socket)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
