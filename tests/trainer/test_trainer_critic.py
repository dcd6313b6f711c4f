"""PPO's critic: GAE against its definition written as a loop over each episode's generated
tokens, the clipped value loss, and the value model trained and checkpointed beside the policy
(torchtitan on the tiny model)."""

from __future__ import annotations

import math
import pathlib
import random

import pytest
import torch

from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.critic import ValueCritic, clipped_value_loss, gae
from torchtitan_rl.types import TrainingSample

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _episode_gae(rewards: list[float], values: list[float], gamma: float, lam: float):
    """Schulman et al. 2016, eq. (11)-(16) on one episode's steps (its generated tokens)."""
    n = len(rewards)
    deltas = [rewards[k] + gamma * (values[k + 1] if k + 1 < n else 0.0) - values[k]
              for k in range(n)]
    advantages = [sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, n))
                  for k in range(n)]
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0), (0.5, 0.7)])
def test_gae_over_generated_tokens_only_matches_its_definition(gamma: float, lam: float) -> None:
    rng = random.Random(0)
    rows, seq_len = 3, 40
    document_ids = torch.full((rows, seq_len), -1)
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    rewards = torch.zeros(rows, seq_len)
    values = torch.randn(rows, seq_len, generator=torch.Generator().manual_seed(1))
    episodes: dict[int, list[tuple[int, int]]] = {}
    document = 0
    for row in range(rows):
        p = 0
        while p < seq_len - 12:  # episodes of 2-3 turns: prompt/env tokens, then a reply
            start = p
            for _ in range(rng.randint(1, 3)):
                p += rng.randint(1, 3)  # prompt or environment tokens: not steps
                reply = rng.randint(1, 3)
                for q in range(p, p + reply):
                    mask[row, q] = True
                    episodes.setdefault(document, []).append((row, q))
                rewards[row, p + reply - 1] = rng.uniform(-1, 1)  # the turn's reward
                p += reply
            document_ids[row, start:p] = document
            document += 1
    advantages, returns = gae(rewards, values, mask, document_ids, gamma=gamma, lam=lam)
    assert len(episodes) > 4 and any(len(e) > 3 for e in episodes.values())
    for positions in episodes.values():
        expected_a, expected_r = _episode_gae([float(rewards[p]) for p in positions],
                                              [float(values[p]) for p in positions], gamma, lam)
        assert [float(advantages[p]) for p in positions] == pytest.approx(expected_a, abs=1e-5)
        assert [float(returns[p]) for p in positions] == pytest.approx(expected_r, abs=1e-5)
    assert float(advantages[~mask].abs().sum()) == 0.0


def test_the_value_loss_is_ppos_clipped_form() -> None:
    values = torch.tensor([[1.0, 0.2, -0.5, 3.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True, False]])
    loss, clipped = clipped_value_loss(values, old, returns, valid, clip=0.5)
    # token 0: plain (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25 (the clip binds)
    # token 1: plain 0.04, clipped (0.2-0)^2 = 0.04; token 2: plain 2.25, clipped 2.25
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04 + 2.25))
    assert clipped.item() == 1.0
    loss.backward()
    # where the clip binds the gradient is 0 (the clipped value does not move with V)
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.2, -1.5, 0.0])


def _batch(seed: int) -> TrainingBatch:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(4):
        n = 12
        rewards = [0.0] * n
        rewards[7], rewards[-1] = float(i % 2), float(i % 3) / 2  # two turns' rewards
        samples.append(TrainingSample(
            sample_id=f"group=0/rollout={i}/branch=0", group_id=0,
            token_ids=torch.randint(3, 1000, (n,), generator=gen).tolist(),
            loss_mask=[0] * 4 + [1] * 4 + [0] * 2 + [1] * 2,
            generator_logprobs=[0.0] * 4 + (-3 * torch.rand(8, generator=gen)).tolist(),
            advantages=[0.0] * n, policy_versions=[-1] * 4 + [0] * 8, rewards=rewards,
        ))
    return Batcher.Config(seq_len=32).build().pack(samples)


@pytest.fixture(scope="module")
def model_dir():
    from torchtitan_rl.assets.make_model import ensure_model

    return ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()


def _core(model_dir, critic: bool = True) -> PolicyTrainerCore:
    config = PolicyTrainerCore.Config(
        num_threads=1, critic=ValueCritic.Config(enabled=critic, lr=1e-2))
    config.optimizer.lr = 1e-3
    return config.build(model_dir=model_dir)


