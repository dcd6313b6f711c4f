"""GRPO clipped surrogate on per-token logprobs, with DAPO clip-higher and truncated importance sampling.

Per valid token t (loss_mask = 1 and a finite generator logprob):

    log_ratio_t = clamp(logp_t - ref_t, -log_ratio_clamp, log_ratio_clamp)
    ratio_t     = exp(log_ratio_t)
    surrogate_t = -min(ratio_t * A_t, clamp(ratio_t, 1 - clip_low, 1 + clip_high) * A_t) * w_t
    loss        = sum_t surrogate_t / num_global_valid_tokens

* ``ref_t`` is the generator's logprob, and ``w_t = 1`` (plain GRPO / DAPO).
* With ``tis_cap`` set (truncated importance sampling, Yao et al. 2025, as verl's TIS): the
  trainer/generator mismatch becomes a detached weight ``w_t = min(exp(logp_t - gen_t), tis_cap)``
  and the PPO ratio is taken against the trainer's own detached logprob (``ref_t = logp_t``), so one
  optimizer step per batch gives ``-w_t A_t grad logp_t``.

``num_global_valid_tokens`` counts valid tokens over every microbatch and data-parallel rank of the
step, so summing per-microbatch losses (and gradients over ranks) gives one big batch's loss.
Tokens with a non-finite generator logprob are left out of loss and denominator and counted.

The loss also returns *sums* (numerators) and *maxima* that the trainer adds over microbatches,
all-reduces over data-parallel ranks (SUM / MAX), then turns into metrics with
``finalize_loss_metrics``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from torchtitan_rl.config.configurable import Configurable

# Keys of the sums GRPOLoss returns; finalize_loss_metrics divides them by the right count.
SUM_KEYS = (
    "loss",
    "ratio",
    "clipped",
    "clipped_low",
    "clipped_high",
    "entropy",
    "logprob_diff",
    "abs_logprob_diff",
    "tis_weight",
    "tis_capped",
    "num_valid_tokens",
    "num_loss_tokens",
    "num_nan_generator_logprobs",
)
MAX_KEYS = ("abs_logprob_diff",)


class GRPOLoss(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        clip_low: float = 0.2
        """Lower PPO clip: the ratio is clamped to >= 1 - clip_low. In [0, 1)."""
        clip_high: float = 0.2
        """Upper PPO clip: the ratio is clamped to <= 1 + clip_high. > clip_low is DAPO's
        clip-higher (e.g. 0.28). >= 0."""
        log_ratio_clamp: float = 10.0
        """|log ratio| is clamped to this before exp() so a large mismatch cannot overflow. > 0."""
        tis_cap: float | None = None
        """Truncated importance sampling cap on exp(trainer - generator logprob); None disables.
        >= 1 when set (e.g. 2.0)."""
        ratio_reference: Literal["generator", "trainer"] = "generator"
        """What the PPO ratio compares the current policy with (without ``tis_cap``).
        ``generator``: the sampling logprobs (GRPO as published). ``trainer``: the trainer's own
        detached logprobs: with one optimizer step per batch the ratio is exactly 1 and the
        gradient is the plain policy gradient, independent of the generator's numerics. vLLM's
        CPU logprobs differ in the last bits with how requests were batched (measured ~5e-7), so
        this is the setting under which runs are bit-reproducible (resume, staleness 0 == sync)."""

        def __post_init__(self) -> None:
            if not 0 <= self.clip_low < 1:
                raise ValueError(f"loss.clip_low must be in [0, 1), got {self.clip_low}")
            if self.clip_high < 0:
                raise ValueError(f"loss.clip_high must be >= 0, got {self.clip_high}")
            if self.log_ratio_clamp <= 0:
                raise ValueError(
                    f"loss.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}"
                )
            if self.tis_cap is not None and self.tis_cap < 1:
                raise ValueError(f"loss.tis_cap must be >= 1 or None, got {self.tis_cap}")

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(
        self,
        trainer_logprobs: torch.Tensor,
        *,
        generator_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        num_global_valid_tokens: int,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Loss of one microbatch and its metric sums and maxima.

        Args:
            trainer_logprobs: [...] logprob of each target token under the current policy (grad).
            generator_logprobs: [...] logprob the generator reported (may hold NaN/inf).
            advantages: [...] per-token advantage (0 where not trained).
            loss_mask: [...] bool or {0, 1}: tokens the policy sampled.
            num_global_valid_tokens: valid tokens of the whole step (all microbatches, all ranks).
            entropy: [...] optional per-token entropy of the current policy (no grad).

        Returns:
            (loss, sums, maxima): loss is this microbatch's share of the step loss.
        """
        cfg = self.config
        loss_mask = loss_mask.bool()
        finite = torch.isfinite(generator_logprobs)
        valid = loss_mask & finite
        gen = torch.where(valid, generator_logprobs, torch.zeros_like(generator_logprobs))
        logp = trainer_logprobs.float()
        zeros = torch.zeros_like(logp)
        raw_diff = torch.where(valid, logp.detach() - gen, zeros)

        if cfg.tis_cap is None:
            reference = gen if cfg.ratio_reference == "generator" else logp.detach()
            weight = torch.ones_like(logp)
        else:
            reference = logp.detach()
            weight = torch.clamp(torch.exp(raw_diff), max=cfg.tis_cap)

        log_ratio = torch.where(valid, logp - reference, zeros)
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio = torch.exp(log_ratio)
        clipped_ratio = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
        adv = advantages.float()
        surrogate = -torch.minimum(ratio * adv, clipped_ratio * adv) * weight
        surrogate = torch.where(valid, surrogate, zeros)
        loss = surrogate.sum() / max(int(num_global_valid_tokens), 1)

        with torch.no_grad():
            validf = valid.float()
            # A token counts as clipped when the clipped branch is the one min() picked.
            clipped_low = (ratio < 1 - cfg.clip_low) & (adv < 0) & valid
            clipped_high = (ratio > 1 + cfg.clip_high) & (adv > 0) & valid
            sums = {
                "loss": surrogate.sum().detach(),
                "ratio": (ratio * validf).sum(),
                "clipped": (clipped_low | clipped_high).float().sum(),
                "clipped_low": clipped_low.float().sum(),
                "clipped_high": clipped_high.float().sum(),
                "entropy": (entropy.float() * validf).sum() if entropy is not None else zeros.sum(),
                "logprob_diff": raw_diff.sum(),
                "abs_logprob_diff": raw_diff.abs().sum(),
                "tis_weight": (weight * validf).sum(),
                "tis_capped": (
                    ((torch.exp(raw_diff) > cfg.tis_cap) & valid).float().sum()
                    if cfg.tis_cap is not None
                    else zeros.sum()
                ),
                "num_valid_tokens": validf.sum(),
                "num_loss_tokens": loss_mask.float().sum(),
                "num_nan_generator_logprobs": (loss_mask & ~finite).float().sum(),
            }
            maxima = {"abs_logprob_diff": raw_diff.abs().max() if raw_diff.numel() else zeros.sum()}
        return loss, sums, maxima


