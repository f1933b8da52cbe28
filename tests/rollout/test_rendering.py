"""ChatRenderer's cheap paths give what the full chat-template rendering gives: tool deltas built
from the template's static pieces (for any content, 1-3 tool messages, and not at all for a
template that trims contents), prompts kept for the next samples of a group (a bounded cache whose
lists callers may change), and turns decoded in the tokenizer's backend."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_service.agents import rendering
from rollout_service.agents.rendering import ChatRenderer

CONTENT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80
) | st.sampled_from(["", " ", "\n", "<|im_end|>", "42\n", " spaced  ", "<tool_response>x"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(contents=st.lists(CONTENT, min_size=1, max_size=3))
def test_a_tool_delta_from_the_pieces_is_the_full_renderings(
    renderer: ChatRenderer, contents: list[str]
) -> None:
    messages = [{"role": "tool", "content": c} for c in contents]
    assert renderer.tool_delta_ids(messages) == renderer._rendered_delta(messages)
    assert renderer._delta_parts[len(contents)] is not None  # the pieces were used


def test_a_template_that_trims_contents_is_rendered_in_full(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tok)
    messages = [{"role": "tool", "content": "  padded answer \n"}]
    delta = renderer.tool_delta_ids(messages)
    assert renderer._delta_parts[1] is None  # the probe saw the trimming
    assert (
        renderer.decode(delta)
        == "\n<|im_start|>tool\npadded answer<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_messages_with_more_fields_are_rendered_in_full(renderer: ChatRenderer) -> None:
    messages = [{"role": "tool", "content": "7", "name": "calculator"}]
    assert renderer.tool_delta_ids(messages) == renderer._rendered_delta(messages)


def test_prompts_are_kept_for_the_next_samples_and_the_cache_is_bounded(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rendering, "PROMPTS_KEPT", 4)
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "what is 6*7?"}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    first = renderer.prompt_ids(messages, tools)
    first.append(-1)  # a caller's list is its own
    again = renderer.prompt_ids(messages, tools)
    assert (
        again
        == first[:-1]
        == list(
            tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=True
            )["input_ids"]
        )
    )
    assert renderer.prompt_ids(messages) != again  # the tools are part of the key
    for i in range(10):
        renderer.prompt_ids([{"role": "user", "content": str(i)}])
    assert len(renderer._prompts) == 4


@given(ids=st.lists(st.integers(min_value=0, max_value=511), max_size=60))
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_decoding_in_the_backend_is_the_tokenizers_decode(
    renderer: ChatRenderer, tokenizer: Any, ids: list[int]
) -> None:
    assert renderer._backend is not None
    assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