def test_the_critic_learns_beside_the_policy_and_resumes_bit_for_bit(model_dir, tmp_path):
    straight = _core(model_dir)
    batch = _batch(0)
    first = straight.forward_backward(batch)
    # V = 0 at the start: returns are the rewards to go, the advantages those whitened
    assert first["critic/value_mean"] == 0.0 and first["critic/return_mean"] > 0
    assert math.isfinite(first["loss/objective"]) and first["critic/value_loss"] > 0
    straight.optim_step()
    losses = [first["critic/value_loss"]]
    for step in range(1, 4):
        losses.append(straight.forward_backward(batch)["critic/value_loss"])
        metrics = straight.optim_step()
        assert metrics["critic/grad_norm"] > 0
        if step == 1:
            straight.save_checkpoint(tmp_path / "step2", extra={})
    assert losses[-1] < losses[0]  # the value model fits the returns

    resumed = _core(model_dir)
    resumed.load_checkpoint(tmp_path / "step2")
    for _ in range(2):
        resumed.forward_backward(batch)
        resumed.optim_step()
    for mine, theirs in ((resumed.model, straight.model),
                         (resumed.critic.model, straight.critic.model)):
        expected = theirs.state_dict()
        for name, tensor in mine.state_dict().items():
            assert torch.equal(tensor, expected[name]), name

    plain = _core(model_dir, critic=False)
    plain.save_checkpoint(tmp_path / "no_critic", extra={})
    with pytest.raises(FileNotFoundError, match="holds no critic"):
        _core(model_dir).load_checkpoint(tmp_path / "no_critic")


def test_gae_and_the_critic_go_together_in_a_job_config() -> None:
    from torchtitan_rl.config.errors import ConfigError
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob

    with pytest.raises(ConfigError, match="'gae' and trainer.critic.enabled go together"):
        parse_args(RLJob.Config, ["--rollouter.advantage", "gae"])
    with pytest.raises(ConfigError, match="'gae' and trainer.critic.enabled go together"):
        parse_args(RLJob.Config, ["--trainer.critic.enabled", "true"])
    config = parse_args(RLJob.Config, ["--rollouter.advantage", "gae",
                                       "--trainer.critic.enabled", "true"]).config
    assert config.trainer.critic.enabled


def test_kl_in_the_reward_penalises_each_generated_token() -> None:
    from torchtitan_rl.trainer.critic import kl_penalised_rewards

    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -0.5, -2.0, -3.0]])
    reference = torch.tensor([[-1.5, -0.5, -1.0, -9.0]])
    valid = torch.tensor([[True, True, True, False]])
    shaped, kl = kl_penalised_rewards(rewards, logprobs, reference, valid, coef=0.1,
                                      estimator="k1")
    # k1 = log pi - log pi_ref: 0.5, 0, -1 (and nothing on a token that is not generated)
    assert kl[0].tolist() == pytest.approx([0.5, 0.0, -1.0, 0.0])
    assert shaped[0].tolist() == pytest.approx([-0.05, 0.0, 1.1, 0.0])
    # k3 = exp(x) - 1 - x at x = log pi_ref - log pi, capped as in the loss (verl's 10):
    # x = -0.5, 0, 1 -> 0.1065, 0, 0.7183; at cap 0.5 the last is 0.5.
    _, k3 = kl_penalised_rewards(rewards, logprobs, reference, valid, coef=0.1, estimator="k3",
                                 k3_cap=0.5)
    assert k3[0].tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.0, 0.5, 0.0], rel=1e-6)


def test_kl_in_the_reward_is_zero_until_the_policy_moves(model_dir) -> None:
    def core(placement: bool) -> PolicyTrainerCore:
        config = PolicyTrainerCore.Config(num_threads=1, critic=ValueCritic.Config(enabled=True))
        config.optimizer.lr = 1e-2
        if placement:
            config.loss.kl_coef, config.loss.kl_placement = 0.5, "reward"
        return config.build(model_dir=model_dir)

    with_kl, without = core(True), core(False)
    batch = _batch(1)
    first = with_kl.forward_backward(batch)
    assert first["loss/kl_mean"] == 0.0  # the reference is the starting policy
    assert first["critic/return_mean"] == without.forward_backward(batch)["critic/return_mean"]
    with_kl.optim_step()
    second = with_kl.forward_backward(batch)
    assert second["loss/kl_mean"] != 0.0 and math.isfinite(second["critic/return_mean"])
    from torchtitan_rl.trainer.loss import PolicyLoss

    with pytest.raises(ValueError, match="kl_placement = 'reward' needs"):  # no critic
        PolicyTrainerCore.Config(loss=PolicyLoss.Config(kl_coef=0.1, kl_placement="reward"))
