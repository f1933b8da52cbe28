"""Building a tool set from the config: local and remote tools, interchangeable by name.

Design: a tool is built from its registry factory with options taken from the config by
``TOOL_OPTIONS`` (one plain function per configurable tool; add an entry for a new one). Which
tools run where is config only: with ``tools.remote.url`` set, the names in ``tools.remote.names``
(or, when that is empty, every name the server serves) become ``RemoteTool``s sharing one
``RemoteToolClient``, and the rest are built in-process. The agent loop cannot tell them apart.

Ownership: ``build_tools`` returns a plain ``{name: Tool}`` dict; the client of remote tools is
reachable as ``tool.client`` and the owner of the dict closes it with ``await close_tools(tools)``
when it shuts down (several tool sets may share one client by passing ``client=``; closing twice
is harmless).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from common.peer_auth import tool_server_token
from rollout_service.tools import load_builtin_tools
from rollout_service.tools.base import Tool
from rollout_service.tools.remote import RemoteTool, RemoteToolClient, fetch_schemas

if TYPE_CHECKING:
    from common.config import Config

TOOLS_KEY = "actor_rollout_ref.rollout.multi_turn.tools"


def _python_options(config: Config) -> dict[str, Any]:
    py = config.tools.python
    return {
        "timeout_s": py.timeout_s,
        "memory_mb": py.memory_mb,
        "call_memory_mb": py.call_memory_mb,
        "disk_mb": py.disk_mb,
        "max_output_chars": py.max_output_chars,
    }


def _search_options(config: Config) -> dict[str, Any]:
    search = config.tools.search
    if search.corpus is None:
        raise ValueError(
            "tools.search.corpus: required when the search tool is used "
            '(a JSONL file, one {"text", "title"?, "id"?} object per line)'
        )
    return {
        "corpus": search.corpus,
        "top_k": search.top_k,
        "max_chars_per_passage": search.max_chars_per_passage,
    }


def _chunk_options(config: Config) -> dict[str, Any]:
    return {"chunk_chars": config.agents.statelm.chunk_chars}


TOOL_OPTIONS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "python": _python_options,
    "search": _search_options,
    "loadDocument": _chunk_options,
    "readChunk": _chunk_options,
}
"""Tool name -> the options its registry factory gets from the config; tools not named get none."""


def tool_options(config: Config, name: str) -> dict[str, Any]:
    options = TOOL_OPTIONS.get(name)
    return options(config) if options is not None else {}


def build_local_tools(
    config: Config, names: Sequence[str], *, key: str = TOOLS_KEY
) -> dict[str, Tool]:
    """Build ``names`` in-process (in order, duplicates once); ValueError naming ``key`` for a
    name the registry does not know."""
    registry = load_builtin_tools()
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(
            f"{key}: unknown tool(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(registry.names())}"
        )
    return {name: registry.get(name)(**tool_options(config, name)) for name in dict.fromkeys(names)}


def build_tools(
    config: Config, names: Sequence[str], *, client: RemoteToolClient | None = None
) -> dict[str, Tool]:
    """The tools ``names``, each local or remote as ``tools.remote`` says, in the order given.

    Contacts the tool server (blocking, at start-up) only when some name may be remote. ``client``
    reuses an existing client for the remote ones (several agents' tool sets, one connection pool).
    """
    wanted = list(dict.fromkeys(names))
    remote = config.tools.remote
    served: dict[str, dict[str, Any]] = {}
    remote_names: list[str] = []
    token: str | None = None
    if remote.url is not None and (not remote.names or set(remote.names) & set(wanted)):
        token = tool_server_token(config.tool_server)  # read once: the schemas' and calls' secret
        served = fetch_schemas(remote.url, remote.timeout_s, token=token)
        if remote.names:
            missing = [n for n in remote.names if n in wanted and n not in served]
            if missing:
                raise ValueError(
                    f"tools.remote.names: {', '.join(map(repr, missing))} not served by "
                    f"the tool server {remote.url}; it serves: {', '.join(served) or 'nothing'}"
                )
            remote_names = [n for n in wanted if n in remote.names]
        else:
            remote_names = [n for n in wanted if n in served]
    local_names = [n for n in wanted if n not in remote_names]
    registry = load_builtin_tools()
    unknown = [n for n in local_names if n not in registry]
    if unknown:
        known = sorted(set(registry.names()) | set(served))
        raise ValueError(
            f"{TOOLS_KEY}: unknown tool(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(known)}"
        )
    tools = build_local_tools(config, local_names)
    if remote_names:
        assert remote.url is not None
        if client is None:
            client = RemoteToolClient(
                remote.url,
                timeout_s=remote.timeout_s,
                retries=remote.retries,
                backoff_s=remote.backoff_s,
                max_concurrent=remote.max_concurrent,
                token=token,
            )
        tools.update({n: RemoteTool(n, served[n], client) for n in remote_names})
    return {n: tools[n] for n in wanted}


async def close_tools(tools: Mapping[str, Tool]) -> None:
    """Close the remote clients used by ``tools`` (each once); local tools hold nothing to close."""
    found = [getattr(t, "client", None) for t in tools.values()]  # RemoteTool, or a wrapper of one
    clients = {id(c): c for c in found if isinstance(c, RemoteToolClient)}
    for client in clients.values():
        await client.aclose()
