"""Several updates per step (trainer.num_minibatches k, trainer.ppo_epochs e): the split by
groups, the decoupled loss (rollout, old and current policies) against its equation written out,
k = e = 1 as today, k mini-batches as k plain steps, the second epoch's ratio, and the critic's
resume bit for bit (torchtitan on the tiny model)."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.critic import ValueCritic
from torchtitan_rl.trainer.lora import LoRA
from torchtitan_rl.trainer.loss import PolicyLoss
from torchtitan_rl.trainer.minibatches import combine_update_metrics, split_groups
from torchtitan_rl.trainer.off_policy import OffPolicyCorrection
from torchtitan_rl.types import TrainingSample

BATCHER = Batcher.Config(seq_len=32)


def _samples(seed: int, num_groups: int = 4) -> list[TrainingSample]:
    """``num_groups`` groups of 2 rollouts, 12 tokens each (4 prompt, 8 generated), advantages
    +-1, rewards on the last token (for GAE); generator logprobs near the tiny model's (about
    -7 on random tokens), so the correction's masks keep the tokens."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(num_groups):
        for i in range(2):
            rewards = [0.0] * 12
            rewards[-1] = float((g + i) % 2)
            samples.append(TrainingSample(
                sample_id=f"group={g}/rollout={i}/branch=0", group_id=g,
                token_ids=torch.randint(3, 1000, (12,), generator=gen).tolist(),
                loss_mask=[0] * 4 + [1] * 8,
                generator_logprobs=[0.0] * 4 + (-6.5 - torch.rand(8, generator=gen)).tolist(),
                advantages=[0.0] * 4 + [1.0 if i else -1.0] * 8,
                policy_versions=[-1] * 4 + [0] * 8, rewards=rewards))
    return samples


def _core(model_dir, **kw) -> PolicyTrainerCore:
    config = PolicyTrainerCore.Config(num_threads=1, **kw)
    config.optimizer.lr = 1e-2
    return config.build(model_dir=model_dir)


def _weights(core: PolicyTrainerCore) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in core.full_model_state_dict().items()}


def test_split_groups_keeps_groups_whole_and_in_order() -> None:
    samples = [TrainingSample(sample_id=f"{g}/{i}", group_id=g, token_ids=[1, 2], loss_mask=[0, 1],
                              generator_logprobs=[0.0, -1.0], advantages=[0.0, 1.0],
                              policy_versions=[-1, 0])
               for g in (7, 3, 5, 1, 9) for i in range(2)]
    parts = split_groups(samples, 2)  # groups 7 3 5 1 9 -> [7 3 5] [1 9]
    assert [[s.group_id for s in part] for part in parts] == [[7, 7, 3, 3, 5, 5], [1, 1, 9, 9]]
    assert len(split_groups(samples, 9)) == 5  # never an empty mini-batch
    assert split_groups(samples, 1) == [samples]


def test_update_metrics_mean_max_and_counts() -> None:
    updates = [{"loss/ratio_mean": 1.0, "mismatch/k3_token_max": 0.5, "loss/num_valid_tokens": 8,
                "trainer/forward_backward_s": 1.0},
               {"loss/ratio_mean": 0.8, "mismatch/k3_token_max": 0.25, "loss/num_valid_tokens": 4,
                "trainer/forward_backward_s": 2.0},
               {"loss/ratio_mean": 1.2, "mismatch/k3_token_max": 0.75, "loss/num_valid_tokens": 8,
                "trainer/forward_backward_s": 3.0},
               {"loss/ratio_mean": 1.4, "mismatch/k3_token_max": 0.5, "loss/num_valid_tokens": 4,
                "trainer/forward_backward_s": 4.0}]
    combined = combine_update_metrics(updates, num_minibatches=2)
    assert combined == {"loss/ratio_mean": pytest.approx(1.1), "mismatch/k3_token_max": 0.75,
                        "loss/num_valid_tokens": 12, "trainer/forward_backward_s": 10.0,
                        "trainer/num_updates": 4.0, "loss/ratio_mean_last": 1.4}


