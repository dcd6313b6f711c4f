"""Packing a rollout's turns into TrainingSamples: merge on prefix, branch on a break."""

from __future__ import annotations

import math

from torchtitan_rl.rollout import (
    Rollout,
    RolloutGroup,
    RolloutStatus,
    RolloutTurn,
    rollout_group_to_training_samples,
    rollout_to_training_samples,
    split_branches,
)


def _turn(t: int, prompt: list[int], completion: list[int], *, version: int = 1,
          finish: str = "stop", logprob: float = -0.5) -> RolloutTurn:
    return RolloutTurn(
        turn_index=t, request_id=f"group=3/rollout=1/turn={t}", prompt_token_ids=prompt,
        completion_token_ids=completion, completion_logprobs=[logprob] * len(completion),
        policy_versions=[version] * len(completion), finish_reason=finish,  # type: ignore[arg-type]
    )


def _rollout(turns: list[RolloutTurn], advantage: float | None = 0.5) -> Rollout:
    return Rollout(group_id=3, rollout_index=1, status=RolloutStatus.COMPLETED, turns=turns,
                   advantage=advantage)


def test_packing_one_turn_masks_prompt_and_trains_completion() -> None:
    [s] = rollout_to_training_samples(_rollout([_turn(0, [10, 11, 12], [20, 21])]))
    assert s.sample_id == "group=3/rollout=1/branch=0"
    assert s.group_id == 3
    assert s.token_ids == [10, 11, 12, 20, 21]
    assert s.loss_mask == [0, 0, 0, 1, 1]
    assert s.generator_logprobs == [0.0, 0.0, 0.0, -0.5, -0.5]
    assert s.advantages == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert s.policy_versions == [-1, -1, -1, 1, 1]


def test_packing_three_turns_merge_into_one_sample() -> None:
    turns = [
        _turn(0, [1, 2], [3, 4], version=1),
        _turn(1, [1, 2, 3, 4, 5, 6], [7], version=2),
        _turn(2, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], version=3),
    ]
    [s] = rollout_to_training_samples(_rollout(turns, advantage=-1.0))
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert s.policy_versions == [-1, -1, 1, 1, -1, -1, 2, -1, 3, 3]
    assert s.advantages == [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, -1.0, 0.0, -1.0, -1.0]
    assert s.oldest_policy_version == 1


def test_packing_broken_prefix_starts_a_branch() -> None:
    turns = [
        _turn(0, [1, 2], [3]),
        _turn(1, [1, 2, 3, 4], [5]),
        _turn(2, [1, 9, 4], [6]),  # history edited: does not extend [1, 2, 3, 4, 5]
        _turn(3, [1, 9, 4, 6, 7], [8]),
    ]
    assert [len(b) for b in split_branches(turns)] == [2, 2]
    s0, s1 = rollout_to_training_samples(_rollout(turns))
    assert (s0.sample_id, s1.sample_id) == ("group=3/rollout=1/branch=0",
                                            "group=3/rollout=1/branch=1")
    assert s0.token_ids == [1, 2, 3, 4, 5] and s0.loss_mask == [0, 0, 1, 0, 1]
    assert s1.token_ids == [1, 9, 4, 6, 7, 8] and s1.loss_mask == [0, 0, 0, 1, 0, 1]


def test_packing_truncated_last_turn_is_trained_as_generated() -> None:
    turns = [_turn(0, [1], [2, 3]), _turn(1, [1, 2, 3, 4], [5, 5, 5], finish="length")]
    rollout = _rollout(turns)
    rollout.status = RolloutStatus.TRUNCATED_LENGTH
    [s] = rollout_to_training_samples(rollout)
    assert s.token_ids == [1, 2, 3, 4, 5, 5, 5]
    assert s.loss_mask == [0, 1, 1, 0, 1, 1, 1]


def test_packing_keeps_nan_logprobs_as_given() -> None:
    [s] = rollout_to_training_samples(
        _rollout([_turn(0, [1], [2, 3], logprob=float("nan"))]))
    assert s.generator_logprobs[0] == 0.0
    assert all(math.isnan(x) for x in s.generator_logprobs[1:])


def test_packing_excluded_rollout_and_dropped_group_give_nothing() -> None:
    turns = [_turn(0, [1], [2])]
    assert rollout_to_training_samples(_rollout(turns, advantage=None)) == []
    group = RolloutGroup(group_id=3, episode={"episode_id": "x"},
                         rollouts=[_rollout(turns)], dropped=True, drop_reason="zero_std")
    assert rollout_group_to_training_samples(group) == []
    group.dropped = False
    assert len(rollout_group_to_training_samples(group)) == 1


def test_packing_puts_the_reward_a_critic_reads_on_each_turns_last_token() -> None:
    turns = [_turn(0, [1, 2], [3, 4]), _turn(1, [1, 2, 3, 4, 5, 6], [7, 8])]
    episode = _rollout(turns)
    episode.reward = 0.75
    [s] = rollout_to_training_samples(episode)
    assert s.rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.75]  # the episode's, at its end
    turns[0].reward, turns[1].reward = 0.25, 1.0  # per-turn credit: each turn's own
    [s] = rollout_to_training_samples(episode)
    assert s.rewards == [0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 1.0]
    branched = _rollout([_turn(0, [1, 2], [3]), _turn(1, [9, 9], [5])])
    branched.reward = 0.5
    first, second = rollout_to_training_samples(branched)
    assert first.rewards == [0.0, 0.0, 0.0] and second.rewards == [0.0, 0.0, 0.5]
