"""Agent, tool, rate-limit and tool-server sections: `agents`, `tools`, `tool_server`.

Design: what an agent loop or a tool needs beyond verl's `multi_turn` keys lives here, one typed
section per agent and per configurable tool, so a typo in a tag or a corpus path fails at load time
with its dotted key. The same file configures a rollout server and the tool server it calls: the
tool server reads `tool_server` and the tool options under `tools`; a rollout server reads `tools`
(which of its tools are remote, and the rate limits) and `agents`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section


class StateLMConfig(Section):
    """The StateLM agent: the model deletes context, keeps notes and reads documents in chunks."""

    tools: list[str] = Field(
        default_factory=lambda: [
            "deleteContext",
            "note",
            "readNote",
            "updateNote",
            "loadDocument",
            "readChunk",
            "checkBudget",
            "finish",
        ]
    )
    """StateLM tools offered to the model (registry names; any other tool, e.g. search, may be added)."""
    chunk_chars: int = Field(default=1000, gt=0)
    """Characters per document chunk returned by readChunk."""
    max_segments: int | None = Field(default=None, gt=0)
    """Trajectories kept per episode (snapshots + final); null: all of them."""
    segment_selection: Literal["last", "random"] = "last"
    """Which to keep when an episode has more than max_segments: the last ones, or random snapshots
    plus the final segment."""
    reward_split: Literal["broadcast", "last_only"] = "broadcast"
    """Episode reward on every segment (broadcast), or on the final segment only (snapshots get 0)."""
    length_penalty: float = -1.0
    """Reward of an episode that ended by running out of tokens (replaces its score)."""
    min_turns: int = Field(default=0, ge=0)
    """Episodes with fewer model turns than this get min_turns_penalty added to their score."""
    min_turns_penalty: float = 0.0
    """Added to the score of an episode with fewer than min_turns model turns."""


class MaskSpan(Section):
    """A span of model text between two markers (markers included)."""

    start: str = Field(min_length=1)
    """Marker that opens the span."""
    end: str = Field(min_length=1)
    """Marker that closes the span."""


class CodeAgentConfig(Section):
    """The code-execution agent (seed 000): code between tags runs in the sandbox."""

    code_start_tag: str = Field(default="<code>", min_length=1)
    """Opens a code block in the model's text."""
    code_end_tag: str = Field(default="</code>", min_length=1)
    """Closes a code block; the block runs when this tag is generated (generation stops on it)."""
    result_start_tag: str = Field(default="<execution_results>", min_length=1)
    """Opens the sandbox output appended after a code block (mask 0)."""
    result_end_tag: str = Field(default="</execution_results>", min_length=1)
    """Closes the sandbox output."""
    answer_start_tag: str = Field(default="<answer>", min_length=1)
    """Opens the final answer."""
    answer_end_tag: str = Field(default="</answer>", min_length=1)
    """Text between the answer tags ends the episode and is the final answer."""
    mask_spans: list[MaskSpan] = Field(default_factory=list)
    """State masking: {start, end} marker pairs; model tokens from a start marker through its end
    marker get mask 0 (kept as context, not trained on)."""
    max_output_chars: int = Field(default=1024, gt=0)
    """Longest sandbox output returned to the model (head and tail kept)."""


class AgentsConfig(Section):
    """Options of the agent loops that have any."""

    statelm: StateLMConfig = Field(default_factory=StateLMConfig)
    """The StateLM context-managing agent (agent type `statelm`)."""
    code: CodeAgentConfig = Field(default_factory=CodeAgentConfig)
    """The code-execution agent (agent type `code`)."""


class SearchToolConfig(Section):
    """The `search` tool: BM25 over a local JSONL corpus."""

    corpus: str | None = None
    """JSONL file, one document per line with `text` (and optional `title`, `id`); required when
    the search tool is used."""
    top_k: int = Field(default=3, gt=0)
    """Passages returned per query."""
    max_chars_per_passage: int = Field(default=400, gt=0)
    """Each passage is cut to this many characters."""


