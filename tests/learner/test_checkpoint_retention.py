"""Checkpoint retention: the newest N (verl's trainer.max_actor_ckpt_to_keep), and the best by
validation reward when asked; only complete checkpoints count."""

from __future__ import annotations

from pathlib import Path

from learner import checkpoints


def _save(root: Path, step: int, val_reward: float | None, keep: int, keep_best: bool) -> None:
    staging = checkpoints.staging_dir(root, step)
    (staging / "shard").write_bytes(b"x")
    state = {"step": step, "policy_version": step, "val_reward": val_reward}
    checkpoints.finalize(root, staging, step, state, keep=keep, keep_best=keep_best)


def test_keeps_the_newest(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, None, keep=2, keep_best=False)
    assert checkpoints.steps(tmp_path) == [6, 8]
    assert checkpoints.latest(tmp_path) == checkpoints.step_dir(tmp_path, 8)


def test_keeps_the_best_by_validation_too(tmp_path: Path) -> None:
    for step, reward in ((2, 0.1), (4, 0.7), (6, 0.3), (8, 0.2)):
        _save(tmp_path, step, reward, keep=1, keep_best=True)
    assert checkpoints.steps(tmp_path) == [4, 8]
    # a later, better one takes its place
    _save(tmp_path, 10, 0.9, keep=1, keep_best=True)
    assert checkpoints.steps(tmp_path) == [10]


def test_a_half_written_checkpoint_is_not_counted(tmp_path: Path) -> None:
    checkpoints.staging_dir(tmp_path, 3)  # a learner killed while saving step 3
    for step in (2, 4):
        _save(tmp_path, step, None, keep=1, keep_best=False)
    assert checkpoints.steps(tmp_path) == [4]