def finalize_loss_metrics(
    sums: dict[str, float], maxima: dict[str, float]
) -> dict[str, float]:
    """Metrics of a step from its reduced sums and maxima (see GRPOLoss.__call__)."""
    num_valid = max(sums["num_valid_tokens"], 1.0)
    num_loss = max(sums["num_loss_tokens"], 1.0)
    return {
        "loss/value": sums["loss"] / num_valid,
        "loss/ratio_mean": sums["ratio"] / num_valid,
        "loss/clipped_frac": sums["clipped"] / num_valid,
        "loss/clipped_low_frac": sums["clipped_low"] / num_valid,
        "loss/clipped_high_frac": sums["clipped_high"] / num_valid,
        "loss/entropy_mean": sums["entropy"] / num_valid,
        "loss/tis_weight_mean": sums["tis_weight"] / num_valid,
        "loss/tis_capped_frac": sums["tis_capped"] / num_valid,
        "loss/trainer_minus_generator_logprob_mean": sums["logprob_diff"] / num_valid,
        "loss/trainer_generator_abs_logprob_diff_mean": sums["abs_logprob_diff"] / num_valid,
        "loss/trainer_generator_abs_logprob_diff_max": maxima["abs_logprob_diff"],
        "loss/generator_logprob_nan_frac": sums["num_nan_generator_logprobs"] / num_loss,
        "loss/num_valid_tokens": sums["num_valid_tokens"],
        "loss/num_nan_generator_logprobs": sums["num_nan_generator_logprobs"],
    }


def token_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each label (with grad) and the policy's entropy at each position (no grad)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    label_logprobs = logp.gather(-1, labels[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return label_logprobs, entropy
