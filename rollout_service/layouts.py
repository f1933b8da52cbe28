"""Row layouts: the shapes of data rows users arrive with, each adapted to the row our agents and
rewards read.

Design: a small registry (``LAYOUTS``) of ``RowLayout`` adapters instead of string if-chains. Each
layout says which rows it *claims* (a cheap look at the identifying fields) and *adapts* a claimed
row, raising ``DataError`` naming the row and the field when the row is unusable. ``adapt_row``
asks the layouts in ``priority`` order; the first that claims the row adapts it, and a row no
layout claims is refused with the layouts and the fields that identify them. Adding a layout is
one class and one ``LAYOUTS.register``; the reader of the file (JSONL, JSON list, parquet) is
``rollout_service.data``'s business and independent of the layout.

The adapted row keeps every original field (rewards may read any of them) and adds what the rest
of the rollout service reads:

- ``question`` (str): the task's text; agents that need text (StateLM) read it.
- ``messages`` (list, optional): a chat prompt, rendered with the chat template exactly as given
  (system and user messages included, nothing flattened); ``agents.base.initial_messages`` starts
  the conversation from it.
- ``answer`` (str, number or list): the reference the reward compares with.
- ``data_source`` / ``agent`` / ``reward_fn`` (str, optional): name the source (and through
  ``rollout_server.reward_by_data_source`` or verl's data-source table the reward), the agent
  type, the reward function.

Layouts:

- ``question_answer``: ours (JSONL) and AgentFly's (a JSON list of rows): ``question`` and
  ``answer``; every other field is passed to the reward function.
- ``verl``: verl's data-preprocessing examples (parquet): the prompt as a chat-message list under
  ``data.prompt_key`` (default ``prompt``; a plain string is one user message), ``data_source``,
  ``ability``, ``reward_model.ground_truth`` (the answer) and ``extra_info`` (a mapping kept as
  is, so the reward gets it as ``row["extra_info"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from common.registry import Registry


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row and the field."""


@dataclass(frozen=True)
class LayoutOptions:
    """Config keys that shape how rows are read (``data.*``)."""

    prompt_key: str = "prompt"
    """The field of a verl row that holds the prompt (``data.prompt_key``)."""


DEFAULT_LAYOUT = LayoutOptions()


class RowLayout:
    """One layout: which rows it claims and how it adapts them."""

    name: ClassVar[str]
    priority: ClassVar[int]
    """Lower asks first."""
    identified_by: ClassVar[str]
    """The fields that identify it, for the message about a row no layout claims."""

    def claims(self, row: Mapping[str, Any], options: LayoutOptions) -> bool:
        raise NotImplementedError

    def adapt(self, row: dict[str, Any], where: str, options: LayoutOptions) -> dict[str, Any]:
        raise NotImplementedError


LAYOUTS: Registry[RowLayout] = Registry("row layout")

_ROLES = ("system", "user", "assistant", "tool")


def _show(value: Any) -> str:
    if value is None:
        return "nothing (missing or null)"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _check_answer(answer: Any, where: str, field: str) -> None:
    if isinstance(answer, bool) or not isinstance(answer, str | int | float | list):
        raise DataError(
            f"{where}: field {field!r}: expected a string, number or list, got {_show(answer)}"
        )


def _check_names(row: Mapping[str, Any], where: str) -> None:
    for key in ("data_source", "agent", "reward_fn"):
        value = row.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise DataError(
                f"{where}: field {key!r}: expected a non-empty string, got {_show(value)}"
            )


class QuestionAnswer(RowLayout):
    """Ours and AgentFly's: ``question`` (the task) and ``answer`` (the reference)."""

    name = "question_answer"
    priority = 0
    identified_by = "'question' (ours, AgentFly's)"

    def claims(self, row: Mapping[str, Any], options: LayoutOptions) -> bool:
        return "question" in row

    def adapt(self, row: dict[str, Any], where: str, options: LayoutOptions) -> dict[str, Any]:
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise DataError(
                f"{where}: field 'question': expected a non-empty string, got {_show(question)}"
            )
        _check_answer(row.get("answer"), where, "answer")
        _check_names(row, where)
        return row


