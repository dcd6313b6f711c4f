"""Validation asks for no more episodes than the task's validation split holds, and measures
the greedy reference when asked."""

from __future__ import annotations

import asyncio

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.loop.validation import (
    GREEDY_REFERENCE_GROUP_OFFSET,
    VALIDATION_GROUP_OFFSET,
    Validator,
)
from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutStatus
from torchtitan_rl.types import Sampling


def test_num_prompts_beyond_the_validation_split_is_one_error_naming_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"validation.num_prompts=5: .* only 3 episodes"):
        Validator.Config(num_prompts=5).build(rollouter=None, dataset=["a", "b", "c"])


def test_num_prompts_up_to_the_split_is_accepted() -> None:
    validator = Validator.Config(num_prompts=3).build(rollouter=None, dataset=["a", "b", "c"])
    assert validator.enabled and validator.config.num_prompts == 3


class _RecordingRollouter:
    """Scores a group 1.0 when sampled greedily and 0.25 otherwise; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []

    async def run_group_rollouts(self, generate_fn, episode, group_id, num_samples, sampling,
                                 attempt=0) -> RolloutGroup:
        self.calls.append((group_id, num_samples, sampling.temperature))
        reward = 1.0 if sampling.temperature == 0 else 0.25
        return RolloutGroup(group_id=group_id, episode=episode, rollouts=[
            Rollout(group_id=group_id, rollout_index=i, status=RolloutStatus.COMPLETED, turns=[],
                    reward=reward) for i in range(num_samples)])


@pytest.mark.parametrize("configured, first", [(True, True), (True, False), (False, True)])
def test_the_greedy_reference_is_measured_once_when_configured(configured: bool,
                                                                first: bool) -> None:
    """The greedy pass runs only at the first validation of a run that asks for it: the same
    episodes, one greedy sample each, under group ids apart from the sampled pass's."""
    rollouter = _RecordingRollouter()
    validator = Validator.Config(num_prompts=2, samples_per_prompt=3, temperature=1.0,
                                 greedy_reference=configured).build(
        rollouter=rollouter, dataset=["a", "b"])
    result = asyncio.run(validator.run(None, Sampling(max_tokens=4), greedy_reference=first))
    sampled = [(VALIDATION_GROUP_OFFSET + i, 3, 1.0) for i in range(2)]
    assert result.reward_mean == 0.25 and result.num_rollouts == 6
    if configured and first:
        assert rollouter.calls == sampled + [(GREEDY_REFERENCE_GROUP_OFFSET + i, 1, 0.0)
                                             for i in range(2)]
        assert result.greedy_reward == 1.0
        assert result.metrics()["validation/greedy_reward"] == 1.0
    else:
        assert rollouter.calls == sampled
        assert result.greedy_reward is None and "validation/greedy_reward" not in result.metrics()
