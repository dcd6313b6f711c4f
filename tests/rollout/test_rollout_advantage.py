"""Group advantages: the sample std (Bessel) by default, as verl and TRL divide; population and
mean-only (Dr. GRPO) by name; the old ``std_normalize`` key says where it went."""

from __future__ import annotations

import math
import random

import pytest

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import config_from_toml_text, parse_args
from torchtitan_rl.rollout.advantage import STD_EPS, group_advantages
from torchtitan_rl.rollout.rollouter import Rollouter


def _by_hand(values: list[float], ddof: int) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))
    return [(v - mean) / (std + STD_EPS) for v in values]


def test_sample_std_matches_a_hand_computation() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25]
    # mean 0.4375; squared deviations 0.31640625 + 0.19140625 + 0.00390625 + 0.03515625 = 0.546875
    # sample variance 0.546875 / 3, std 0.4269563...
    std = math.sqrt(0.546875 / 3)
    advantages, reason = group_advantages(rewards, [True] * 4, advantage_std="sample")
    assert reason is None
    assert advantages == pytest.approx([(r - 0.4375) / (std + STD_EPS) for r in rewards],
                                       rel=1e-12)
    assert advantages == pytest.approx(_by_hand(rewards, ddof=1), rel=1e-12)


def test_population_and_none_and_random_groups() -> None:
    rng = random.Random(0)
    for _ in range(50):
        rewards = [rng.random() for _ in range(rng.randint(2, 9))]
        counted = [True] * len(rewards)
        sample, _ = group_advantages(rewards, counted, advantage_std="sample")
        population, _ = group_advantages(rewards, counted, advantage_std="population")
        none, _ = group_advantages(rewards, counted, advantage_std="none")
        assert sample == pytest.approx(_by_hand(rewards, ddof=1), rel=1e-9)
        assert population == pytest.approx(_by_hand(rewards, ddof=0), rel=1e-9)
        mean = sum(rewards) / len(rewards)
        assert none == pytest.approx([r - mean for r in rewards], rel=1e-12)


def test_uncounted_rollouts_and_signal_less_groups() -> None:
    # the docstring's example
    advantages, reason = group_advantages([1, 0, 0.5, 0.2], [True, True, True, False],
                                          advantage_std="none")
    assert advantages == [0.5, -0.5, 0.0, None] and reason is None
    advantages, _ = group_advantages([1, 0, 0.5, 0.2], [True, True, True, False],
                                     advantage_std="sample")
    assert advantages[:3] == pytest.approx([0.5 / (0.5 + STD_EPS), -0.5 / (0.5 + STD_EPS), 0.0])
    assert advantages[3] is None
    # one counted reward: zero spread (not an undefined sample std)
    assert group_advantages([0.7, 0.1], [True, False], advantage_std="sample") == (
        [0.0, None], "zero_std")
    assert group_advantages([0.3] * 4, [True] * 4, advantage_std="sample") == (
        [0.0] * 4, "zero_std")
    assert group_advantages([0.3, 0.1], [False, False], advantage_std="sample") == (
        [None, None], "all_errored")
    with pytest.raises(ValueError, match="advantage_std"):
        group_advantages([1.0, 0.0], [True, True], advantage_std="bessel")  # type: ignore[arg-type]


def test_default_is_sample_and_the_old_key_names_its_replacement() -> None:
    assert Rollouter.Config().advantage_std == "sample"
    from torchtitan_rl.controller.job import RLJob

    with pytest.raises(ConfigError) as e:
        config_from_toml_text(RLJob.Config, "[rollouter]\nstd_normalize = false\n")
    assert str(e.value).startswith("rollouter.std_normalize: renamed rollouter.advantage_std")
    with pytest.raises(ConfigError) as e:
        parse_args(RLJob.Config, ["--rollouter.std_normalize", "true"])
    assert "rollouter.advantage_std" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="expected one of 'sample', 'population', 'none'"):
        parse_args(RLJob.Config, ["--rollouter.advantage_std", "bessel"])


def test_the_main_job_keeps_the_mean_baseline() -> None:
    """The main job (docs/main_job.md) was measured with the mean baseline only: it stays so."""
    import pathlib

    from torchtitan_rl.controller.job import RLJob

    root = pathlib.Path(__file__).resolve().parents[2]
    config = parse_args(RLJob.Config,
                        ["--config", str(root / "run_configs" / "alphabet_sort_cpu.toml")]).config
    assert config.rollouter.advantage_std == "none"


