"""A small JSON-over-HTTP client for one SGLang server (aiohttp, one shared session).

The session is created lazily on the event loop that first uses it (an adapter is built in
one place and driven from a worker's loop) and re-created if a later call comes from another
loop. ``call`` raises ``SGLangError`` with the server's own message on a non-2xx answer.
``wait_healthy`` polls ``/health_generate`` (what slime and miles poll), retrying on
connection errors, until it answers 200 or the deadline passes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp


class SGLangError(RuntimeError):
    """An SGLang endpoint failed; the message names the endpoint and the server's reason."""


def error_message(data: Any, text: str) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if data.get("message"):
            return str(data["message"])
    return text.strip()[:500] or "no message"


class HttpClient:
    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._session is not None and not self._session.closed:
                await self._session.close()  # from a finished loop: only marks it closed
            # generation has no total deadline (long rollouts are legitimate); connecting does
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(self.timeout_s, 30.0))
            self._session = aiohttp.ClientSession(timeout=timeout, json_serialize=json.dumps)
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *,
                      timeout_s: float | None = None) -> tuple[int, Any, str]:
        """(status, parsed JSON or None, raw text); connection errors propagate."""
        session = await self._get_session()
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
        if body is not None:
            kwargs["json"] = body
        async with session.request(method, self.base_url + path, **kwargs) as resp:
            text = await resp.text()
            try:
                data = json.loads(text) if text.strip() else None
            except ValueError:
                data = None
            return resp.status, data, text

    async def call(self, path: str, body: Any = None, *, method: str = "POST",
                   timeout_s: float | None = None) -> Any:
        """JSON result of a control call; raises SGLangError naming the endpoint otherwise."""
        try:
            status, data, text = await self.request(method, path, body,
                                                    timeout_s=timeout_s or self.timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise SGLangError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if status // 100 != 2 or (isinstance(data, dict) and data.get("success") is False):
            raise SGLangError(f"{self.base_url}{path} answered {status}: {error_message(data, text)}")
        return data

    async def wait_healthy(self, timeout_s: float, alive: Callable[[], bool] | None = None,
                           describe_death: Callable[[], str] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                status, _, _ = await self.request("GET", "/health_generate", timeout_s=30.0)
                if status == 200:
                    return
                last = f"status {status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if alive is not None and not alive():
                tail = describe_death() if describe_death else ""
                raise SGLangError(f"the server at {self.base_url} exited before it was healthy\n{tail}")
            if time.monotonic() > deadline:
                raise SGLangError(f"{self.base_url} not healthy after {timeout_s:.0f} s ({last})")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            try:
                await self._session.close()
            except RuntimeError:  # its loop is gone; nothing left to close
                pass
        self._session = None
