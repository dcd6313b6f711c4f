"""The eval report: per-turn rewards from the environment's reward parts, pass@k, the key=value line."""

from __future__ import annotations

import math

import pytest

from torchtitan_rl.eval.report import summarize
from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutStatus, RolloutTurn


def _rollout(group_id: int, index: int, reward: float, turn_scores: list[float]) -> Rollout:
    turns = [RolloutTurn(turn_index=t, request_id=f"g{group_id}/r{index}/t{t}",
                         prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[0.0],
                         policy_versions=[0], finish_reason="stop",
                         reward_parts={"turn_score": s})
             for t, s in enumerate(turn_scores)]
    return Rollout(group_id=group_id, rollout_index=index, status=RolloutStatus.COMPLETED,
                   turns=turns, reward=reward)


def test_pass_at_k_and_per_turn_rewards_by_hand():
    groups = [
        # episode 0: one of two samples perfect
        RolloutGroup(group_id=0, episode=None, rollouts=[
            _rollout(0, 0, 1.0, [1.0, 1.0]), _rollout(0, 1, 0.5, [1.0, 0.0])]),
        # episode 1: none perfect; the second sample stopped after turn 1
        RolloutGroup(group_id=1, episode=None, rollouts=[
            _rollout(1, 0, 0.75, [0.5, 1.0]), _rollout(1, 1, 0.0, [0.0])]),
    ]
    report = summarize(groups, reward_mean=0.5625, reward_stderr=0.2, pass_threshold=1.0)
    assert report.num_episodes == 2 and report.samples_per_episode == 2
    assert report.num_rollouts == 4
    assert report.pass_at_1 == pytest.approx((1 / 2 + 0 / 2) / 2)
    assert report.pass_at_k == pytest.approx(1 / 2)
    assert report.episode_rewards == pytest.approx([0.75, 0.375])
    [turn1, turn2] = report.per_turn
    assert (turn1.turn, turn1.part, turn1.num_rollouts) == (1, "turn_score", 4)
    assert turn1.mean == pytest.approx(2.5 / 4)
    assert turn1.stderr == pytest.approx(
        math.sqrt(sum((x - 0.625) ** 2 for x in [1.0, 1.0, 0.5, 0.0]) / 3) / 2)
    assert (turn2.turn, turn2.num_rollouts) == (2, 3) and turn2.mean == pytest.approx(2 / 3)
    lines = report.lines()
    assert lines[0] == "reward: 0.5625 +- 0.2000 (2 episodes x 2 samples = 4 rollouts)"
    assert lines[1].startswith("turn 1: turn_score 0.6250 +- ")
    assert lines[-1] == ("reward_mean=0.5625 reward_stderr=0.2000 pass@1=0.2500 pass@2=0.5000 "
                         "turn1_turn_score=0.6250 turn2_turn_score=0.6667 rollouts=4")
    # a lower threshold passes more
    assert summarize(groups, reward_mean=0.5, reward_stderr=0.0,
                     pass_threshold=0.5).pass_at_k == 1.0


def test_one_sample_per_episode_reports_pass_at_1_only():
    groups = [RolloutGroup(group_id=i, episode=None, rollouts=[_rollout(i, 0, r, [])])
              for i, r in enumerate([1.0, 0.2, 1.0])]
    report = summarize(groups, reward_mean=0.7333, reward_stderr=0.1)
    assert report.per_turn == [] and report.pass_at_1 == pytest.approx(2 / 3)
    assert report.lines()[-1] == "reward_mean=0.7333 reward_stderr=0.1000 pass@1=0.6667 rollouts=3"
    with pytest.raises(ValueError, match="no validation groups"):
        summarize([], reward_mean=0.0, reward_stderr=0.0)
