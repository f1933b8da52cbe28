"""Chat messages -> token ids with the model's own chat template, prefix-stably.

Design: the prompt is rendered once; after that the context only grows by appending. Model turns
are appended as the exact ids the engine sampled; tool turns are appended as the *delta* the chat
template adds for them: the ids that follow an assistant turn's end-of-turn token in a rendering
of (fixed conversation + tool messages + generation prompt). That delta starts right after the
model's own end token (``<|im_end|>``), so it includes the template's newline and ends with the
next assistant header; nothing the model produced is ever re-tokenised.

Both run on the rollout server's event loop once per episode and per tool turn, so they are kept
cheap. A prompt's ids are kept for the next samples of its group (a small LRU keyed by the messages
and tools). A tool delta is text the template puts around each tool message's content: the
template is rendered once per number of tool messages with placeholders, the static pieces kept,
and each delta becomes those pieces around the contents, tokenised alone. That is exact when the
template copies a content as it is (no trimming or escaping), which a probe checks against the
full rendering before the pieces are used; otherwise, and for tool messages with fields besides
``role`` and ``content``, every delta is rendered in full. Tokenising the delta alone gives the
ids of the full rendering because the delta follows a special token, where tokenisers split.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# A fixed conversation ending in an assistant turn: tool messages rendered after it give the delta.
_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


PROMPTS_KEPT = 64
"""Rendered prompts kept for the next samples of their group (4 bytes a token, keyed by a digest:
64 prompts of 8k tokens hold 2 MiB)."""
PROBE = " probe \n<b>&amp;\t\"'{}\n "
"""A tool content that a template which trims, escapes or reformats would not copy as it is."""


def _ids(result: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list
    if isinstance(result, dict) or hasattr(result, "keys"):
        result = result["input_ids"]
    return [int(t) for t in result]


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id: cannot find where a turn ends")
        self.eos_id = int(eos)
        self._special = {int(t) for t in tokenizer.all_special_ids}
        self._base_cut = self._turn_end_cut()
        # A fast tokenizer without clean-up decodes in its Rust backend alone (what tok.decode
        # returns, without converting every id on the way in).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if plain and hasattr(backend, "decode") else None
        self._prompts: OrderedDict[bytes, array[int]] = OrderedDict()
        self._delta_parts: dict[int, list[str] | None] = {}  # tool messages -> static pieces

    def _turn_end_cut(self) -> int:
        base = _ids(self.tok.apply_chat_template(_BASE, tokenize=True))
        ends = [i for i, t in enumerate(base) if t == self.eos_id]
        if not ends:
            raise ValueError("the chat template does not end an assistant turn with the eos token")
        return ends[-1] + 1

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        text = json.dumps([messages, tools or None], sort_keys=True, default=str)
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        ids = self._prompts.get(key)
        if ids is None:
            ids = array(
                "i",
                _ids(
                    self.tok.apply_chat_template(
                        list(messages),
                        tools=list(tools) if tools else None,
                        tokenize=True,
                        add_generation_prompt=True,
                    )
                ),
            )
            self._prompts[key] = ids
            if len(self._prompts) > PROMPTS_KEPT:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(ids)

    def tool_delta_ids(self, tool_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids to append after a model turn that ended with eos: the tool turn(s) and the header
        of the next assistant turn."""
        plain = all(
            set(m) == {"role", "content"} and m["role"] == "tool" and isinstance(m["content"], str)
            for m in tool_messages
        )
        parts = self._pieces(len(tool_messages)) if plain and tool_messages else None
        if parts is None:
            return self._rendered_delta(tool_messages)
        contents = [m["content"] for m in tool_messages]
        return self.text_ids(
            parts[0] + "".join(c + p for c, p in zip(contents, parts[1:], strict=True))
        )

    def _rendered_delta(self, tool_messages: Sequence[dict[str, Any]]) -> list[int]:
        full = _ids(
            self.tok.apply_chat_template(
                _BASE + list(tool_messages), tokenize=True, add_generation_prompt=True
            )
        )
        return full[self._base_cut :]

    def _pieces(self, n: int) -> list[str] | None:
        """The delta's static text around ``n`` tool contents, or None where the template does
        not copy contents as they are (see the module docstring)."""
        if n in self._delta_parts:
            return self._delta_parts[n]
        marks = [f"\x00tool-content-{i}\x00" for i in range(n)]
        text = self.tok.apply_chat_template(
            _BASE + [{"role": "tool", "content": m} for m in marks],
            tokenize=False,
            add_generation_prompt=True,
        )
        eos = self.tok.convert_ids_to_tokens(self.eos_id)
        parts: list[str] | None = None
        if isinstance(text, str) and all(text.count(m) == 1 for m in marks):
            cut = text.rfind(eos, 0, text.index(marks[0]))
            if cut >= 0:
                pieces, rest = [], text[cut + len(eos) :]
                for m in marks:
                    head, rest = rest.split(m)
                    pieces.append(head)
                parts = [*pieces, rest]
                probe = [{"role": "tool", "content": f"{PROBE}{i}"} for i in range(n)]
                fast = parts[0] + "".join(f"{PROBE}{i}" + p for i, p in enumerate(parts[1:]))
                if self.text_ids(fast) != self._rendered_delta(probe):
                    parts = None
        self._delta_parts[n] = parts
        return parts

    def text_ids(self, text: str) -> list[int]:
        """Plain text (no template) as ids: what an agent inserts mid-turn (sandbox output)."""
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def turn_text(self, ids: Sequence[int]) -> str:
        """The text of a model turn for the transcript and the parser: without its end token."""
        ids = list(ids)
        if ids and (ids[-1] == self.eos_id or ids[-1] in self._special):
            ids.pop()  # the end token (<|im_end|>, or another end token such as <|endoftext|>)
        return self.decode(ids)
