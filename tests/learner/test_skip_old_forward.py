"""Old logprobs from the update's own forward (``off_policy.skip_old_logprob_forward: auto``) equal
the separate old-logprob forward (``never``): one training step of the real trainer code
(`Trainer._prepare` + `Trainer._update`, two FSDP2 workers on gloo, tiny model) gives the same
metrics (losses, importance weights, logprob_diff, grad norm) and the same updated parameters
within 1e-6 (after two optimizer steps, nearly all of them), with one mini-batch or with two (the first's old
logprobs from the update, the second's from a forward of its own samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

OWN_RAY_CLUSTER = True  # tests/conftest.py: runs in the serial pass

pytestmark = pytest.mark.e2e


def trajectories(seed: int = 0, groups: int = 2, n: int = 4) -> list[Any]:
    """Mixed lengths, tool-token holes, and rollout logprobs far enough from the model's that some
    importance weights are truncated."""
    from protocol.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 500, int(rng.integers(3, 10))).astype(np.int32)
        for i in range(n):
            r = int(rng.integers(2, 40))
            mask = (rng.random(r) > 0.2).astype(np.uint8)
            logp = np.where(mask == 1, -rng.random(r) * 12, 0.0).astype(np.float32)
            out.append(
                Trajectory(
                    trajectory_id=f"t{g}-{i}",
                    group_uid=f"g{g}",
                    prompt_ids=prompt,
                    response_ids=rng.integers(0, 500, r).astype(np.int32),
                    response_mask=mask,
                    rollout_logprobs=logp,
                    versions=np.zeros(r, np.int32),
                    reward=float(rng.random()),
                )
            )
    return out


def trainer_for(model: Path, run_dir: Path, overrides: list[str]) -> Any:
    """The real `Trainer` of a one-step run of ``trajectories()`` (2 groups of 4, 2 gloo ranks),
    with its algorithm state and its (not yet started) workers."""
    from common.config.loader import load_config
    from learner.trainer import Trainer
    from learner.workers import WorkerGroup

    config = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{run_dir / 'none.jsonl'}]",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.rollout.temperature=0.8",
            "trainer.n_gpus_per_node=2",
            "trainer.device=cpu",
            "trainer.total_training_steps=1",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
        check_paths=False,
    )
    trainer = Trainer(config, run_dir)
    trainer._init_algorithm_state(None)
    trainer.workers = WorkerGroup(trainer.settings, trainer.world)
    return trainer


async def one_step(
    model: Path, run_dir: Path, overrides: list[str]
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    from common.safetensors_buffers import load_dir
    from learner.prepare import to_samples
    from learner.worker_api import WeightsRequest

    trainer = trainer_for(model, run_dir, overrides)
    try:
        await trainer.workers.start()
        trajs = trajectories()
        samples = to_samples(trajs)
        metrics = await trainer._prepare(trajs, samples, None)
        metrics |= (await trainer._update(samples)).metrics
        names = [t.name for t in load_dir(model)]
        weights = await trainer.workers.full_weights(WeightsRequest(names))
        return metrics, {n: a for n, _, _, a in weights}
    finally:
        trainer.workers.shutdown()


@pytest.mark.parametrize(
    "extra",
    [
        # packed, token-capped micro-batches (the defaults), per-token importance weights
        ["actor_rollout_ref.actor.off_policy.is_level=token"],
        # padded, fixed-size micro-batches, sequence-level weights, KL loss (reference forward), entropy
        [
            "actor_rollout_ref.actor.off_policy.is_level=sequence",
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        ],
        # two mini-batches: the first's old logprobs from the update, the second's from a forward
        # of its samples alone, cut as the update cuts them
        [
            "actor_rollout_ref.actor.off_policy.is_level=token",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ],
    ],
    ids=["packed-token", "padded-sequence-kl", "two-mini-batches-kl"],
)
def test_skipping_the_old_logprob_forward_changes_nothing(
    tiny_model: Path, ray_cluster: Any, tmp_path: Path, extra: list[str]
) -> None:
    key = "actor_rollout_ref.actor.off_policy.skip_old_logprob_forward"
    m_skip, w_skip = anyio.run(
        lambda: one_step(tiny_model, tmp_path / "skip", [*extra, f"{key}=auto"])
    )
    m_full, w_full = anyio.run(
        lambda: one_step(tiny_model, tmp_path / "full", [*extra, f"{key}=never"])
    )
    assert m_skip.keys() == m_full.keys()
    for k in (
        "actor/pg_loss",
        "actor/grad_norm",
        "off_policy/is_weight_mean",
        "off_policy/is_truncated_frac",
        "off_policy/is_weight_max",
        "rollout/logprob_diff",
        "advantages/mean",
    ):
        assert k in m_skip, k
    assert 0 < m_full["off_policy/is_truncated_frac"] < 1, "some weights truncated, some not"
    for k in m_full:
        # is_weight_max is the untruncated weight: exp of a sum of up to 40 float32 log-ratios (here
        # about 760, a log of 6.6), summed over rows of different padded widths on the two paths;
        # float32 rounding of that sum alone is ~1e-6 in the log, so 1e-5 relative after the exp.
        rel = 1e-5 if k == "off_policy/is_weight_max" else 1e-6
        assert m_skip[k] == pytest.approx(m_full[k], abs=1e-6, rel=rel), k
    from safetensors.numpy import load_file

    before = load_file(str(tiny_model / "model.safetensors"))
    assert max(float(np.abs(w_full[n] - before[n]).max()) for n in w_full) > 1e-4, (
        "the step moved the weights"
    )
    if "actor_rollout_ref.actor.ppo_mini_batch_size=4" not in extra:
        for n in w_full:
            np.testing.assert_allclose(w_skip[n], w_full[n], atol=1e-6, rtol=0, err_msg=n)
        return
    # Two optimizer steps: the old logprobs come from other micro-batches on the two paths (all
    # samples in one with `never`, each mini-batch's own with `auto`), which changes them by float32
    # rounding (~1e-7). Adam's second step divides each gradient by the root of a second moment
    # that two steps barely filled, so for a weight whose gradient is near zero that rounding moves
    # the step by a visible part of lr (1e-3); every other weight agrees to 1e-6.
    diff = np.concatenate([np.abs(w_skip[n] - w_full[n]).ravel() for n in w_full])
    assert (diff <= 1e-6).mean() > 0.999 and diff.max() < 5e-5, (diff.max(), (diff > 1e-6).sum())
