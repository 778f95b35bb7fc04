"""A headless Chromium driven through the DevTools protocol, for the tests of what a page shows.

``browser`` (a fixture: import it into the test module) is the path of Chromium, or skips the
test saying how to install it; ``opened(browser, page, tmp_path, ready)`` shows a saved page
and yields a DevTools connection once the JavaScript expression `ready` is true;
``screenshot(devtools, selector, path)`` writes a PNG of the element `selector` (and 8 pixels
around it). The websocket client is written here with the stdlib's socket: no package needed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

def _browser() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class _Socket:
    """The few lines of a websocket client the DevTools protocol needs (text frames, masked)."""

    def __init__(self, url: str) -> None:
        match = re.fullmatch(r"ws://([^:/]+):(\d+)(/.*)", url)
        assert match, url
        host, port, path = match.group(1), int(match.group(2)), match.group(3)
        self.sock = socket.create_connection((host, port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        assert b" 101 " in head.split(b"\r\n")[0] and accept in head, head
        self.next_id = 0

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "the browser closed the DevTools connection"
            out += chunk
        return out

    def _send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                  if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _receive(self) -> str:
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            n = struct.unpack(">H", self._read(2))[0] if n == 126 else struct.unpack(">Q", self._read(8))[0] if n == 127 else n
            payload = self._read(n)
            if first & 0x0F in (0x1, 0x0):
                message += payload
                if first & 0x80:
                    return message.decode()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._receive())
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")


def _open(browser: str, page: Path, profile: str) -> tuple[subprocess.Popen[bytes], _Socket]:
    """Chromium showing `page`, and a DevTools connection to its page target."""
    process = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
                                f"--user-data-dir={profile}", "--window-size=900,700", "--hide-scrollbars",
                                page.as_uri()], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return process, _connect(process)
    except BaseException:
        process.kill()
        process.communicate()
        raise


def _connect(process: subprocess.Popen[bytes]) -> _Socket:
    """A DevTools connection to the page target of `process`, once it says where DevTools listens."""
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    port = None
    while port is None and time.monotonic() < deadline:
        line = process.stderr.readline().decode(errors="replace")
        if not line and process.poll() is not None:
            raise AssertionError(f"chromium exited with {process.returncode} before DevTools listened")
        if match := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
            port = int(match.group(1))
    assert port is not None, "chromium did not say where DevTools listens"
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            targets = [t for t in json.load(response) if t.get("type") == "page" and t["url"].startswith("file:")]
        if targets:
            return _Socket(targets[0]["webSocketDebuggerUrl"])
        time.sleep(0.1)
    raise AssertionError("chromium opened no page")


@pytest.fixture
def browser() -> str:
    found = _browser()
    if found is None:
        pytest.skip("no Chromium found (chromium, chromium-browser or google-chrome on PATH): "
                    "install Debian's `chromium` to run the browser tests")
    return found




@contextlib.contextmanager
def opened(browser: str, page: Path, tmp_path: Path, ready: str, *, timeout: float = 60.0) -> Iterator[_Socket]:
    """Chromium showing the saved `page`, and a DevTools connection to it once the JavaScript
    expression `ready` is true (a target can still show the initial empty document, already
    "complete", while the file loads on a busy machine). The browser is killed on the way out."""
    process, devtools = _open(browser, page, str(tmp_path / "profile"))
    try:
        deadline = time.monotonic() + timeout
        while not devtools.evaluate(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert devtools.evaluate(ready), f"{page.name} did not load within {timeout:.0f} s ({ready})"
        yield devtools
    finally:
        devtools.sock.close()
        process.kill()
        process.communicate()


def screenshot(devtools: _Socket, selector: str, path: Path) -> bytes:
    """A PNG of the element `selector` and 8 pixels around it, written to `path` (its folder made)."""
    box = devtools.evaluate(f"(function () {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
    clip = dict(zip(("x", "y", "width", "height"), (box[0] - 8, box[1] - 8, box[2] + 16, box[3] + 16)), scale=1)
    shot = base64.b64decode(devtools.call("Page.captureScreenshot", format="png", clip=clip)["data"])
    assert shot[:4] == b"\x89PNG"
    keep(path, shot)
    return shot


def keep(path: Path, png: bytes) -> None:
    """Write the screenshot `png` to `path` (its folder made) unless the picture there already
    shows the same (fewer than 1 in 1,000 pixels differ: a font's anti-aliasing may change a
    few from one run to the next), so a test run leaves the docs' images as they are."""
    if path.exists():
        import io

        import numpy as np
        from matplotlib import image

        old, new = (image.imread(io.BytesIO(data), format="png") for data in (path.read_bytes(), png))
        if old.shape == new.shape and np.mean(np.any(old != new, axis=-1)) < 1e-3:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
