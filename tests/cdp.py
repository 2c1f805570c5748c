"""A real headless Chromium driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands on fd 3, answers and events on fd 4, each a JSON
message ended by a NUL byte), so that a test can run JavaScript in a live page, wait for
what the page does and take screenshots at a set window size — with no dependency beyond
Chromium itself."""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.helpers import CHROMIUM_LEAN, chromium

__all__ = ["Browser", "CdpError"]


class CdpError(Exception):
    """The browser answered a command with an error, or a script in the page threw."""


def _as_3_and_4(read: int, write: int) -> None:
    """(In the child) ``read`` as fd 3 and ``write`` as fd 4, whatever numbers they had."""
    os.dup2(read, 1001)
    os.dup2(write, 1002)
    os.dup2(1001, 3)
    os.dup2(1002, 4)


class Browser:
    """One headless Chromium with one page of ``width`` × ``height`` CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 800, args: Sequence[str] = ()) -> None:
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="fenced-cdp-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The child sees our read end as fd 3 and our write end as fd 4.
        self._proc = subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                *CHROMIUM_LEAN,
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={width},{height}",
                *args,
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=lambda: _as_3_and_4(to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._buffer = b""
        self.events: list[dict[str, Any]] = []
        targets = self._call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self._call(
            "Target.attachToTarget", targetId=page["targetId"], flatten=True
        )["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Log.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # -- the protocol ---------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise CdpError("Chromium closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def _call(
        self, method: str, session: str | None = None, timeout: float = 60, **params: Any
    ) -> Any:
        self._next_id += 1
        mine = self._next_id
        message: dict[str, Any] = {"id": mine, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self._send(message)
        deadline = time.monotonic() + timeout
        while True:
            answer = self._receive(deadline)
            if answer.get("id") == mine:
                if "error" in answer:
                    raise CdpError(f"{method}: {answer['error'].get('message')}")
                return answer.get("result", {})
            if "method" in answer:
                self.events.append(answer)

    def call(self, method: str, timeout: float = 60, **params: Any) -> Any:
        """A command to the page's session; its result."""
        return self._call(method, self._session, timeout, **params)

    # -- what tests use -------------------------------------------------------------------------

    def go(
        self,
        url: str,
        ready: str = "document.body && document.body.dataset.loaded === 'yes'",
        timeout: float = 30,
    ) -> None:
        """Open ``url`` and wait (bounded) until the expression ``ready`` holds in the page."""
        self.call("Page.navigate", url=url)
        self.wait_for(ready, timeout)

    def js(self, expression: str, timeout: float = 60) -> Any:
        """The value of ``expression`` in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            timeout=timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CdpError(f"in the page: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Wait in the page until ``expression`` is truthy (checked on each animation frame,
        bounded by ``timeout`` seconds); its value. TimeoutError if it never holds."""
        ms = int(timeout * 1000)
        script = f"""new Promise((ok, fail) => {{
            const end = performance.now() + {ms};
            const look = () => {{
                let v; try {{ v = ({expression}); }} catch (e) {{ v = undefined; }}
                if (v) ok(v);
                else if (performance.now() > end) fail(new Error("timed out: " + {json.dumps(expression)}));
                else setTimeout(look, 20);
            }};
            look();
        }})"""
        try:
            return self.js(script, timeout=timeout + 30)
        except CdpError as exc:
            if "timed out:" in str(exc):
                raise TimeoutError(str(exc)) from None
            raise

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def console_errors(self) -> list[str]:
        """Console errors and failed loads the page reported so far (a 404 favicon is one)."""
        # (events arrive with the answers to commands: one round trip collects those pending)
        self.js("0")
        out = []
        for e in self.events:
            if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error":
                entry = e["params"]["entry"]
                out.append(f"{entry.get('url', '')}: {entry['text']}")
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(e["params"]["exceptionDetails"].get("text", "exception"))
            if e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error":
                out.append(" ".join(str(a.get("value")) for a in e["params"]["args"]))
        return out

    def close(self) -> None:
        try:
            self._send({"id": 0, "method": "Browser.close"})
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
