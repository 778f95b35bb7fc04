"""The attention-pattern viewer: its HTML (parsed), and the page in a real headless Chromium
driven through the DevTools protocol (hover a query, read the side panel, take a screenshot)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import funhooks as fh

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
TOKENS = ["The", " cat", " sat", " on", "</script><b>x</b>", " &amp;"]


class _Page(HTMLParser):
    """The tags of a page, its scripts' text and its visible text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def _parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    page.close()
    return page


def _pattern(layers: int = 3, heads: int = 4, positions: int = len(TOKENS)) -> torch.Tensor:
    torch.manual_seed(0)
    scores = torch.randn(layers, heads, positions, positions)
    return scores.masked_fill(~torch.ones(positions, positions, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def test_the_page_holds_the_pattern_rounded_and_the_tokens_as_data_not_markup() -> None:
    pattern = _pattern()
    html = fh.transformer.pattern_viewer(pattern, tokens=TOKENS)._repr_html_()
    page = _parse(html)
    tags = [tag for tag, _ in page.tags]
    assert tags.count("script") == 2 and tags.count("b") == 1      # the token `</script><b>x</b>` did not break out
    assert not any("src" in attrs or "href" in attrs for _, attrs in page.tags)   # nothing loaded from a network
    data_script = next(i for i, (tag, attrs) in enumerate(t for t in page.tags if t[0] == "script")
                       if attrs.get("type") == "application/json")
    data = json.loads(page.scripts[data_script])
    assert data["keys"] == TOKENS and data["layers"] == ["0", "1", "2"] and data["heads"] == 4
    assert data["pattern"] == [[[[round(w, 4) for w in row] for row in head] for head in layer]
                               for layer in pattern.double().tolist()]
    assert {attrs.get("class") for tag, attrs in page.tags if tag == "select"} == {"fh-layer", "fh-head"}


def test_a_record_of_pattern_points_gives_its_layers_of_one_example() -> None:
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
    pts = fh.transformer.points(model)
    _, rec = fh.capture(model, fh.outputs(pts.pattern))(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    viewer = fh.transformer.pattern_viewer(rec, tokens=["a", "b", "c"], example=1)
    assert viewer.layers == ("0", "1")
    expected = torch.stack([rec[f"blocks.{i}.pattern"]["output"][1] for i in range(2)])
    assert torch.equal(viewer.pattern, expected.detach())


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"pattern_viewer: `source` is `\(layer, head, query, key\)`, got shape \(4, 3, 3\)"):
        fh.transformer.pattern_viewer(torch.rand(4, 3, 3))
    with pytest.raises(ValueError, match="pattern_viewer: `tokens` has one label per position"):
        fh.transformer.pattern_viewer(torch.rand(1, 1, 3, 3), tokens=["a"])
    with pytest.raises(fh.RecordError, match="holds no `blocks.L.pattern`"):
        fh.transformer.pattern_viewer(fh.Record())


def test_a_12_layer_12_head_32_token_viewer_builds_well_under_a_second() -> None:
    pattern = torch.rand(12, 12, 32, 32).softmax(-1)
    start = time.perf_counter()
    html = fh.transformer.pattern_viewer(pattern, tokens=[f"t{i}" for i in range(32)]).html()
    assert time.perf_counter() - start < 1.0
    assert len(html) < 3_000_000


# A headless Chromium driven through the DevTools protocol, over a websocket client written here
# (the stdlib's socket: no package needed).

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


def test_hovering_a_query_in_chromium_shows_its_keys_weights_and_tokens(browser: str, tmp_path: Path) -> None:
    """Draws docs/images/pattern-viewer.png (docs/logit-lens.md shows it)."""
    pattern = _pattern()
    layer, head, query = 2, 3, 4
    page = fh.transformer.pattern_viewer(pattern, tokens=TOKENS).save_html(tmp_path / "viewer.html")
    process, devtools = _open(browser, page, str(tmp_path / "profile"))
    try:
        # the page's own document loaded and its script run (a target can still show the initial
        # empty document, already "complete", while the file loads on a busy machine)
        ready = "document.readyState === 'complete' && document.querySelector('select.fh-head') !== null"
        deadline = time.monotonic() + 60
        while not devtools.evaluate(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert devtools.evaluate(ready), "the viewer's page did not load within 60 s"
        select = ("(function (cls, v) { const s = document.querySelector('select.' + cls); s.value = v;"
                  " s.dispatchEvent(new Event('change')); })")
        devtools.evaluate(f"{select}('fh-layer', '{layer}')")
        devtools.evaluate(f"{select}('fh-head', '{head}')")
        assert devtools.evaluate("document.querySelectorAll('table.fh-grid tr.fh-query').length") == len(TOKENS)
        devtools.evaluate(f"document.querySelector('tr.fh-query[data-query=\"{query}\"]')"
                          ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        title = devtools.evaluate("document.querySelector('div.fh-panel > div').textContent")
        rows = devtools.evaluate("Array.from(document.querySelectorAll('div.fh-panel table.fh-weights tr'))"
                                 ".map(r => Array.from(r.cells).map(c => c.textContent))")
        assert title == f"layer {layer}, head {head}, query {query} {json.dumps(TOKENS[query])}"
        weights = pattern[layer, head, query].double()
        expected = [[str(k), token, f"{w:.4f}"] for k, (token, w) in
                    enumerate(zip(TOKENS, weights.round(decimals=4).tolist()))]
        assert rows == expected
        assert all(abs(float(shown) - w) <= 5e-5 for (_, _, shown), w in zip(rows, weights.tolist()))
        assert devtools.evaluate("document.querySelectorAll('b').length") == 1   # the viewer's own title only
        box = devtools.evaluate("(function () { const r = document.querySelector('div.fh-pattern-viewer')"
                                ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
        clip = dict(zip(("x", "y", "width", "height"), (box[0] - 8, box[1] - 8, box[2] + 16, box[3] + 16)), scale=1)
        shot = base64.b64decode(devtools.call("Page.captureScreenshot", format="png", clip=clip)["data"])
        assert shot[:4] == b"\x89PNG"
        IMAGES.mkdir(exist_ok=True)
        (IMAGES / "pattern-viewer.png").write_bytes(shot)
    finally:
        devtools.sock.close()
        process.kill()
        process.communicate()