class PythonToolConfig(Section):
    """The `python` tool and the code agent's sandbox."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one run (the process group is killed after it)."""
    memory_mb: int = Field(default=512, gt=0)
    """Address-space limit of each process of a run (RLIMIT_AS), in MiB."""
    call_memory_mb: int = Field(default=1024, gt=0)
    """Memory of all processes of one run together (tmpfs files included), in MiB; enforced by a
    cgroup per run where the host allows one (root or a delegated cgroup), else only warned about."""
    disk_mb: int = Field(default=64, gt=0)
    """Size of the run's working directory (a tmpfs in its mount namespace, as root), in MiB."""
    max_output_chars: int = Field(default=4000, gt=0)
    """Longest output returned to the model (head and tail kept)."""


class RemoteToolsConfig(Section):
    """Tools called over HTTP on a tool server (bin/tool-server) instead of in this process."""

    url: str | None = None
    """Base URL of the tool server, e.g. http://toolhost:8900; null: every tool runs in-process."""
    names: list[str] = Field(default_factory=list)
    """Tools served remotely; the others in multi_turn.tools run in-process. Empty with a url: every
    tool the server offers that multi_turn.tools names."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Limit of one HTTP call, retries excluded."""
    retries: int = Field(default=3, ge=0)
    """Retries of a call that failed transiently (connection error, timeout, HTTP 429/502/503/504)."""
    backoff_s: float = Field(default=0.5, gt=0)
    """First retry delay; doubles per retry (with jitter)."""
    max_concurrent: int = Field(default=32, gt=0)
    """Calls in flight to the tool server at once from this process."""

    @field_validator("url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL (got {value!r})")
        return value


class RateLimit(Section):
    """One token bucket."""

    per_minute: float = Field(gt=0)
    """Sustained rate: tokens added per minute."""
    burst: int = Field(default=1, gt=0)
    """Bucket size: calls admitted at once after a quiet period."""


class RateLimitsConfig(Section):
    """Global rate limits shared by every process on the host that uses the same state_dir."""

    state_dir: str | None = None
    """Directory of the lock and state files; null: <run_dir>/ratelimit. Put it on a shared
    filesystem to share limits across hosts (see docs/rollout-server.md, Rate limits)."""
    acquire_timeout_s: float = Field(default=300.0, gt=0)
    """Longest wait for a token before the call fails with a rate-limit error."""
    limits: dict[str, RateLimit] = Field(default_factory=dict)
    """Key (tool name or external API name) -> bucket. Tools without a key are not limited."""


class ToolsConfig(Section):
    """Tool options, where tools run, and their rate limits."""

    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    """Sandboxed Python (the python tool, the code agent, the code reward)."""
    search: SearchToolConfig = Field(default_factory=SearchToolConfig)
    """BM25 search over a local corpus."""
    remote: RemoteToolsConfig = Field(default_factory=RemoteToolsConfig)
    """Tools served by a tool server."""
    rate_limits: RateLimitsConfig = Field(default_factory=RateLimitsConfig)
    """Global per-key rate limits."""


class ToolServerConfig(Section):
    """bin/tool-server: serves tools over HTTP (JSON in, JSON out)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """Interface to bind: loopback by default; 0.0.0.0 to serve other hosts (then set `token`)."""
    port: int = Field(default=8900, ge=0, le=65535)
    """TCP port; 0: any free port (printed at start)."""
    tools: list[str] = Field(default_factory=lambda: ["python", "search", "calculator"])
    """Tools served (registry names)."""
    max_concurrent_calls: int = Field(default=32, gt=0)
    """Calls running at once; more wait in line (a client's own limit is tools.remote.max_concurrent)."""
    token: str | None = Field(default=None, min_length=16)
    """Shared secret: when set, rollout servers (tools.remote) sign every request with it and the
    tool server signs every answer, so each proves it holds it without sending it; the tool server
    refuses (HTTP 401) every request but GET /health that is unsigned, wrongly signed or replayed,
    and the rollout servers accept no answer it did not sign. At least 16
    characters, e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`; null: the
    token of `token_file`, or no check (fine on loopback only for a trusted host)."""
    token_file: str | None = None
    """A file holding that secret instead (so it never lands on a command line or in
    config.resolved.yaml): the tool server creates it (mode 0600, 256 random bits) when missing and
    keeps it across restarts, and rollout servers read it. bin/train sets
    `<run_dir>/tool-server.token` when it starts the tool server and neither this nor `token` is
    set, so its tool server and rollout servers authenticate each other by default. Set at most one
    of `token` and `token_file`."""

    @model_validator(mode="after")
    def _one_secret(self) -> ToolServerConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("set tool_server.token or tool_server.token_file, not both")
        return self
