"""bin/tool-server: serve tools (sandboxed python, search, ...) over HTTP, JSON in and out.

Design: the tools named in ``tool_server.tools`` are built in-process by the same factory a
rollout server uses (options from ``tools.*``), so a tool behaves the same wherever it runs; a
rollout server reaches them with ``RemoteTool`` (tools.remote). A small Starlette app on uvicorn:

    GET  /health        -> {"ok": true, "tools": [names]}   (no token needed; names only with it)
    GET  /tools         -> {"tools": [OpenAI function schemas]}
    POST /call/{name}   {"arguments": {...}, "episode_id": "..."}
                        -> 200 {"text", "ok", "terminal", "answer", "metrics"}   (a ToolResult)
                           404 unknown tool, 400 malformed body, 413 body too large,
                           401 unsigned, wrongly signed or replayed, 503 abandoned at
                           shutdown: {"error": ...}

Access: the server binds ``tool_server.host``, loopback (127.0.0.1) unless a config says
otherwise, and a warning is logged when it serves another address without a token. With
``tool_server.token`` set, client and server prove to each other that they hold it, with no
secret on the wire (`rollout_service.tools.auth`): every request but ``GET /health`` must be
signed, and is refused with 401 before its body is read when it is not (or is replayed); every
answer to a signed request is signed in turn, and clients accept no other. The token
authenticates, it does not encrypt: across an untrusted network put the server behind TLS (a
reverse proxy) as well.

A tool that raises is the model's problem to read (200, ok=false, the error text) and the
operator's to fix (logged with its traceback); nothing a client sends stops the server. At most
``tool_server.max_concurrent_calls`` calls run at once; the others wait in line. The socket is
bound before uvicorn starts so that port 0 works and the real URL is logged (``tool server
listening url=...``). SIGINT/SIGTERM: uvicorn stops accepting, running calls get a few seconds to
finish, the rest are abandoned with a 503 that clients retry (the sandbox kills their processes),
and the process exits 0.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import signal
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.logging import get_logger
from common.peer_auth import tool_server_token
from common.run_events import Kind, emit
from rollout_service.tools.auth import RESPONSE_HEADER, RequestVerifier, sign_response
from rollout_service.tools.base import Tool, ToolContext, ToolResult
from rollout_service.tools.factory import build_local_tools
from rollout_service.tools.remote import result_to_json

if TYPE_CHECKING:
    from common.config import Config

log = get_logger(__name__)

MAX_BODY_BYTES = 16 << 20  # a call's arguments (code, a query) are small; refuse anything huge
GRACEFUL_SHUTDOWN_S = 5.0  # running calls get this long to finish after a stop signal


class ToolService:
    """The HTTP app serving ``tools`` (``.app``), and the calls it is running."""

    def __init__(
        self, tools: Mapping[str, Tool], *, max_concurrent_calls: int, token: str | None = None
    ) -> None:
        self.tools = dict(tools)
        self._token = token
        self._verifier = RequestVerifier(token) if token else None
        self._schemas = [tool.schema for tool in self.tools.values()]
        self._limiter = anyio.CapacityLimiter(max_concurrent_calls)
        self._running: set[anyio.CancelScope] = set()
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/tools", self._list_tools, methods=["GET"]),
                Route("/call/{name}", self._call, methods=["POST"]),
            ]
        )

    def abandon_running_calls(self) -> int:
        """Cancel every call running or waiting; each answers 503 (a client retries elsewhere or
        later). Returns how many there were."""
        for scope in list(self._running):
            scope.cancel()
        return len(self._running)

    def _verify(self, request: Request) -> tuple[str, Response | None]:
        """``(nonce, None)`` for a request that may go on ("" without a token), else the 401."""
        if self._verifier is None:
            return "", None
        nonce, problem = self._verifier.check(request.method, request.url.path, request.headers)
        if nonce is not None:
            return nonce, None
        refused = _error(401, f"unauthorized: {problem}; sign requests with tool_server.token")
        return "", refused

    def _signed(self, nonce: str, response: Response) -> Response:
        """The answer to a verified request, signed so the client knows who answered it."""
        if self._token is not None and nonce:
            response.headers[RESPONSE_HEADER] = sign_response(
                self._token, nonce, response.status_code, bytes(response.body)
            )
        return response

    async def _health(self, request: Request) -> Response:
        # Liveness for supervisors without the token; what is served only for clients with it.
        nonce, refused = self._verify(request)
        if refused is not None:
            return JSONResponse({"ok": True})
        return self._signed(nonce, JSONResponse({"ok": True, "tools": list(self.tools)}))

    async def _list_tools(self, request: Request) -> Response:
        nonce, refused = self._verify(request)
        if refused is not None:
            return refused
        return self._signed(nonce, JSONResponse({"tools": self._schemas}))

    async def _call(self, request: Request) -> Response:
        nonce, refused = self._verify(request)
        if refused is not None:
            return refused
        return self._signed(nonce, await self._answer_call(request))

    async def _answer_call(self, request: Request) -> Response:
        name = request.path_params["name"]
        tool = self.tools.get(name)
        if tool is None:
            return _error(404, f"unknown tool {name!r}; served: {', '.join(self.tools) or 'none'}")
        body = await _read_json_body(request, self._verifier)
        if isinstance(body, Response):
            return body
        arguments, episode_id = body.get("arguments"), body.get("episode_id", "")
        if not isinstance(arguments, dict):
            got = "nothing" if "arguments" not in body else type(arguments).__name__
            return _error(
                400, f"field 'arguments' must be a JSON object (the tool's arguments), got {got}"
            )
        if not isinstance(episode_id, str):
            return _error(
                400, f"field 'episode_id' must be a string, got {type(episode_id).__name__}"
            )
        start = time.perf_counter()
        content = None
        with anyio.CancelScope() as scope:
            self._running.add(scope)
            try:
                async with self._limiter:
                    content = await self._run(tool, arguments, episode_id)
            finally:
                self._running.discard(scope)
        if content is None:  # abandoned at shutdown
            return _error(503, "tool server shutting down; the call was abandoned, retry it")
        log.debug(
            "tool call",
            tool=name,
            episode_id=episode_id,
            wall_s=round(time.perf_counter() - start, 4),
        )
        return Response(content, media_type="application/json")

    async def _run(self, tool: Tool, arguments: dict[str, Any], episode_id: str) -> str:
        try:
            result = await tool.call(arguments, ToolContext(episode_id=episode_id))
            return json.dumps(result_to_json(result), allow_nan=False)  # strict JSON, or the below
        except (
            Exception
        ) as exc:  # a tool bug: the model reads the error, the operator the traceback
            log.exception("tool call raised", tool=tool.name, episode_id=episode_id)
            failed = ToolResult(
                text=f"Error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}", ok=False
            )
            return json.dumps(result_to_json(failed))


def make_app(
    tools: Mapping[str, Tool], *, max_concurrent_calls: int, token: str | None = None
) -> Starlette:
    """The HTTP app serving ``tools`` (see ToolService)."""
    return ToolService(tools, max_concurrent_calls=max_concurrent_calls, token=token).app


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


async def _read_json_body(
    request: Request, verifier: RequestVerifier | None
) -> dict[str, Any] | Response:
    """The body as a JSON object, or the 4xx response saying what is wrong with it (a body other
    than the one the client signed among them)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _error(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if verifier is not None and not verifier.body_matches(request.headers, raw):
        return _error(401, "unauthorized: the body is not the one that was signed")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(
            400,
            f"request body is not valid JSON ({exc}); expected "
            '{"arguments": {...}, "episode_id": "..."}',
        )
    if not isinstance(body, dict):
        return _error(
            400,
            f"request body must be a JSON object with field 'arguments', got {type(body).__name__}",
        )
    return body


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


class _DropColorMessage(logging.Filter):
    """uvicorn attaches an ANSI-coloured copy of some messages as an extra field; our handlers
    would print it as one more key."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("color_message", None)
        return True


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port). With SO_REUSEADDR (which
    create_server sets on POSIX): bin/train restarts a dead tool server on the port the rollout
    servers were given, and the connections of the killed one linger there in TIME_WAIT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


def server_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def run(config: Config, run_dir: Path) -> int:
    """Run target of bin/tool-server: serve until SIGINT/SIGTERM, then return 0."""
    import uvicorn

    settings = config.tool_server
    stopped_by: list[str] = []
    server: uvicorn.Server | None = None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # uvicorn handles the signals while it serves and raises the signal again after its
        # graceful shutdown; that second delivery lands here and only records it, so the process
        # exits 0. A signal before serving (a slow corpus index) interrupts at once (status 130).
        if server is not None and server.should_exit:
            stopped_by.append(signal.Signals(signum).name)
            return
        raise KeyboardInterrupt

    logging.getLogger("uvicorn.error").addFilter(_DropColorMessage())
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        tools = build_local_tools(config, settings.tools, key="tool_server.tools")
        token = tool_server_token(settings, create=True)
        service = ToolService(
            tools, max_concurrent_calls=settings.max_concurrent_calls, token=token
        )
        if not is_loopback(settings.host) and token is None:
            log.warning(
                "tool server reachable from other hosts without a token: anyone who reaches "
                "it can run code in its sandbox; set tool_server.token",
                host=settings.host,
            )
        # timeout_graceful_shutdown is a backstop; see _abandon_after_grace
        server = uvicorn.Server(
            uvicorn.Config(
                service.app,
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=math.ceil(GRACEFUL_SHUTDOWN_S) + 5,
            )
        )
        with bind_socket(settings.host, settings.port) as sock:
            # The real port (port 0: the OS chose it) for bin/train, which waits for it.
            emit(Kind.LISTENING, "tool-server", url=server_url(sock), port=sock.getsockname()[1])
            log.info(
                "tool server listening",
                url=server_url(sock),
                tools=list(tools),
                max_concurrent_calls=settings.max_concurrent_calls,
                token=token is not None,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(_abandon_after_grace, server, service)
                await server.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        log.info("tool server stopped", signal=",".join(stopped_by) or None)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _abandon_after_grace(server: Any, service: ToolService) -> None:
    """Once uvicorn is stopping, give running calls GRACEFUL_SHUTDOWN_S, then abandon them with a
    503 ourselves: uvicorn's own timeout would cancel them into a 500 and an error traceback."""
    # uvicorn only exposes its stop request as a flag; it polls it every 0.1 s itself.
    while not server.should_exit:
        await anyio.sleep(0.1)
    await anyio.sleep(GRACEFUL_SHUTDOWN_S)
    if abandoned := service.abandon_running_calls():
        log.warning(
            "abandoned running calls after the grace period",
            calls=abandoned,
            grace_s=GRACEFUL_SHUTDOWN_S,
        )
