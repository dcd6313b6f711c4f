"""PolicyLoss against values computed by hand on five tokens."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.trainer.loss import (
    MAX_KEYS,
    SUM_KEYS,
    PolicyLoss,
    finalize_loss_metrics,
    token_logprobs_and_entropy,
)

NAN = float("nan")
# t0: ratio 2 (A>0, clipped high); t1: ratio 0.625 (A<0, clipped low); t2: ratio 1;
# t3: generator logprob NaN (dropped, counted); t4: not in the loss mask.
GEN = [math.log(0.25), math.log(0.8), math.log(0.5), NAN, math.log(0.5)]
ADV = [1.0, -1.0, 2.0, 5.0, 7.0]
MASK = [1, 1, 1, 1, 0]


def _run(config: PolicyLoss.Config, num_global_valid_tokens: int = 3):
    logp = torch.full((1, 5), math.log(0.5), requires_grad=True)
    loss_fn = config.build()
    loss, sums, maxima = loss_fn(
        logp,
        generator_logprobs=torch.tensor([GEN]),
        advantages=torch.tensor([ADV]),
        loss_mask=torch.tensor([MASK]),
        num_global_valid_tokens=num_global_valid_tokens,
        entropy=torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]),
    )
    loss.backward()
    metrics = finalize_loss_metrics(
        {k: float(sums[k]) for k in SUM_KEYS}, {k: float(maxima[k]) for k in MAX_KEYS}
    )
    return loss, logp.grad[0], metrics


def test_trainer_loss_clips_both_sides_and_drops_nan_and_masked_tokens():
    loss, grad, metrics = _run(PolicyLoss.Config(clip_low=0.2, clip_high=0.28))
    # -min(2*1, 1.28*1) = -1.28; -min(-0.625, -0.8) = 0.8; -min(2, 2) = -2
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.0) / 3, abs=1e-6)
    # clipped tokens get no gradient; t2: d/dlogp of -ratio*A = -A*ratio / N
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -2.0 / 3, 0.0, 0.0]))
    assert metrics["loss/value"] == pytest.approx((-1.28 + 0.8 - 2.0) / 3, abs=1e-6)
    assert metrics["loss/clipped_frac"] == pytest.approx(2 / 3)
    assert metrics["loss/clipped_high_frac"] == pytest.approx(1 / 3)
    assert metrics["loss/clipped_low_frac"] == pytest.approx(1 / 3)
    assert metrics["loss/ratio_mean"] == pytest.approx((2 + 0.625 + 1) / 3, abs=1e-6)
    assert metrics["loss/generator_logprob_nan_frac"] == pytest.approx(1 / 4)
    assert metrics["loss/num_valid_tokens"] == 3
    assert metrics["loss/entropy_mean"] == pytest.approx(2.0)
    assert metrics["loss/trainer_generator_abs_logprob_diff_max"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["loss/trainer_minus_generator_logprob_mean"] == pytest.approx(
        (math.log(2) + math.log(0.5 / 0.8)) / 3, abs=1e-6
    )


def test_trainer_loss_denominator_is_the_global_token_count():
    loss_local, grad_local, _ = _run(PolicyLoss.Config(clip_high=0.28), num_global_valid_tokens=3)
    loss_global, grad_global, _ = _run(PolicyLoss.Config(clip_high=0.28), num_global_valid_tokens=12)
    assert loss_global.item() == pytest.approx(loss_local.item() * 3 / 12, abs=1e-7)
    torch.testing.assert_close(grad_global, grad_local * 3 / 12)


def test_trainer_loss_truncated_importance_sampling_weights_and_caps():
    loss, grad, metrics = _run(PolicyLoss.Config(tis_cap=1.5))
    # weights min(exp(trainer - generator), 1.5): 1.5, 0.625, 1; ratio vs own detached logprob = 1
    assert loss.item() == pytest.approx((-1.5 * 1 + 0.625 * 1 - 1 * 2) / 3, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.5 / 3, 0.625 / 3, -2.0 / 3, 0.0, 0.0]))
    assert metrics["loss/tis_capped_frac"] == pytest.approx(1 / 3)
    assert metrics["loss/tis_weight_mean"] == pytest.approx((1.5 + 0.625 + 1) / 3)


def test_trainer_loss_clamps_the_log_ratio():
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, sums, _ = PolicyLoss.Config(log_ratio_clamp=10.0).build()(
        logp,
        generator_logprobs=torch.tensor([[-50.0]]),
        advantages=torch.tensor([[-1.0]]),
        loss_mask=torch.tensor([[1]]),
        num_global_valid_tokens=1,
    )
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)
    assert torch.isfinite(sums["ratio"])


def test_trainer_loss_config_rejects_out_of_range_values():
    with pytest.raises(ValueError, match="clip_low must be in"):
        PolicyLoss.Config(clip_low=1.5)
    with pytest.raises(ValueError, match="tis_cap must be >= 1"):
        PolicyLoss.Config(tis_cap=0.5)


def test_token_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, -1.0, 0.5]]], requires_grad=True)
    labels = torch.tensor([[3, 0]])
    logprobs, entropy = token_logprobs_and_entropy(logits, labels)
    assert logprobs.shape == entropy.shape == (1, 2)
    # uniform over 4 tokens: each label has logprob -log 4, the entropy is log 4
    assert logprobs[0, 0].item() == pytest.approx(-math.log(4))
    assert entropy[0, 0].item() == pytest.approx(math.log(4))
    expected = torch.log_softmax(logits.detach()[0, 1], dim=-1)
    assert logprobs[0, 1].item() == pytest.approx(expected[0].item())
    assert entropy[0, 1].item() == pytest.approx(-(expected.exp() * expected).sum().item())
    # the logprobs carry the gradient (the loss's input); the entropy is a metric only
    assert logprobs.requires_grad and not entropy.requires_grad
    logprobs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
