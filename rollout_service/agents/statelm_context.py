"""The StateLM agent's view of its conversation: every message with an id, deletions, notes.

Design (seed 004, agentic_verl's StateLM): the context the model sees is *rendered* from the full
history, not accumulated. Every message has a ``msg_id``; the system and user messages show it as
a ``[msg_id N]`` prefix, tool messages are JSON objects carrying their own id and the id of the
assistant message that called them (which is how the model learns the ids of its own turns).
Deleting a message does not remove it: it renders as a stub, so ids stay stable and the model
still sees that something was there. A deleted assistant message keeps the names of the tools it
called with their arguments stubbed; a deleted tool message becomes a JSON stub naming the
original tool. The first user message also lists the documents and the notes (key: summary), the
external memory that survives deletions. Only the agent loop re-renders (after a turn that
deleted something), so between deletions the context grows by appending, token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rollout_service.agents.parsers import ToolCall

STUB = "Content has been deleted to save space."


@dataclass
class Message:
    msg_id: int
    role: str  # system | user | assistant | tool
    content: str
    tool: str = ""  # tool messages: the tool that answered
    call_msg_id: int | None = None  # tool messages: the assistant message that made the call
    calls: list[ToolCall] = field(default_factory=list)  # assistant messages: the calls it made
    deleted: bool = False


@dataclass
class Note:
    summary: str
    content: str


@dataclass
class Document:
    title: str
    text: str


def documents_of(row: dict[str, Any]) -> list[Document]:
    """A data row's documents: ``documents`` (strings or {title, text}) or a single ``document``."""
    raw = row.get("documents")
    if raw is None and isinstance(row.get("document"), str):
        raw = [row["document"]]
    docs = []
    for i, d in enumerate(raw or []):
        if isinstance(d, str):
            docs.append(Document(f"document {i}", d))
        elif isinstance(d, dict) and isinstance(d.get("text"), str):
            docs.append(Document(str(d.get("title") or f"document {i}"), d["text"]))
    return docs


class StateLMContext:
    """History, deletions, notes and budget of one StateLM episode (lives in ``ep.tool_state``)."""

    def __init__(self, system_prompt: str, question: str, documents: list[Document]) -> None:
        self.history: list[Message] = []
        self.notes: dict[str, Note] = {}
        self.documents = documents
        self.deleted_this_turn: list[int] = []
        self.current_assistant: int | None = None
        self.budget: dict[str, int] = {}  # refreshed by the agent before each turn's tool calls
        self.add("system", system_prompt)
        self.task_id = self.add("user", question).msg_id

    def add(self, role: str, content: str, **fields: Any) -> Message:
        msg = Message(len(self.history), role, content, **fields)
        self.history.append(msg)
        return msg

    # -- deletion ----------------------------------------------------------------------------------
    def delete(self, msg_id: int) -> str | None:
        """Mark ``msg_id`` deleted; None on success, else what is wrong (for the model to read)."""
        if not 0 <= msg_id < len(self.history):
            return f"no message with msg_id {msg_id} (ids run from 0 to {len(self.history) - 1})"
        msg = self.history[msg_id]
        if msg.role == "system" or msg_id == self.task_id:
            return f"msg_id {msg_id} is the {'system prompt' if msg.role == 'system' else 'task'} and cannot be deleted"
        if msg_id == self.current_assistant:
            return f"msg_id {msg_id} is the message making this call and cannot be deleted"
        if msg.deleted:
            return f"msg_id {msg_id} is already deleted"
        msg.deleted = True
        self.deleted_this_turn.append(msg_id)
        return None

    # -- rendering ---------------------------------------------------------------------------------
    def tool_content(self, msg: Message) -> str:
        """A tool message as the model sees it: its result with ids, or the deletion stub."""
        if msg.deleted:
            body: dict[str, Any] = {
                "msg_id": msg.msg_id,
                "call_msg_id": msg.call_msg_id,
                "status": "deleted",
                "message": STUB,
                "original_tool": msg.tool,
            }
        else:
            body = {
                "msg_id": msg.msg_id,
                "call_msg_id": msg.call_msg_id,
                "tool": msg.tool,
                "result": msg.content,
            }
        return json.dumps(body, ensure_ascii=False)

    def _assistant_content(self, msg: Message) -> str:
        if not msg.deleted:
            return msg.content
        stubs = [json.dumps({"name": c.name, "arguments": {"deleted": STUB}}) for c in msg.calls]
        return STUB + "".join(f"\n<tool_call>\n{s}\n</tool_call>" for s in stubs)

    def _task_content(self, msg: Message) -> str:
        parts = [f"[msg_id {msg.msg_id}] {msg.content}"]
        if self.documents:
            listing = "\n".join(
                f"- doc_id {i}: {d.title} ({len(d.text)} characters)"
                for i, d in enumerate(self.documents)
            )
            parts.append(f"Documents (open with loadDocument, read with readChunk):\n{listing}")
        if self.notes:
            listing = "\n".join(f"- {k}: {n.summary}" for k, n in self.notes.items())
            parts.append(f"External memory (notes; read with readNote):\n{listing}")
        else:
            parts.append("External memory (notes): empty")
        return "\n\n".join(parts)

    def render(self) -> list[dict[str, Any]]:
        """The chat messages of the current context, deletions stubbed."""
        out: list[dict[str, Any]] = []
        for msg in self.history:
            if msg.role == "tool":
                content = self.tool_content(msg)
            elif msg.role == "assistant":
                content = self._assistant_content(msg)
            elif msg.msg_id == self.task_id:
                content = self._task_content(msg)
            else:
                content = f"[msg_id {msg.msg_id}] {msg.content}"
            out.append({"role": msg.role, "content": content})
        return out