def test_rloo_is_leave_one_out_and_grpo_without_std_scaled_by_g_over_g_minus_1() -> None:
    rng = random.Random(1)
    for _ in range(50):
        rewards = [rng.random() for _ in range(rng.randint(2, 9))]
        counted = [rng.random() < 0.8 for _ in rewards]
        counted[0] = counted[1] = True
        rloo, _ = group_advantages(rewards, counted, advantage_std="sample", estimator="rloo")
        kept = [r for r, c in zip(rewards, counted) if c]
        g = len(kept)
        # Ahmadian et al. 2024: A_i = r_i - 1/(G-1) sum_{j != i} r_j
        by_definition = iter([r - (sum(kept) - r) / (g - 1) for r in kept])
        assert rloo == pytest.approx([next(by_definition) if c else None for c in counted],
                                     rel=1e-9, abs=1e-12)
        grpo, _ = group_advantages(rewards, counted, advantage_std="none")
        assert [a for a in rloo if a is not None] == pytest.approx(
            [a * g / (g - 1) for a in grpo if a is not None], rel=1e-9, abs=1e-12)


def test_reinforce_pp_keeps_rewards_and_its_baseline_variant_subtracts_the_mean() -> None:
    rewards = [1.0, 0.0, 0.5, 0.25]
    plain, reason = group_advantages(rewards, [True] * 4, advantage_std="sample",
                                     estimator="reinforce_pp")
    assert plain == rewards and reason is None
    baseline, _ = group_advantages(rewards, [True, True, True, False], advantage_std="sample",
                                   estimator="reinforce_pp_baseline")
    assert baseline == pytest.approx([0.5, -0.5, 0.0, None])
    # Equal rewards carry no signal for every estimator (the dynamic-sampling filter).
    for estimator in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        _, reason = group_advantages([0.7] * 3, [True] * 3, advantage_std="none",
                                     estimator=estimator)
        assert reason == "zero_std"


def test_whitening_over_the_step_gives_mean_0_std_1_on_trained_tokens_only() -> None:
    from torchtitan_rl.rollout.advantage import whiten_advantages
    from torchtitan_rl.types import TrainingSample

    rng = random.Random(2)
    samples = []
    for i in range(5):
        n = rng.randint(3, 9)
        mask = [0, 0] + [1] * (n - 2)
        adv = rng.random()
        samples.append(TrainingSample(sample_id=f"s{i}", group_id=i, token_ids=[1] * n,
                                      loss_mask=mask, generator_logprobs=[0.0] * n,
                                      advantages=[0.0, 0.0] + [adv] * (n - 2),
                                      policy_versions=[-1, -1] + [0] * (n - 2)))
    whitened = whiten_advantages(samples)
    values = [a for s in whitened for a, m in zip(s.advantages, s.loss_mask) if m]
    raw = [a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / (len(raw) - 1))
    assert values == pytest.approx([(a - mean) / math.sqrt(std ** 2 + 1e-8) for a in raw])
    assert sum(values) == pytest.approx(0.0, abs=1e-9)
    assert all(a == 0.0 for s in whitened for a, m in zip(s.advantages, s.loss_mask) if not m)
    assert samples[0].advantages[2] != whitened[0].advantages[2]  # copies: the inputs unchanged
    # The loop's one call: whitened for the batch-whitened estimators only.
    from torchtitan_rl.rollout.advantage import step_advantages

    assert step_advantages(samples, "reinforce_pp") == whitened
    assert step_advantages(samples, "gdpo") == whitened
    assert step_advantages(samples, "grpo") == samples


