"""The StateLM tools: context deletion, notes, chunked documents and the budget.

Design: the tools hold no state of their own; they act on the episode's ``StateLMContext`` in
``ctx.state["statelm"]`` (put there by the StateLM agent), so one tool object serves every episode
concurrently. Notes and documents work for any agent (they fall back to ``ctx.state`` and the data
row); ``deleteContext`` and ``checkBudget`` need the StateLM agent and say so otherwise. A deletion
only marks the message: the agent closes the segment and re-renders after the turn, so several
deletions in one turn make one snapshot.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from rollout_service.agents.statelm_context import Note, StateLMContext, documents_of
from rollout_service.tools.base import TOOLS, ToolContext, ToolResult, function_schema, invalid_args


def _context(ctx: ToolContext) -> StateLMContext | None:
    value = ctx.state.get("statelm")
    return value if isinstance(value, StateLMContext) else None


def _notes(ctx: ToolContext) -> dict[str, Note]:
    sl = _context(ctx)
    return sl.notes if sl is not None else ctx.state.setdefault("notes", {})


def _error(text: str) -> ToolResult:
    return ToolResult(f"Error: {text}", ok=False)


class _Tool:
    """Schema from class attributes; ``run`` does the work once the arguments are checked."""

    name: str = ""  # set by each tool class
    description: ClassVar[str] = ""
    properties: ClassVar[dict[str, Any]] = {}
    required: ClassVar[list[str]] = []

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, self.description, self.properties, self.required)

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        if bad := invalid_args(self, args):
            return bad
        return self.run(args, ctx)

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        raise NotImplementedError


class DeleteContext(_Tool):
    name = "deleteContext"
    description = (
        "Delete a message from your context by its msg_id to free space. It is replaced by a "
        "short stub; save what you still need with note first."
    )
    properties: ClassVar[dict[str, Any]] = {
        "msg_id": {"type": "integer", "description": "id of the message to delete"}
    }
    required: ClassVar[list[str]] = ["msg_id"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sl = _context(ctx)
        if sl is None:
            return _error("deleteContext is only available to the statelm agent")
        problem = sl.delete(args["msg_id"])
        if problem:
            return _error(problem)
        return ToolResult(f"Deleted msg_id {args['msg_id']}.", metrics={"deletions": 1.0})


class NoteTool(_Tool):
    name = "note"
    description = (
        "Save a new note in external memory; its key and summary stay visible after deletions."
    )
    properties: ClassVar[dict[str, Any]] = {
        "key": {"type": "string"},
        "summary": {"type": "string", "description": "one line"},
        "content": {"type": "string"},
    }
    required: ClassVar[list[str]] = ["key", "summary", "content"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        notes = _notes(ctx)
        if not args["key"].strip():
            return _error("argument 'key' must not be empty")
        if args["key"] in notes:
            return _error(f"a note {args['key']!r} exists already; use updateNote")
        notes[args["key"]] = Note(args["summary"], args["content"])
        return ToolResult(f"Saved note {args['key']!r}.")


class ReadNote(_Tool):
    name = "readNote"
    description = "Read a note from external memory."
    properties: ClassVar[dict[str, Any]] = {"key": {"type": "string"}}
    required: ClassVar[list[str]] = ["key"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        notes = _notes(ctx)
        note = notes.get(args["key"])
        if note is None:
            return _error(f"no note {args['key']!r}; notes: {', '.join(notes) or 'none'}")
        return ToolResult(note.content)


class UpdateNote(_Tool):
    name = "updateNote"
    description = "Change a note: append to it, overwrite it, or delete it."
    properties: ClassVar[dict[str, Any]] = {
        "key": {"type": "string"},
        "content": {"type": "string"},
        "mode": {"type": "string", "enum": ["append", "overwrite", "delete"]},
    }
    required: ClassVar[list[str]] = ["key", "mode"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        notes, key, mode = _notes(ctx), args["key"], args["mode"]
        if key not in notes:
            return _error(f"no note {key!r}; notes: {', '.join(notes) or 'none'}")
        if mode == "delete":
            del notes[key]
            return ToolResult(f"Deleted note {key!r}.")
        if mode not in ("append", "overwrite"):
            return _error(f"argument 'mode' must be append, overwrite or delete (got {mode!r})")
        if "content" not in args:
            return _error(f"argument 'content' is required with mode {mode}")
        note = notes[key]
        note.content = note.content + args["content"] if mode == "append" else args["content"]
        return ToolResult(f"Updated note {key!r} ({mode}).")


class _DocumentTool(_Tool):
    def __init__(self, chunk_chars: int = 1000) -> None:
        if chunk_chars <= 0:
            raise ValueError(f"chunk_chars must be positive (got {chunk_chars})")
        self.chunk_chars = chunk_chars

    def chunks(self, text: str) -> int:
        return max(1, -(-len(text) // self.chunk_chars))

    def document(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        docs = documents_of(ctx.row)
        i = args["doc_id"]
        if not docs:
            return _error("this task has no documents")
        if not 0 <= i < len(docs):
            return _error(f"no document with doc_id {i} (doc_ids run from 0 to {len(docs) - 1})")
        return docs[i]


class LoadDocument(_DocumentTool):
    name = "loadDocument"
    description = "Open a document of the task: its title, length and number of chunks."
    properties: ClassVar[dict[str, Any]] = {"doc_id": {"type": "integer"}}
    required: ClassVar[list[str]] = ["doc_id"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        doc = self.document(args, ctx)
        if isinstance(doc, ToolResult):
            return doc
        return ToolResult(
            f"doc_id {args['doc_id']}: {doc.title!r}, {len(doc.text)} characters in "
            f"{self.chunks(doc.text)} chunks; read them with readChunk(doc_id, chunk)."
        )


class ReadChunk(_DocumentTool):
    name = "readChunk"
    description = "Read one chunk of a document (chunks are numbered from 0)."
    properties: ClassVar[dict[str, Any]] = {
        "doc_id": {"type": "integer"},
        "chunk": {"type": "integer"},
    }
    required: ClassVar[list[str]] = ["doc_id", "chunk"]

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        doc = self.document(args, ctx)
        if isinstance(doc, ToolResult):
            return doc
        n, k = self.chunks(doc.text), args["chunk"]
        if not 0 <= k < n:
            return _error(f"doc_id {args['doc_id']} has chunks 0 to {n - 1} (asked for {k})")
        return ToolResult(doc.text[k * self.chunk_chars : (k + 1) * self.chunk_chars])


class CheckBudget(_Tool):
    name = "checkBudget"
    description = "How many tokens and turns are left before the episode is cut off."

    def run(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sl = _context(ctx)
        if sl is None:
            return _error("checkBudget is only available to the statelm agent")
        return ToolResult(json.dumps(sl.budget))


def _no_options(cls: type) -> Any:
    def make(**options: Any) -> Any:
        if options:
            raise TypeError(f"{cls.name} takes no options, got {sorted(options)}")
        return cls()

    return make


for _cls in (DeleteContext, NoteTool, ReadNote, UpdateNote, CheckBudget):
    TOOLS.register(_cls.name)(_no_options(_cls))
TOOLS.register("loadDocument")(lambda *, chunk_chars=1000: LoadDocument(chunk_chars))
TOOLS.register("readChunk")(lambda *, chunk_chars=1000: ReadChunk(chunk_chars))
