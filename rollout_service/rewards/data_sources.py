"""verl's data sources and the reward each gets here, so a verl parquet's ``data_source`` chooses
the reward as it does in verl (``verl.utils.reward_score.default_compute_score``).

A row's reward is its own ``reward_fn``, else ``rollout_server.reward_by_data_source`` for its data
source, else this table, else ``rollout_server.reward_fn``. verl's code sources (apps, taco,
codecontests...) are not listed: their ground truth is verl's test-case JSON, which the ``code``
reward does not read (it reads ``tests``); name their reward in ``reward_by_data_source``. Nor is
verl's plain ``math``: our own data names sources ``math`` with rewards of its choosing.
"""

from __future__ import annotations

_MATH = (
    "openai/gsm8k",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math_dapo_reasoning",
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
_SEARCH_QA = (  # verl's search_r1 scorer: exact match
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)

DATA_SOURCE_REWARDS: dict[str, str] = {
    **dict.fromkeys(_MATH, "math"),
    **dict.fromkeys(_SEARCH_QA, "qa_em"),
}
"""verl data source -> our reward function (registry name)."""


def reward_for_data_source(data_source: str) -> str | None:
    """The reward verl would choose for ``data_source`` (AIME sources included); None: not verl's."""
    if data_source in DATA_SOURCE_REWARDS:
        return DATA_SOURCE_REWARDS[data_source]
    if data_source.startswith("aime"):
        return "math"
    return None