def test_turn_returns_are_the_discounted_rewards_to_go() -> None:
    from torchtitan_rl.rollout.advantage import turn_returns

    # G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 1 + 0.5 * 1 = 1.5
    assert turn_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert turn_returns([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]
    assert turn_returns([], 1.0) == []


def test_unknown_estimator_is_refused_naming_the_key() -> None:
    from torchtitan_rl.controller.job import RLJob

    with pytest.raises(ConfigError, match="expected one of 'grpo', 'rloo'"):
        parse_args(RLJob.Config, ["--rollouter.advantage", "ppo"])
    with pytest.raises(ValueError, match="advantage must be one of"):
        Rollouter.Config(advantage="ppo")


def test_opo_subtracts_the_length_weighted_mean_reward() -> None:
    # OPO (Hao et al. 2025): b = sum l_i r_i / sum l_i = (10*1 + 30*0 + 60*0.5) / 100 = 0.4
    advantages, reason = group_advantages([1.0, 0.0, 0.5, 9.0], [True, True, True, False],
                                          advantage_std="sample", estimator="opo",
                                          lengths=[10, 30, 60, 5])
    assert reason is None
    assert advantages == pytest.approx([0.6, -0.4, 0.1, None])


def test_opo_with_equal_lengths_is_the_group_mean_baseline() -> None:
    rng = random.Random(3)
    for _ in range(20):
        rewards = [rng.random() for _ in range(rng.randint(2, 8))]
        n = rng.randint(1, 50)
        opo, _ = group_advantages(rewards, [True] * len(rewards), advantage_std="none",
                                  estimator="opo", lengths=[n] * len(rewards))
        mean, _ = group_advantages(rewards, [True] * len(rewards), advantage_std="none",
                                   estimator="reinforce_pp_baseline")
        assert opo == pytest.approx(mean, rel=1e-12, abs=1e-15)


def test_opo_without_lengths_is_refused() -> None:
    with pytest.raises(ValueError, match="'opo' needs each rollout's generated length"):
        group_advantages([1.0, 0.0], [True, True], advantage_std="none", estimator="opo")


def test_passk_credits_only_the_best_rollout_by_its_margin() -> None:
    # verl's grpo_passk: r_max - r_second_max on the best, divided by the group's sample std.
    rewards = [0.2, 0.9, 0.5, 0.9 - 0.25]
    std = math.sqrt(sum((r - sum(rewards) / 4) ** 2 for r in rewards) / 3)
    advantages, reason = group_advantages(rewards, [True] * 4, advantage_std="sample",
                                          estimator="grpo_passk")
    assert reason is None
    assert advantages == pytest.approx([0.0, 0.25 / (std + STD_EPS), 0.0, 0.0], rel=1e-12)
    plain, _ = group_advantages(rewards, [True] * 4, advantage_std="none",
                                estimator="grpo_passk")
    assert plain == pytest.approx([0.0, 0.25, 0.0, 0.0], rel=1e-12)
    # A tie at the top: the first best gets the margin 0 (nothing to learn from the pair).
    tied, _ = group_advantages([1.0, 0.0, 1.0], [True] * 3, advantage_std="none",
                               estimator="grpo_passk")
    assert tied == [0.0, 0.0, 0.0]
    single, reason = group_advantages([1.0, 0.5], [True, False], advantage_std="none",
                                      estimator="grpo_passk")
    assert single == [0.0, None] and reason == "zero_std"


def test_gdpo_normalises_each_reward_part_in_the_group_then_sums() -> None:
    # GDPO (arXiv 2601.05242): a format part in {0, 1} and a correctness part in {0, 0.1}.
    # Summed first (GRPO), the large part decides: [1.1, 1, 1, 0] -> rollout 0 0.19 above 1.
    # Part by part: format [1, 1, 1, 0] has mean 0.75 and sample std 0.5 -> [0.5, 0.5, 0.5, -1.5];
    # correct [0.1, 0, 0, 0] has mean 0.025, std 0.05 -> [1.5, -0.5, -0.5, -0.5]; the sum
    # [2, 0, 0, -2] gives the small part its own weight.
    formats, corrects = [1.0, 1.0, 1.0, 0.0], [0.1, 0.0, 0.0, 0.0]
    counted = [True] * 4
    advantages, reason = group_advantages(
        [f + c for f, c in zip(formats, corrects)], counted, advantage_std="sample",
        estimator="gdpo", components=[formats, corrects])
    assert reason is None
    f, c = 0.5 + STD_EPS, 0.05 + STD_EPS  # each part's std + eps
    assert advantages == pytest.approx([0.25 / f + 0.075 / c, 0.25 / f - 0.025 / c,
                                        0.25 / f - 0.025 / c, -0.75 / f - 0.025 / c], rel=1e-9)
    assert advantages[0] == pytest.approx(2.0, rel=1e-4) and advantages[1] == pytest.approx(
        0.0, abs=1e-4)
    grpo, _ = group_advantages([f + c for f, c in zip(formats, corrects)], counted,
                               advantage_std="sample", estimator="grpo")
    assert grpo[0] - grpo[1] < 0.2 and advantages[0] - advantages[1] > 1.9  # 0.19 vs 2
    # Weights (verl's gdpo_reward_weights): 1 * format + 2 * correct = [3.5, -0.5, -0.5, -2.5]
    weighted, _ = group_advantages([0.0] * 4, counted, advantage_std="none", estimator="gdpo",
                                   components=[[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
                                   component_weights=[1.0, 2.0])
    assert weighted == pytest.approx([0.25 + 1.5, 0.25 - 0.5, 0.25 - 0.5, -0.75 - 0.5])
    # An uncounted rollout stays out; a group whose parts all tie has no signal; without
    # parts the reward is the one part (GRPO's advantage, then the step's whitening).
    partial, _ = group_advantages([0.0] * 3, [True, True, False], advantage_std="none",
                                  estimator="gdpo", components=[[1.0, 0.0, 7.0]])
    assert partial == [0.5, -0.5, None]
    _, tied = group_advantages([1.0, 1.0], [True, True], advantage_std="sample",
                               estimator="gdpo", components=[[1.0, 1.0], [0.0, 0.0]])
    assert tied == "zero_std"
    alone, _ = group_advantages([1.0, 0.0, 0.5], [True] * 3, advantage_std="sample",
                                estimator="gdpo")
    plain, _ = group_advantages([1.0, 0.0, 0.5], [True] * 3, advantage_std="sample",
                                estimator="grpo")
    assert alone == plain


def test_gdpo_reads_the_envs_reward_parts_and_is_whitened_over_the_step() -> None:
    from tests.rollout.rollout_testlib import ScriptedGenerate, run, tiny_tokenizer
    from torchtitan_rl.rollout.advantage import BATCH_WHITENED
    from torchtitan_rl.rollout.message_env import EnvStep, MessageEnv
    from torchtitan_rl.types import Sampling

    class TwoParts(MessageEnv):
        """One turn; the reply's first letter sets a format part and a correctness part."""

        async def init(self):  # type: ignore[no-untyped-def]
            return [{"role": "user", "content": "answer"}]

        async def step(self, assistant_message):  # type: ignore[no-untyped-def]
            reply = assistant_message["content"]
            return EnvStep(done=True, reward_parts={"format": float(reply[0] in "abc"),
                                                    "correct": 0.1 * (reply[0] == "a")})

    replies = ["a", "b", "c", "d"]  # format [1, 1, 1, 0], correct [0.1, 0, 0, 0]
    gen = ScriptedGenerate(lambda rid, _: replies[int(rid.split("rollout=")[1].split("/")[0])])

    def group(**overrides):  # type: ignore[no-untyped-def]
        config = Rollouter.Config(group_size=4, step_timeout_s=5.0, advantage="gdpo",
                                  **overrides)
        rollouter = config.build(tokenizer=tiny_tokenizer(), make_env=lambda _: TwoParts())
        return run(rollouter.run_group_rollouts(gen, {"episode_id": "e"}, 0,
                                                sampling=Sampling(max_tokens=4, seed=1)))

    assert group().advantages == pytest.approx([2.0, 0.0, 0.0, -2.0], rel=1e-4, abs=1e-4)
    # One named part: correctness alone; weights per named part.
    assert group(gdpo_reward_parts=["correct"]).advantages == pytest.approx(
        [1.5, -0.5, -0.5, -0.5], rel=1e-4)
    assert group(gdpo_reward_parts=["format", "correct"],
                 gdpo_reward_weights=[0.0, 2.0]).advantages == pytest.approx(
        [3.0, -1.0, -1.0, -1.0], rel=1e-4)
    assert "gdpo" in BATCH_WHITENED
    with pytest.raises(ValueError, match="one weight per gdpo_reward_parts entry"):
        Rollouter.Config(gdpo_reward_parts=["a"], gdpo_reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="'gdpo' needs credit 'rollout'"):
        Rollouter.Config(advantage="gdpo", credit="turn")
