"""Per-turn credit (`rollouter.credit = "turn"`): each turn's tokens take the group-relative
advantage of that turn's return, computed from `MessageEnv.turn_rewards`."""

from __future__ import annotations

import pytest

from examples.alphabet_sort import AlphabetSortTask
from tests.rollout.rollout_testlib import CountingEnv, ScriptedGenerate, run, tiny_tokenizer
from torchtitan_rl.rollout import Rollouter, RolloutStatus, rollout_group_to_training_samples
from torchtitan_rl.types import Sampling


def _rollout_and_turn(request_id: str) -> tuple[int, int]:
    parts = dict(p.split("=") for p in request_id.split("/"))
    return int(parts["rollout"]), int(parts["turn"])


# rollout r says "yes" on turn t when YES[r][t]: rollouts 0 and 1 have the same total (1), so
# one advantage per rollout cannot tell them apart, but turn by turn it can.
YES = [[1, 0], [0, 1], [1, 1], [0, 0]]


def _group(**overrides):  # type: ignore[no-untyped-def]
    gen = ScriptedGenerate(lambda rid, _: "yes" if YES[_rollout_and_turn(rid)[0]][
        _rollout_and_turn(rid)[1]] else "no")
    cfg = Rollouter.Config(**{"group_size": 4, "step_timeout_s": 5.0,
                              "advantage_std": "none", **overrides})
    rollouter = cfg.build(tokenizer=tiny_tokenizer(), make_env=lambda _: CountingEnv(2))
    return run(rollouter.run_group_rollouts(gen, {"episode_id": "e"}, 3,
                                            sampling=Sampling(max_tokens=8, seed=1)))


def test_turn_credit_reward_to_go_and_immediate() -> None:
    group = _group(credit="turn")  # gamma 1: G_0 = r_0 + r_1, G_1 = r_1
    assert [[t.reward for t in r.turns] for r in group.rollouts] == [
        [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    # turn 0 returns [1, 1, 2, 0] (mean 1), turn 1 returns [0, 1, 1, 0] (mean 0.5)
    assert [[t.advantage for t in r.turns] for r in group.rollouts] == [
        [0.0, -0.5], [0.0, 0.5], [1.0, 0.5], [-1.0, -0.5]]
    assert group.advantages == [0.0, 0.0, 1.0, -1.0]  # the rollout's own, kept for the record
    samples = rollout_group_to_training_samples(group)
    for sample, rollout in zip(samples, group.rollouts, strict=True):
        trained = [a for a, m in zip(sample.advantages, sample.loss_mask) if m]
        expected = [t.advantage for t in rollout.turns for _ in t.completion_token_ids]
        assert trained == expected

    immediate = _group(credit="turn", turn_discount=0.0)  # G_t = r_t
    assert [[t.advantage for t in r.turns] for r in immediate.rollouts] == [
        [0.5, -0.5], [-0.5, 0.5], [0.5, 0.5], [-0.5, -0.5]]


def test_turn_credit_keeps_a_group_whose_totals_tie() -> None:
    global YES
    saved, YES = YES, [[1, 0], [0, 1], [1, 0], [0, 1]]
    try:
        assert _group().dropped and _group().drop_reason == "zero_std"  # totals all 1
        group = _group(credit="turn", turn_discount=0.0)
        assert not group.dropped
        assert rollout_group_to_training_samples(group)
    finally:
        YES = saved


def test_rollout_credit_leaves_turn_advantages_unset() -> None:
    group = _group()
    assert all(t.advantage is None and t.reward is None for r in group.rollouts for t in r.turns)


def test_alphabet_sort_turn_rewards_are_the_turn_scores() -> None:
    task = AlphabetSortTask.Config(min_turns=2, max_turns=2).build()
    episode = task.dataset("train")[0]
    env = task.make_env(episode)
    from examples.alphabet_sort.solutions import solved_reply

    replies = [solved_reply(episode, 0), "no answer"]
    parts = [{"turn_score": 1.0}, {"turn_score": 0.0}]
    assert env.turn_rewards(replies, parts) == [1.0, 0.0]  # a one-turn episode's scale
    assert env.score(replies, parts) == pytest.approx(0.5)  # their mean

    powered_mean = AlphabetSortTask.Config(min_turns=2, max_turns=2,
                                           power_per_turn=False).build()
    with pytest.raises(ValueError, match="power_per_turn"):
        powered_mean.make_env(episode).turn_rewards(replies, parts)


def test_bad_turn_rewards_error_the_rollout_not_the_run() -> None:
    class WrongLength(CountingEnv):
        def turn_rewards(self, replies, reward_parts):  # type: ignore[no-untyped-def]
            return [1.0]

    gen = ScriptedGenerate(lambda rid, _: "yes")
    cfg = Rollouter.Config(group_size=2, credit="turn")
    rollouter = cfg.build(tokenizer=tiny_tokenizer(), make_env=lambda _: WrongLength(2))
    group = run(rollouter.run_group_rollouts(gen, {"episode_id": "e"}, 0,
                                             sampling=Sampling(max_tokens=8)))
    assert [r.status for r in group.rollouts] == [RolloutStatus.ERROR_ENV] * 2
    assert group.rollouts[0].error.startswith(
        "turn_rewards() returned 1 rewards for 2 turns (one per turn expected) at "
        "tests/rollout/test_rollout_turn_credit.py:89 (")
    assert group.dropped and group.drop_reason == "all_errored"


def test_credit_config_errors() -> None:
    with pytest.raises(ValueError, match="credit"):
        Rollouter.Config(credit="episode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="turn_discount"):
        Rollouter.Config(turn_discount=1.5)


def test_a_counted_errored_rollout_keeps_its_rollout_advantage() -> None:
    # rollout 3's env breaks on turn 1; error_reward 0 still counts it in the rollout baseline
    made = iter(range(4))

    def make_env(_):  # type: ignore[no-untyped-def]
        return CountingEnv(2, fail_on_turn=1 if next(made) == 3 else None)

    gen = ScriptedGenerate(lambda rid, _: "yes" if YES[_rollout_and_turn(rid)[0]][
        _rollout_and_turn(rid)[1]] else "no")
    cfg = Rollouter.Config(group_size=4, step_timeout_s=5.0, advantage_std="none",
                           credit="turn", turn_discount=0.0, error_reward=0.0)
    group = run(cfg.build(tokenizer=tiny_tokenizer(), make_env=make_env).run_group_rollouts(
        gen, {"episode_id": "e"}, 3, sampling=Sampling(max_tokens=8, seed=1)))
    errored = group.rollouts[3]
    assert errored.status is RolloutStatus.ERROR_ENV and errored.advantage is not None
    assert all(t.advantage is None for t in errored.turns)  # packing uses the rollout's
    # the turns' baselines are the three scored rollouts only: turn 0 rewards [1, 0, 1]
    assert [r.turns[0].advantage for r in group.rollouts[:3]] == pytest.approx(
        [1 / 3, -2 / 3, 1 / 3])
    samples = rollout_group_to_training_samples(group)
    last = [s for s in samples if "rollout=3" in s.sample_id][0]
    assert {a for a, m in zip(last.advantages, last.loss_mask) if m} == {errored.advantage}
