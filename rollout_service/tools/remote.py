"""Tools called over HTTP on a tool server (bin/tool-server), behind the same ``Tool`` protocol.

Design: one ``RemoteToolClient`` per tool server and process holds an ``httpx.AsyncClient`` (anyio
based, so it runs under asyncio and trio) and a capacity limiter bounding the requests in flight;
every ``RemoteTool`` of that server shares it. Like a local tool, a remote call never raises for
the network: transient failures (connection errors, timeouts, HTTP 429/502/503/504) are retried
with exponential backoff and jitter, and what is still failing afterwards, or fails for good (an
unknown tool, a refused request), comes back as ``ToolResult(ok=False)`` naming the server and the
problem, for the model (and the failure metrics) to see. Retrying a timed-out call may run it
twice on the server; tool calls are treated as idempotent, like the model retrying by hand.
``fetch_schemas`` is the synchronous start-up counterpart: it learns what a server offers and fails
loudly, naming the config key, when it cannot be reached. With ``tool_server.token`` configured,
both sign every request and accept only answers the server signed (`rollout_service.tools.auth`:
no secret on the wire, and a listener without the token at the server's address gets nothing
in); a refusal (401) or an unsigned answer is never retried and names that key.
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any
from urllib.parse import quote

import anyio
import httpx

from rollout_service.tools.auth import response_is_genuine, sign_request
from rollout_service.tools.base import ToolContext, ToolResult, invalid_args

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_S = 30.0  # a server's Retry-After is honoured up to this long
_URL_KEY = "tools.remote.url"
_TOKEN_KEY = "tool_server.token"


def _unsigned(url: str) -> str:
    return (
        f"tool server {url} did not prove it holds {_TOKEN_KEY} (its answer is not signed with "
        "it): another process at that address, or a server with another token"
    )


class RemoteToolClient:
    """Calls ``POST {url}/call/{name}`` with retries; shared by every RemoteTool of one server."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrent: int = 32,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._token = token
        self._limiter = anyio.CapacityLimiter(max_concurrent)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout_s,
            limits=httpx.Limits(
                max_connections=max_concurrent, max_keepalive_connections=max_concurrent
            ),
        )
        self._closed = False

    def backoff_delay(self, retry: int) -> float:
        """Delay before retry number ``retry`` (1-based): backoff_s * 2**(retry-1), stretched by up
        to half again at random. Jitter only lengthens it, so clients that failed together spread
        out while the nominal schedule stays a lower bound."""
        return self.backoff_s * 2 ** (retry - 1) * random.uniform(1.0, 1.5)

    async def call(
        self, name: str, arguments: dict[str, Any], *, episode_id: str = ""
    ) -> ToolResult:
        body = json.dumps({"arguments": arguments, "episode_id": episode_id}).encode()
        path = f"/call/{quote(name, safe='')}"
        attempts = self.retries + 1
        last_problem = ""
        delay = 0.0
        for attempt in range(attempts):
            if attempt:
                await anyio.sleep(max(self.backoff_delay(attempt), delay))
            delay = 0.0
            try:
                # The limit counts requests in flight, not calls sleeping between retries.
                async with self._limiter:
                    with anyio.fail_after(self.timeout_s):  # whole request, not per read
                        # signed afresh each attempt: the server refuses a nonce it has seen
                        signed = (
                            sign_request(self._token, "POST", path, body) if self._token else None
                        )
                        response = await self._http.post(
                            path,
                            content=body,
                            headers={
                                "content-type": "application/json",
                                **(signed.headers if signed else {}),
                            },
                        )
            except TimeoutError:
                last_problem = f"no response within {self.timeout_s:g} s"
                continue
            except (
                httpx.TransportError
            ) as exc:  # connect/read/write errors and httpx's own timeouts
                last_problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if response.status_code in TRANSIENT_STATUS:
                last_problem = f"HTTP {response.status_code}: {_error_text(response)}"
                delay = _retry_after(response)
                continue
            if (
                signed is not None
                and not response_is_genuine(
                    self._token or "",
                    signed.nonce,
                    response.status_code,
                    response.content,
                    response.headers,
                )
                and response.status_code != 401
            ):
                return ToolResult(text=f"error: {_unsigned(self.url)}", ok=False)
            return self._result(name, response)
        return ToolResult(
            text=f"error: tool server {self.url} unreachable after {attempts} attempts: {last_problem}",
            ok=False,
        )

    def _result(self, name: str, response: httpx.Response) -> ToolResult:
        if response.status_code == 401:
            # A refusal cannot be signed (the server did not trust the request), so its text may
            # come from anyone at that address: the model reads none of it when we sign.
            why = "" if self._token else f": {_error_text(response)}"
            return ToolResult(
                text=f"error: tool server {self.url} refused the call of {name!r}{why} "
                f"(check {_TOKEN_KEY} on both sides)",
                ok=False,
            )
        if response.status_code != 200:
            # Unknown tool (404), refused request (400), a server bug (500): retrying changes nothing.
            return ToolResult(
                text=f"error: tool server {self.url} answered HTTP {response.status_code} to a call "
                f"of {name!r}: {_error_text(response)}",
                ok=False,
            )
        try:
            return result_from_json(response.json())
        except ValueError as exc:  # JSONDecodeError is a ValueError too
            return ToolResult(
                text=f"error: tool server {self.url} sent an invalid reply to a call of {name!r}: {exc}",
                ok=False,
            )

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._http.aclose()

    async def __aenter__(self) -> RemoteToolClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class RemoteTool:
    """A tool that runs on a tool server. Per-episode ``ctx.state``/``row`` stay here: a tool that
    needs them across calls (StateLM notes) must run in-process."""

    def __init__(self, name: str, schema: dict[str, Any], client: RemoteToolClient) -> None:
        self.name = name
        self._schema = schema
        self.client = client

    @property
    def schema(self) -> dict[str, Any]:
        return self._schema

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        # Checked here as the server would (same schema, same text): saves a round trip.
        if bad := invalid_args(self, args):
            return bad
        return await self.client.call(self.name, args, episode_id=ctx.episode_id)