def test_the_decoupled_loss_takes_the_ratio_against_old_and_the_weight_against_the_rollout(
) -> None:
    # Three policies on four tokens: current logp, old (the step's start) and the generator's.
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.8, -0.5, -3.0]])
    gen = torch.tensor([[-1.0, -2.5, -1.0, -1.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss_cfg = PolicyLoss.Config(off_policy=OffPolicyCorrection.Config(
        enabled="on", is_level="token", is_cap=2.0, token_mask_low=0.125, token_mask_high=8.0))
    loss, sums, _ = loss_cfg.build()(logp, generator_logprobs=gen, advantages=adv,
                                     loss_mask=mask, num_global_valid_tokens=4,
                                     old_logprobs=old)
    expected, current = 0.0, logp.detach()
    for t in range(4):
        r = math.exp(float(current[0, t] - old[0, t]))                # current / old
        rho = math.exp(float(old[0, t] - gen[0, t]))                  # old / rollout
        w = min(rho, 2.0) * (1.0 if 0.125 <= rho <= 8.0 else 0.0)     # TIS, IcePop
        a = float(adv[0, t])
        expected += -min(r * a, min(max(r, 0.8), 1.2) * a) * w
    # token 3: rho = e^-1.5 = 0.22 kept, r = e^1.5 clipped at 1.2 for A < 0 -> max binds the clip
    assert loss.item() == pytest.approx(expected / 4, rel=1e-5)  # float32 exp
    assert sums["ratio"].item() == pytest.approx(sum(math.exp(float(current[0, t] - old[0, t]))
                                                     for t in range(4)), rel=1e-5)
    # Without old logprobs (one update a step) the old policy is the current one: ratio 1.
    _, same, _ = loss_cfg.build()(logp, generator_logprobs=gen, advantages=adv, loss_mask=mask,
                                  num_global_valid_tokens=4)
    assert same["ratio"].item() == 4.0


def test_one_minibatch_one_epoch_recomputing_the_old_policy_is_todays_step(tiny_model_dir):
    # The recompute path at k = e = 1 (old logprobs from a no-grad forward) gives the same loss,
    # metrics and weights, bit for bit, as today's step, whose old policy is the current one.
    loss = PolicyLoss.Config(ratio_reference="trainer")
    today, recomputed = _core(tiny_model_dir, loss=loss), _core(tiny_model_dir, loss=loss)
    samples = _samples(0)
    expected = today.forward_backward_samples(samples, BATCHER)
    today.optim_step()
    (update,) = recomputed.minibatch_updates(samples, BATCHER.build())
    recomputed.optim_step()
    for key in ("loss/objective", "loss/ratio_mean", "loss/value", "mismatch/k3_token_mean"):
        assert update[key] == expected[key], key
    assert update["loss/ratio_mean"] == 1.0
    mine, theirs = _weights(recomputed), _weights(today)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_k_minibatches_in_bypass_mode_are_k_plain_steps(tiny_model_dir):
    # ratio_reference "generator", correction off: each update is a plain step on its
    # mini-batch (the same learning rate; warm-up off), so 2 mini-batches x 2 epochs equal four
    # plain steps on mb1, mb2, mb1, mb2, weights bit for bit.
    samples = _samples(1)
    minibatched = _core(tiny_model_dir, num_minibatches=2, ppo_epochs=2)
    plain = _core(tiny_model_dir)
    metrics = minibatched.forward_backward_samples(samples, BATCHER)
    metrics.update(minibatched.optim_step())
    assert metrics["trainer/num_updates"] == 4.0 and minibatched.policy_version == 1
    halves = split_groups(samples, 2)
    for part in halves + halves:
        plain.forward_backward_samples(part, BATCHER)
        plain.optim_step()
    mine, theirs = _weights(minibatched), _weights(plain)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_the_second_epochs_ratio_is_not_one(tiny_model_dir):
    core = _core(tiny_model_dir, ppo_epochs=2,
                 loss=PolicyLoss.Config(off_policy=OffPolicyCorrection.Config(enabled="on")))
    first, second = core.minibatch_updates(_samples(2), BATCHER.build())
    assert first["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second["loss/ratio_mean"] - 1.0) > 1e-4
    assert first["mismatch/masked_token_frac"] < 0.5  # the tokens train
    # The correction's weight is old / rollout in both epochs: the same tokens, the same weight.
    assert second["loss/tis_weight_mean"] == first["loss/tis_weight_mean"]


def test_every_policy_loss_takes_several_updates(tiny_model_dir):
    from torchtitan_rl.trainer.policy_losses import POLICY_LOSSES

    core = _core(tiny_model_dir, num_minibatches=2, ppo_epochs=2)
    for name in POLICY_LOSSES:
        core.config.loss = PolicyLoss.Config(
            policy_loss=name, off_policy=OffPolicyCorrection.Config(enabled="on"),
            aggregation="seq-mean-token-mean" if name in ("gspo", "gmpo", "sapo") else
            "token-mean")
        core.loss_fn = core.config.loss.build()
        metrics = core.forward_backward_samples(_samples(20), BATCHER)
        metrics.update(core.optim_step())
        assert metrics["trainer/num_updates"] == 4 and metrics["trainer/skipped_step"] == 0, name
        assert math.isfinite(metrics["loss/objective"]), name
        assert abs(metrics["loss/ratio_mean_last"] - 1) > 1e-6, name  # against the old policy


@pytest.mark.parametrize("setting", ["critic", "lora"])
def test_minibatch_steps_resume_bit_for_bit(tiny_model_dir, tmp_path, setting):
    kw = ({"critic": ValueCritic.Config(enabled=True, lr=1e-2)} if setting == "critic"
          else {"lora": LoRA.Config(enabled=True)})
    kw.update(num_minibatches=2, ppo_epochs=2,
              loss=PolicyLoss.Config(off_policy=OffPolicyCorrection.Config(enabled="on")))
    straight = _core(tiny_model_dir, **kw)
    for step in range(3):
        metrics = straight.forward_backward_samples(_samples(10 + step), BATCHER)
        metrics.update(straight.optim_step())
        assert math.isfinite(metrics["loss/objective"]) and metrics["trainer/num_updates"] == 4
        if step == 0:
            straight.save_checkpoint(tmp_path / "step1", extra={})
    if setting == "critic":
        assert metrics["critic/value_loss"] > 0 and metrics["critic/grad_norm"] > 0
    resumed = _core(tiny_model_dir, **kw)
    resumed.load_checkpoint(tmp_path / "step1")
    for step in (1, 2):
        resumed.forward_backward_samples(_samples(10 + step), BATCHER)
        resumed.optim_step()
    mine, theirs = _weights(resumed), _weights(straight)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    if setting == "critic":
        for name, tensor in resumed.critic.model.state_dict().items():
            assert torch.equal(tensor, straight.critic.model.state_dict()[name]), name


@pytest.mark.parametrize("nan_updates, skipped_step", [({0}, 0.0), ({0, 1, 2, 3}, 1.0)])
def test_a_step_is_skipped_only_when_every_update_was(tiny_model_dir, nan_updates, skipped_step):
    core = _core(tiny_model_dir, num_minibatches=2, ppo_epochs=2)
    calls = []
    policy_loss, forward_backward = core._policy_loss, core.forward_backward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(None)
        return forward_backward(*args, **kwargs)

    def nan_in_some(*args, **kwargs):  # type: ignore[no-untyped-def]
        loss, sums, maxima = policy_loss(*args, **kwargs)
        return (loss * float("nan") if len(calls) - 1 in nan_updates else loss), sums, maxima

    core.forward_backward, core._policy_loss = counted, nan_in_some
    before = _weights(core)
    core.forward_backward_samples(_samples(3), BATCHER)
    metrics = core.optim_step()
    assert len(calls) == 4 and core.policy_version == 1
    assert metrics["trainer/num_skipped_updates"] == len(nan_updates)
    assert metrics["trainer/skipped_step"] == skipped_step
    after = _weights(core)
    assert all(torch.equal(before[n], after[n]) for n in before) == (skipped_step == 1.0)


def test_minibatch_settings_are_checked() -> None:
    for key in ("num_minibatches", "ppo_epochs"):
        with pytest.raises(ValueError, match=f"trainer.{key} must be >= 1, got 0"):
            PolicyTrainerCore.Config(**{key: 0})
