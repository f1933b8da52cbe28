"""Our long-tail rows in verl's RL parquet layout, for bench/vs_verl.py's verl runs: the question
as one chat message (``prompt``), ``data_source``, ``reward_model.ground_truth`` (what our math
reward and bench/verl_plugins/reward.py compare against), ``extra_info`` and the agent loop per row
(``agent_name``: verl's tool agent). Ours reads the same rows from the JSONL, so both sides train on
the same prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def verl_rows(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Our JSONL rows in verl's RL parquet layout, the agent loop chosen per row."""
    return [
        {
            "data_source": str(r.get("data_source", "longtail")),
            "prompt": [{"role": "user", "content": str(r["question"])}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
            "extra_info": {"split": split, "index": i},
            "agent_name": "tool_agent",
        }
        for i, r in enumerate(rows)
    ]


def write_verl_data(src: Path, out: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "val"):
        with (src / f"{split}.jsonl").open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(verl_rows(rows, split)), paths[split])
    return paths