def result_to_json(result: ToolResult) -> dict[str, Any]:
    """The wire form of a ToolResult (what ``POST /call/{name}`` answers)."""
    return {
        "text": result.text,
        "ok": result.ok,
        "terminal": result.terminal,
        "answer": result.answer,
        "metrics": dict(result.metrics),
    }


def result_from_json(data: Any) -> ToolResult:
    """A ToolResult from its wire form; ValueError naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    text, ok, terminal = data.get("text"), data.get("ok"), data.get("terminal", False)
    answer, metrics = data.get("answer"), data.get("metrics") or {}
    if not isinstance(text, str):
        raise ValueError("field 'text' must be a string")
    if not isinstance(ok, bool) or not isinstance(terminal, bool):
        raise ValueError("fields 'ok' and 'terminal' must be booleans")
    if answer is not None and not isinstance(answer, str):
        raise ValueError("field 'answer' must be a string or null")
    if not isinstance(metrics, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()
    ):
        raise ValueError("field 'metrics' must map names to numbers")
    return ToolResult(
        text=text,
        ok=ok,
        terminal=terminal,
        answer=answer,
        metrics={str(k): float(v) for k, v in metrics.items()},
    )


def fetch_schemas(
    url: str, timeout_s: float = 10.0, *, attempts: int = 3, token: str | None = None
) -> dict[str, dict[str, Any]]:
    """Tool name -> function schema served at ``url`` (``GET /tools``), for start-up.

    Blocks (a few short retries, for a server that is still starting); raises ValueError naming
    tools.remote.url and the URL when the server cannot be reached or does not answer like one.
    """
    base = url.rstrip("/")
    problem = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.25 * 2 ** (attempt - 1))
        signed = sign_request(token, "GET", "/tools") if token else None
        try:
            response = httpx.get(
                f"{base}/tools", timeout=timeout_s, headers=signed.headers if signed else None
            )
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            continue
        if response.status_code in TRANSIENT_STATUS:
            problem = f"HTTP {response.status_code}"
            continue
        if response.status_code == 401:
            given = "the token sent was refused" if token else "none is configured"
            raise ValueError(
                f"{_TOKEN_KEY}: tool server {base} requires a token and {given} "
                f"({_error_text(response)}); set the server's token in this config too"
            )
        if signed is not None and not response_is_genuine(
            token or "", signed.nonce, response.status_code, response.content, response.headers
        ):
            raise ValueError(f"{_TOKEN_KEY}: {_unsigned(base)}")
        try:
            return _schemas_from(response)
        except ValueError as exc:
            raise ValueError(
                f"{_URL_KEY}: {base} does not answer like a tool server (GET /tools: {exc}); "
                "is the URL right?"
            ) from None
    raise ValueError(
        f"{_URL_KEY}: tool server {base} unreachable after {attempts} attempts ({problem}); "
        "start bin/tool-server there or change the URL"
    )


def _schemas_from(response: httpx.Response) -> dict[str, dict[str, Any]]:
    if response.status_code != 200:
        raise ValueError(f"HTTP {response.status_code}")
    data = response.json()
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list):
        raise ValueError("no 'tools' list in the reply")
    schemas: dict[str, dict[str, Any]] = {}
    for schema in tools:
        fn = schema.get("function") if isinstance(schema, dict) else None
        if not (
            isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("parameters"), dict)
        ):
            raise ValueError(
                f"not a function schema with a name and parameters: {str(schema)[:200]}"
            )
        schemas[fn["name"]] = schema
    return schemas


def _error_text(response: httpx.Response) -> str:
    """The server's ``{"error": ...}`` message, else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return response.text[:300].strip() or response.reason_phrase


def _retry_after(response: httpx.Response) -> float:
    """Seconds a 429/503 asks the client to wait (numeric Retry-After only), capped."""
    try:
        value = float(response.headers.get("retry-after", "0"))
    except ValueError:
        return 0.0
    return min(value, MAX_RETRY_AFTER_S) if math.isfinite(value) and value > 0 else 0.0
