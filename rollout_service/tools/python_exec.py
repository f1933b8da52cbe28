"""The ``python`` tool: run model-written code in the sandbox and show it what came out.

Design: each call is a fresh sandbox run (no state carries between calls; the model prints what it
needs). The reply is stdout, then stderr under a heading, cut to ``max_output_chars`` keeping the
head and the tail (a traceback's last line is the useful one). A timeout, a kill or a non-zero
exit is ``ok=False`` with a sentence saying what happened, so the agent loop counts it as a failed
call while the model still reads the output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout_service.sandbox import SandboxLimits, SandboxResult, run_python
from rollout_service.tools.base import TOOLS, ToolContext, ToolResult, function_schema, invalid_args

_REASONS = {
    "timeout": "execution timed out after {timeout:g} s and was killed",
    "output_limit": "output exceeded {output} bytes; the program was killed",
    "memory": "out of memory (limit {memory} MiB per process, {call_memory} MiB for the whole run)",
    "cpu": "CPU time limit of {cpu} s exceeded; the program was killed",
    "file_size": "file size limit exceeded",
    "sandbox_error": "the sandbox failed to start the program",
}


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and the tail of ``text`` within ``limit`` characters."""
    if len(text) <= limit:
        return text
    marker = f"\n... [{len(text) - limit} characters cut] ...\n"
    keep = max(limit - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def describe(res: SandboxResult, limits: SandboxLimits, max_chars: int) -> ToolResult:
    parts = []
    if res.stdout:
        parts.append(res.stdout)
    if res.stderr:
        parts.append(f"stderr:\n{res.stderr}")
    if res.killed_reason is not None:
        template = _REASONS.get(res.killed_reason, "the program was killed ({reason})")
        parts.append(
            "Error: "
            + template.format(
                timeout=limits.timeout_s,
                output=limits.max_output_bytes,
                memory=limits.memory_mb,
                call_memory=limits.call_memory_mb,
                cpu=limits.cpu_s,
                reason=res.killed_reason,
            )
        )
    elif res.exit_code != 0:
        parts.append(f"Error: the program exited with status {res.exit_code}")
    text = "\n".join(part.rstrip("\n") for part in parts) or "(no output)"
    metrics = {"sandbox_wall_s": res.wall_s, "sandbox_timed_out": float(res.timed_out)}
    return ToolResult(text=truncate_middle(text, max_chars), ok=res.ok, metrics=metrics)


class PythonTool:
    name = "python"

    def __init__(self, limits: SandboxLimits, max_output_chars: int = 4000) -> None:
        self.limits = limits
        self.max_output_chars = max_output_chars

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            (
                "Run a Python 3 program in a fresh sandbox (no network, no third-party packages, "
                f"{self.limits.timeout_s:g} s limit) and return what it prints. Use print() to see "
                "results; nothing is kept between calls."
            ),
            {
                "code": {"type": "string", "description": "the complete program"},
                "stdin": {"type": "string", "description": "text fed to standard input"},
            },
            ["code"],
        )

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if bad := invalid_args(self, args):
            return bad
        res = await run_python(args["code"], limits=self.limits, stdin=args.get("stdin", ""))
        return describe(res, self.limits, self.max_output_chars)


@TOOLS.register("python")
def make_python_tool(*, max_output_chars: int = 4000, **limits: Any) -> PythonTool:
    """Options: ``max_output_chars`` and any SandboxLimits field (timeout_s, memory_mb, ...)."""
    known = {f.name for f in dataclasses.fields(SandboxLimits)}
    unknown = sorted(set(limits) - known)
    if unknown:
        raise TypeError(f"unknown python tool options {unknown}; known: {sorted(known)}")
    return PythonTool(SandboxLimits(**limits), max_output_chars=max_output_chars)
