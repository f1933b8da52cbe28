"""Chat messages -> token ids with the model's own chat template, prefix-stably.

Design: the prompt is rendered once; after that the context only grows by appending. Model turns
are appended as the exact ids the engine sampled; tool turns are appended as the *delta* the chat
template adds for them: the ids that follow an assistant turn's end-of-turn token in a rendering
of (fixed conversation + tool messages + generation prompt). That delta starts right after the
model's own end token (``<|im_end|>``), so it includes the template's newline and ends with the
next assistant header; nothing the model produced is ever re-tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A fixed conversation ending in an assistant turn: tool messages rendered after it give the delta.
_BASE: list[dict[str, Any]] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


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

    def _turn_end_cut(self) -> int:
        base = _ids(self.tok.apply_chat_template(_BASE, tokenize=True))
        ends = [i for i, t in enumerate(base) if t == self.eos_id]
        if not ends:
            raise ValueError("the chat template does not end an assistant turn with the eos token")
        return ends[-1] + 1

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        return _ids(
            self.tok.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                tokenize=True,
                add_generation_prompt=True,
            )
        )

    def tool_delta_ids(self, tool_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids to append after a model turn that ended with eos: the tool turn(s) and the header
        of the next assistant turn."""
        full = _ids(
            self.tok.apply_chat_template(
                _BASE + list(tool_messages), tokenize=True, add_generation_prompt=True
            )
        )
        return full[self._base_cut :]

    def text_ids(self, text: str) -> list[int]:
        """Plain text (no template) as ids: what an agent inserts mid-turn (sandbox output)."""
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def turn_text(self, ids: Sequence[int]) -> str:
        """The text of a model turn for the transcript and the parser: without its end token."""
        ids = list(ids)
        if ids and (ids[-1] == self.eos_id or ids[-1] in self._special):
            ids.pop()  # the end token (<|im_end|>, or another end token such as <|endoftext|>)
        return self.decode(ids)
