"""A real headless Chromium, driven over the DevTools protocol, for the page tests.

Debian's ``chromium`` (installed by the repository's setup, never downloaded by a test) is
started with a throw-away profile and ``--remote-debugging-port=0``; the port it picked is read
from ``DevToolsActivePort`` in the profile. The protocol is JSON over one WebSocket, spoken
with ``websockets`` (already a dependency), so no browser-automation package is needed.

Typing and clicking go through ``Input.*`` events, as a user's keyboard and mouse would, not
through scripts that set values: what the test does, a person could do.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

from tests.harness.waits import wait_until

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]


class BrowserError(AssertionError):
    pass


class Browser:
    """One Chromium with one page."""

    def __init__(self, profile: Path, *, width: int = 1366, height: int = 900) -> None:
        if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        profile.mkdir(parents=True, exist_ok=True)
        self.log = (profile / "chromium.log").open("wb")
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        active = profile / "DevToolsActivePort"
        wait_until(lambda: active.exists() and active.read_text().count("\n") >= 1, what="DevTools")
        port, path = active.read_text().split("\n")[:2]
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=64 * 1024 * 1024, open_timeout=60)
        )
        self._ids = itertools.count(1)
        self.console_errors: list[str] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self.page("Page.enable")
        self.page("Runtime.enable")
        self.viewport(width, height)

    # --- the protocol ----------------------------------------------------------------------

    def call(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None
    ) -> dict[str, Any]:
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + 60
        while True:
            raw = self.ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            reply = json.loads(raw)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self._event(reply)

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("method") == "Runtime.exceptionThrown":
            details = event["params"]["exceptionDetails"]
            self.console_errors.append(str(details.get("exception", {}).get("description")))
        elif event.get("method") == "Runtime.consoleAPICalled":
            if event["params"].get("type") == "error":
                args = event["params"].get("args", [])
                self.console_errors.append(" ".join(str(a.get("value")) for a in args))

    def page(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.call(method, params, session=self.session)

    # --- what a user does ----------------------------------------------------------------

    def viewport(self, width: int, height: int, *, mobile: bool = False) -> None:
        self.page(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile},
        )

    def eval(self, expression: str) -> Any:
        result = self.page(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        before = self.eval("performance.timeOrigin")
        self.page("Page.navigate", {"url": url})
        self._wait_new_page(before)

    def _wait_new_page(self, before: float, timeout: float = 60) -> None:
        # The old document answers "complete" until the new one replaces it, so wait for a
        # document with a different time origin that has finished loading.
        wait_until(
            lambda: (
                self.eval("performance.timeOrigin") != before
                and self.eval("document.readyState") == "complete"
            ),
            timeout,
            "the next page",
        )

    def wait_loaded(self, timeout: float = 60) -> None:
        wait_until(lambda: self.eval("document.readyState") == "complete", timeout, "page load")

    @property
    def url(self) -> str:
        return str(self.eval("location.href"))

    def text(self, selector: str = "body") -> str:
        value = self.eval(
            f"(e => e ? e.innerText : null)(document.querySelector({json.dumps(selector)}))"
        )
        if value is None:
            raise BrowserError(f"no element matches {selector}")
        return str(value)

    def exists(self, selector: str) -> bool:
        return bool(self.eval(f"document.querySelector({json.dumps(selector)}) !== null"))

    def wait_text(self, selector: str, needle: str, timeout: float = 60) -> str:
        return str(
            wait_until(
                lambda: (t := self.eval(
                    f"(e => e ? e.innerText : '')(document.querySelector({json.dumps(selector)}))"
                )) and needle in t and t,
                timeout,
                f"{needle!r} in {selector}",
            )
        )  # fmt: skip

    def _center(self, selector: str) -> tuple[float, float]:
        box = self.eval(
            f"""(() => {{
                const e = document.querySelector({json.dumps(selector)});
                if (!e) return null;
                e.scrollIntoView({{block: "center"}});
                const r = e.getBoundingClientRect();
                return [r.left + r.width / 2, r.top + r.height / 2];
            }})()"""
        )
        if not box:
            raise BrowserError(f"no element matches {selector}")
        return float(box[0]), float(box[1])

    def click(self, selector: str) -> None:
        x, y = self._center(selector)
        for kind in ("mousePressed", "mouseReleased"):
            self.page(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
            )

    def type(self, selector: str, text: str) -> None:
        self.click(selector)
        self.page("Input.insertText", {"text": text})

    def press(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.page(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": code},
            )

    def submit(self, button: str) -> None:
        """Click a submit button and wait for the page it leads to."""
        before = self.eval("performance.timeOrigin")
        self.click(button)
        self._wait_new_page(before)

    def screenshot(self, path: Path, *, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            width, height = self.eval(
                "[document.documentElement.clientWidth, document.documentElement.scrollHeight]"
            )
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        data = self.page("Page.captureScreenshot", params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already gone is fine
            self.call("Browser.close")
        try:
            self._stack.close()
        finally:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.log.close()
