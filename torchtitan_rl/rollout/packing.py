"""Rollout -> TrainingSample: merge the turns that share a growing prefix; a broken prefix branches.

Example (P prompt tokens, C completion tokens, E env tokens; the env edits history before turn 2):
    turn 0: prompt [P1]            completion [C1]
    turn 1: prompt [P1 C1 E1]      completion [C2]      extends P1 C1 -> same sample
    turn 2: prompt [P2]            completion [C3]      does not extend -> branch 1
    -> group=G/rollout=R/branch=0: [P1 C1 E1 C2]  mask [0 1 0 1]
       group=G/rollout=R/branch=1: [P2 C3]        mask [0 1]
Completion tokens carry mask 1, the generator's logprob (NaN kept as given), their turn's advantage
(per-turn credit) or else the rollout's, and the policy version that sampled them; prompt and env tokens carry 0, 0.0, 0.0 and -1.
The reward a critic's GAE reads sits on one token per turn: each turn's reward on its last
completion token (per-turn credit), else the rollout's reward on its last completion token.
"""

from __future__ import annotations

from torchtitan_rl.rollout.types import Rollout, RolloutGroup, RolloutTurn
from torchtitan_rl.types import TrainingSample


def split_branches(turns: list[RolloutTurn]) -> list[list[RolloutTurn]]:
    """Group consecutive turns whose prompt extends the previous prompt + completion."""
    branches: list[list[RolloutTurn]] = []
    previous: list[int] | None = None
    for turn in turns:
        prompt = turn.prompt_token_ids
        extends = previous is not None and prompt[: len(previous)] == previous
        if extends:
            branches[-1].append(turn)
        else:
            branches.append([turn])
        previous = prompt + turn.completion_token_ids
    return branches


def rollout_to_training_samples(rollout: Rollout) -> list[TrainingSample]:
    """One TrainingSample per branch; none when the rollout is excluded (advantage None)."""
    if rollout.advantage is None:
        return []
    samples: list[TrainingSample] = []
    for branch_index, branch in enumerate(split_branches(rollout.turns)):
        if not any(t.completion_token_ids for t in branch):
            continue
        token_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[float] = []
        advantages: list[float] = []
        versions: list[int] = []
        rewards: list[float] = []
        for turn in branch:
            delta = turn.prompt_token_ids[len(token_ids):]
            completion = turn.completion_token_ids
            if len(turn.completion_logprobs) != len(completion) or len(
                turn.policy_versions
            ) != len(completion):
                raise ValueError(
                    f"{turn.request_id}: {len(completion)} completion tokens but "
                    f"{len(turn.completion_logprobs)} logprobs and "
                    f"{len(turn.policy_versions)} policy versions"
                )
            token_ids += delta + completion
            loss_mask += [0] * len(delta) + [1] * len(completion)
            logprobs += [0.0] * len(delta) + list(turn.completion_logprobs)
            advantage = rollout.advantage if turn.advantage is None else turn.advantage
            advantages += [0.0] * len(delta) + [advantage] * len(completion)
            versions += [-1] * len(delta) + list(turn.policy_versions)
            rewards += [0.0] * (len(delta) + len(completion))
            if completion and turn.reward is not None:  # per-turn credit: the turn's reward
                rewards[-1] = turn.reward
        if branch[-1] is rollout.turns[-1] and rollout.turns[-1].reward is None and any(
                loss_mask):
            # the episode's reward on its last generated token
            rewards[max(i for i, m in enumerate(loss_mask) if m)] = rollout.reward
        samples.append(TrainingSample(
            sample_id=f"{rollout.session_id}/branch={branch_index}",
            group_id=rollout.group_id,
            token_ids=token_ids,
            loss_mask=loss_mask,
            generator_logprobs=logprobs,
            advantages=advantages,
            policy_versions=versions,
            rewards=rewards,
        ))
    return samples


def rollout_group_to_training_samples(group: RolloutGroup) -> list[TrainingSample]:
    """All samples of a group, siblings in order; none for a dropped group."""
    if group.dropped:
        return []
    return [s for rollout in group.rollouts for s in rollout_to_training_samples(rollout)]
