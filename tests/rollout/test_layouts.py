"""Row layouts (rollout_service/layouts.py): verl's parquet, AgentFly's JSON list and our JSONL,
read as users have them (real files written by the tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config.training import DataConfig
from rollout_service.agents.base import initial_messages
from rollout_service.data import DataError, PromptSource, load_rows
from rollout_service.groups import RewardChoice
from rollout_service.layouts import LAYOUTS, LayoutOptions, layout_of

SYSTEM = "You are a careful math tutor. Put the final answer after ####."


def verl_rows(n: int, *, data_source: str = "openai/gsm8k") -> list[dict[str, Any]]:
    """What verl's examples/data_preprocess/gsm8k.py writes (a system message added)."""
    return [
        {
            "data_source": data_source,
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}"},
        }
        for i in range(n)
    ]


def write_verl_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_agentfly_json(path: Path, n: int) -> Path:
    """AgentFly's training data: a JSON list of question/answer rows (seed 002)."""
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]
    path.write_text(json.dumps(rows, indent=4))
    return path


def test_the_registry_lists_the_layouts() -> None:
    assert LAYOUTS.names() == ["question_answer", "verl"]
    assert layout_of({"question": "q", "answer": 1}) == "question_answer"
    assert layout_of(verl_rows(1)[0]) == "verl"
    assert layout_of({"text": "x"}) is None


def test_verl_parquet_is_read_as_is(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", verl_rows(4))
    rows = load_rows(path)
    row = rows[3]
    # The chat prompt is kept as messages (rendered with the chat template as given), not flattened.
    assert row["messages"] == verl_rows(4)[3]["prompt"]
    assert initial_messages(row, "an agent's own system prompt") == row["messages"]
    assert row["question"] == "What is 3 + 3?"  # the user's text, for agents that need text
    assert row["answer"] == "6"  # reward_model.ground_truth
    assert row["extra_info"] == {"split": "train", "index": 3, "answer": "#### 6"}
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    source = PromptSource.from_config(
        DataConfig(train_files=[str(path)], shuffle=False), shard_index=0, shard_count=1
    )
    item = next(iter(source))
    assert item.data_source == "openai/gsm8k" and item.row["answer"] == "0"
    # data_source chooses the reward as in verl; the config's table and the row's own win.
    assert RewardChoice("qa_f1").name_for(item.row, item.data_source) == "math"
    assert RewardChoice("qa_f1").name_for(item.row, "searchR1_nq") == "qa_em"
    assert RewardChoice("math").name_for(item.row, "mine") == "math"
    assert RewardChoice("math", {"openai/gsm8k": "qa_f1"}).name_for(item.row, "openai/gsm8k") == (
        "qa_f1"
    )


def test_verl_search_targets_and_plain_string_prompts(tmp_path: Path) -> None:
    rows = [
        {
            "data_source": "searchR1_nq",
            "prompt": "Who wrote Hamlet?",
            "reward_model": {"ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}},
        }
    ]
    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    (row,) = load_rows(path)
    assert row["messages"] == [{"role": "user", "content": "Who wrote Hamlet?"}]
    assert row["answer"] == ["Shakespeare", "William Shakespeare"]


def test_prompt_key_names_the_prompt_column(tmp_path: Path) -> None:
    rows = [{("chat" if k == "prompt" else k): v for k, v in r.items()} for r in verl_rows(2)]
    path = write_verl_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(DataError, match=r"t\.parquet: row 0: field 'question' \(or 'prompt'\)"):
        load_rows(path)
    loaded = load_rows(path, options=LayoutOptions(prompt_key="chat"))
    assert loaded[1]["messages"][0] == {"role": "system", "content": SYSTEM}
    source = PromptSource.from_config(
        DataConfig(train_files=[str(path)], prompt_key="chat"), shard_index=0, shard_count=1
    )
    assert len(source.rows) == 2


def test_agentfly_json_list_is_read_as_is(tmp_path: Path) -> None:
    path = write_agentfly_json(tmp_path / "gsm8k_train.json", 3)
    rows = load_rows(path)
    assert rows[2] == {"question": "What is 2 + 2?", "answer": "4"}
    assert initial_messages(rows[2], None) == [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.pop("reward_model"), "reward_model"),
        (lambda r: r.update(reward_model={"style": "rule"}), "reward_model.ground_truth"),
        (lambda r: r.update(prompt=[]), "prompt"),
        (lambda r: r.update(prompt=[{"role": "boss", "content": "x"}]), "prompt.0.role"),
        (lambda r: r.update(prompt=[{"role": "user", "content": 3}]), "prompt.0.content"),
        (lambda r: r.update(prompt=[{"role": "system", "content": "x"}]), "prompt"),
        (lambda r: r.update(extra_info="x"), "extra_info"),
        (lambda r: r.update(data_source=""), "data_source"),
    ],
)
def test_a_bad_verl_row_names_file_row_and_field(tmp_path: Path, change: Any, field: str) -> None:
    rows = verl_rows(3)
    change(rows[2])
    path = tmp_path / "bad.jsonl"  # JSONL: parquet would give every row the same columns
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_rows(path)
    assert f"{path}: line 3: field '{field}'" in str(e.value)
