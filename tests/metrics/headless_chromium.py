"""A real headless Chromium (Debian's `chromium` package) driven over the Chrome DevTools protocol.

    HeadlessChromium() -> chromium --headless --remote-debugging-port=0 (a fresh profile)
        .open(path)       -> Page.navigate to file://path, waits for the load event
        .evaluate(js)     -> the expression's value (JSON), after the page's own scripts ran
        .screenshot(path) -> a PNG of the viewport
        .console_errors   -> every console error, uncaught exception and log error so far

Nothing is downloaded: the browser is the system's, the protocol client is `websockets` (in the
test extra's environment through openai-agents and textarena). `scripts/setup_env.sh` installs
the browser where it can (root and apt-get); `require_chromium()` skips a test without it, except
under CI (CI=true), where the test must run and fails instead.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    for name in CHROMIUM_NAMES:
        if (found := shutil.which(name)) is not None:
            return found
    return None


def require_chromium() -> str:
    """The browser's path; without one, a skip naming the fix (a failure under CI=true)."""
    found = chromium_path()
    if found is not None:
        return found
    why = ("no headless Chromium on PATH (tried " + ", ".join(CHROMIUM_NAMES) + "): "
           "`bash scripts/setup_env.sh` installs Debian's chromium as root, or run "
           "`apt-get install -y --no-install-recommends chromium`")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why + " (CI=true: this test must run)")
    pytest.skip(why)


class HeadlessChromium:
    """One browser process with one page, closed by ``close()`` (or the ``with`` block)."""

    def __init__(self, width: int = 1400, height: int = 900) -> None:
        from websockets.sync.client import connect

        self._root = pathlib.Path(tempfile.mkdtemp(prefix="torchtitan_rl_chromium_"))
        self._profile = self._root / "profile"
        self._stderr = (self._root / "stderr.log").open("wb")  # a file: a pipe could fill up
        self._process = subprocess.Popen(
            [require_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self._stderr)
        try:
            port = self._wait_for_port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                targets = json.load(reply)
            page = next(t for t in targets if t["type"] == "page")
            self._socket = connect(page["webSocketDebuggerUrl"], max_size=64 << 20,
                                   open_timeout=10)
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []
        self.console_errors: list[str] = []
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self._call(method)
        self._call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                   deviceScaleFactor=1, mobile=False)

    def _wait_for_port(self) -> int:
        """The port Chromium chose, from the DevToolsActivePort file it writes in its profile."""
        active = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"chromium exited {self._process.returncode}: "
                                   f"{self.stderr_text()[-2000:]}")
            if active.exists() and (lines := active.read_text().splitlines()):
                return int(lines[0])
            time.sleep(0.05)  # polling the browser's start-up file, not synchronising a test
        raise RuntimeError(f"chromium wrote no DevToolsActivePort in {START_TIMEOUT_S} s")

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one protocol command; its result (events that arrive meanwhile are kept)."""
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=CALL_TIMEOUT_S))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._on_event(message)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(" ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console_errors.append(details.get("exception", {}).get(
                "description", details.get("text", "exception")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.console_errors.append(params["entry"].get("text", ""))
        self._events.append(message)

    def open(self, path: pathlib.Path, fragment: str = "") -> None:
        """Load ``path`` (file://) and wait for its load event (its scripts have run). Through
        about:blank: the same page with another fragment would otherwise not load again."""
        url = pathlib.Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")
        for address in ("about:blank", url):
            self._events.clear()
            self._call("Page.navigate", url=address)
            while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
                self._on_event(json.loads(self._socket.recv(timeout=CALL_TIMEOUT_S)))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (an exception fails the call)."""
        result = self._call("Runtime.evaluate", expression=expression, returnByValue=True,
                            awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: pathlib.Path, *, full_height: int | None = None) -> None:
        """A PNG of the viewport (``full_height``: of that many CSS pixels from the top)."""
        params: dict[str, Any] = {"format": "png"}
        if full_height is not None:
            width = self.evaluate("document.documentElement.clientWidth")
            params.update(clip={"x": 0, "y": 0, "width": width, "height": full_height,
                                "scale": 1}, captureBeyondViewport=True)
        data = self._call("Page.captureScreenshot", **params)["data"]
        pathlib.Path(path).write_bytes(base64.b64decode(data))

    def stderr_text(self) -> str:
        return (self._root / "stderr.log").read_text(errors="replace")

    def close(self) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            socket.close()
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._stderr.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> HeadlessChromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