class Verl(RowLayout):
    """verl's: the chat prompt under ``data.prompt_key``, ``reward_model.ground_truth``,
    ``data_source``, ``ability`` and ``extra_info``."""

    name = "verl"
    priority = 1
    identified_by = "data.prompt_key (default 'prompt'; verl's)"

    def claims(self, row: Mapping[str, Any], options: LayoutOptions) -> bool:
        return options.prompt_key in row

    def adapt(self, row: dict[str, Any], where: str, options: LayoutOptions) -> dict[str, Any]:
        key = options.prompt_key
        messages = _chat(row.get(key), where, key)
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: field {key!r}: the chat prompt has no user message")
        adapted = {**row, "messages": messages, "question": users[-1]}
        if "answer" not in row:
            adapted["answer"] = _ground_truth(row, where)
        _check_answer(adapted["answer"], where, "answer")
        extra = row.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise DataError(
                f"{where}: field 'extra_info': expected a mapping or nothing, got {_show(extra)}"
            )
        _check_names(row, where)
        return adapted


def _chat(prompt: Any, where: str, key: str) -> list[dict[str, Any]]:
    """The chat prompt as messages: a list of {role, content}, or a string (one user message)."""
    if isinstance(prompt, str) and prompt.strip():
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(
            f"{where}: field {key!r}: expected a non-empty list of chat messages "
            f"({{role, content}}) or a string, got {_show(prompt)}"
        )
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: field '{key}.{i}': expected a chat message {{role, content}}, "
                f"got {_show(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise DataError(
                f"{where}: field '{key}.{i}.role': expected one of {', '.join(_ROLES)}, "
                f"got {_show(role)}"
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: field '{key}.{i}.content': expected a string, got {_show(content)}"
            )
        # Parquet structs give every message every key of any message (null where absent).
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _ground_truth(row: Mapping[str, Any], where: str) -> Any:
    """``reward_model.ground_truth``; verl's search data puts the answers under ``target``."""
    model = row.get("reward_model")
    if not isinstance(model, dict):
        raise DataError(
            f"{where}: field 'reward_model': expected a mapping with 'ground_truth' "
            f"(or give the row an 'answer'), got {_show(model)}"
        )
    truth = model.get("ground_truth")
    if isinstance(truth, dict) and "target" in truth:
        truth = truth["target"]
    tolist = getattr(truth, "tolist", None)  # a numpy array from a pandas-written parquet
    if callable(tolist):
        truth = tolist()
    if truth is None or isinstance(truth, bool) or not isinstance(truth, str | int | float | list):
        raise DataError(
            f"{where}: field 'reward_model.ground_truth': expected a string, number or list, "
            f"got {_show(truth)}"
        )
    return truth


for _layout in (QuestionAnswer(), Verl()):
    LAYOUTS.register(_layout.name)(_layout)


def _ordered() -> list[RowLayout]:
    return sorted((LAYOUTS.get(n) for n in LAYOUTS.names()), key=lambda lay: lay.priority)


def layout_of(row: Mapping[str, Any], options: LayoutOptions = DEFAULT_LAYOUT) -> str | None:
    """The name of the layout that claims ``row``; None when none does."""
    for layout in _ordered():
        if layout.claims(row, options):
            return layout.name
    return None


def adapt_row(row: Any, where: str, options: LayoutOptions = DEFAULT_LAYOUT) -> dict[str, Any]:
    """``row`` adapted by the first layout that claims it; ``DataError`` naming ``where`` and the
    field when it is unusable or no layout claims it."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object (a row of fields), got {type(row).__name__}")
    for layout in _ordered():
        if layout.claims(row, options):
            return layout.adapt(row, where, options)
    fields = ", ".join(repr(k) for k in list(row)[:12]) or "none"
    known = "; ".join(f"{lay.name}: {lay.identified_by}" for lay in _ordered())
    raise DataError(
        f"{where}: field 'question' (or {options.prompt_key!r}): missing; no row layout knows "
        f"this row's fields ({fields}); the layouts are identified by {known}"
    )
