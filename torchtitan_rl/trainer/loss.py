"""The step's policy loss: a per-token loss by name (policy_losses.py), weighted by the
off-policy correction (off_policy.py), aggregated over tokens and sequences, plus an optional KL
term (kl.py).

Per valid token t (loss_mask = 1 and a finite generator logprob) of sequence i:

    log_ratio_t = clamp(logp_t - ref_t, -log_ratio_clamp, log_ratio_clamp)
    l_t         = POLICY_LOSSES[policy_loss](log_ratio_t, A_t) * w_t  (+ kl_coef * KL_t)
    loss        = sum_t c_t l_t,  c_t from ``aggregation``:

    token-mean               c_t = 1 / N_tokens               (GRPO as verl, DAPO)
    seq-mean-token-sum       c_t = 1 / N_seqs
    seq-mean-token-mean      c_t = 1 / (N_seqs * T_i)          (GRPO as published, GSPO)
    seq-mean-token-sum-norm  c_t = 1 / (N_seqs * L)            (Dr. GRPO: L a constant length)

* ``ref_t`` is the generator's logprob (or the trainer's own, ``ratio_reference``), and
  ``w_t = 1`` (plain GRPO / DAPO).
* With the off-policy correction on (``off_policy``; by default a job turns it on when
  max_staleness >= 1): the trainer/generator mismatch becomes a detached factor ``w_t`` (importance
  weight times keep mask, off_policy.py) and the PPO ratio is taken against the trainer's own
  detached logprob (``ref_t = logp_t``), so one optimizer step per batch gives
  ``-w_t A_t grad logp_t``.

``N_tokens`` and ``N_seqs`` count valid tokens and sequences (training samples with a valid token)
over every microbatch and data-parallel rank of the step, and ``T_i`` is sequence i's valid tokens
(a sequence sits whole in one row), so summing per-microbatch losses (and gradients over ranks)
gives one big batch's loss. Tokens with a non-finite generator logprob are left out of loss and
counts and are counted.

The loss also returns *sums* (numerators) and *maxima* that the trainer adds over microbatches,
all-reduces over data-parallel ranks (SUM / MAX), then turns into metrics with
``finalize_loss_metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch
import torch.nn.functional as F

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.trainer import off_policy
from torchtitan_rl.trainer.kl import K3_CAP, KLEstimator, token_kl
from torchtitan_rl.trainer.off_policy import OffPolicyCorrection, token_tis, turn_indices
from torchtitan_rl.trainer.policy_losses import POLICY_LOSSES, PolicyLossName

logger = logging.getLogger(__name__)

# Keys of the sums PolicyLoss returns; finalize_loss_metrics divides them by the right count.
SUM_KEYS = (
    "loss",
    "objective",
    "kl",
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
    *off_policy.SUM_KEYS,
)
MAX_KEYS = ("abs_logprob_diff", *off_policy.MAX_KEYS)

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


class PolicyLoss(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        policy_loss: PolicyLossName = "ppo_clip"
        """Per-token loss (trainer/policy_losses.py): "ppo_clip" (PPO/GRPO/DAPO), "gspo" (one
        length-normalised ratio per sequence), "cispo" (clipped detached importance weight),
        "dppo_tv" / "dppo_kl" (DPPO: masks by probability difference / binary KL), "sapo"
        (soft gate), "gmpo" (geometric mean of token ratios), "clip_cov" / "kl_cov"
        (covariance-selected clip / KL), "gpg" (plain policy gradient)."""
        aggregation: Aggregation = "token-mean"
        """How per-token losses add up to the step's loss: "token-mean" over every valid token of
        the step; "seq-mean-token-sum", "seq-mean-token-mean" (each sequence's mean, then the mean
        over sequences), "seq-mean-token-sum-norm" (each sequence's sum / norm_length, mean over
        sequences: Dr. GRPO)."""
        norm_length: int = 0
        """L of "seq-mean-token-sum-norm"; 0: the batch's row length (batcher.seq_len). >= 0."""
        clip_low: float = 0.2
        """Lower clip: the ratio is clamped to >= 1 - clip_low. In [0, 1)."""
        clip_high: float = 0.2
        """Upper clip: the ratio is clamped to <= 1 + clip_high. > clip_low is DAPO's
        clip-higher (e.g. 0.28). >= 0."""
        clip_ratio_c: float | None = None
        """Dual-clip bound c for "ppo_clip" (e.g. 3.0): a negative-advantage token's loss is at
        most -c * A; for "dppo_tv" / "dppo_kl" the truncation of their detached ratio (None:
        20, as verl). None disables (ppo_clip). > 1."""
        sapo_tau_pos: float = 1.0
        """SAPO's gate temperature for positive-advantage tokens (TRL's default). > 0."""
        sapo_tau_neg: float = 1.05
        """SAPO's gate temperature for negative-advantage tokens (TRL's default). > 0."""
        cov_fraction: float = 2e-4
        """Clip-Cov / KL-Cov: the fraction of a microbatch's valid tokens (at least 1) whose
        covariance cov(A, logp) selects them (verl's clip_cov_ratio / kl_cov_ratio). In (0, 1]."""
        clip_cov_low: float = 1.0
        """Clip-Cov: only tokens with covariance in (clip_cov_low, clip_cov_high) are picked."""
        clip_cov_high: float = 5.0
        """Clip-Cov: the upper end of that band. > clip_cov_low."""
        kl_cov_coef: float = 1.0
        """KL-Cov: the coefficient of |log ratio| added to the picked tokens' loss. >= 0."""
        log_ratio_clamp: float = 10.0
        """|log ratio| is clamped to this before exp() so a large mismatch cannot overflow. > 0."""
        off_policy: OffPolicyCorrection.Config = dataclasses.field(
            default_factory=OffPolicyCorrection.Config)
        """The off-policy correction (trainer/off_policy.py): importance weights, masks,
        rejection and OPSM; on by default in a job whose tokens can be off-policy."""
        tis_cap: float | None = None
        """Deprecated (None: not set): ``off_policy.enabled = "on"`` with ``off_policy.is_cap``
        (token level, no masks); loads as that with a warning. >= 1 when set."""
        ratio_reference: Literal["generator", "trainer"] = "generator"
        """What the PPO ratio compares the current policy with (while the off-policy
        correction is off; on, it is the trainer's own logprob).
        ``generator``: the sampling logprobs (GRPO as published). ``trainer``: the trainer's own
        detached logprobs: with one optimizer step per batch the ratio is exactly 1 and the
        gradient is the plain policy gradient, independent of the generator's numerics. vLLM's
        CPU logprobs differ in the last bits with how requests were batched (measured ~5e-7), so
        this is the setting under which runs are bit-reproducible (resume, staleness 0 == sync)."""
        kl_coef: float = 0.0
        """beta of a KL(policy || reference) loss term, aggregated like the policy loss; the
        reference is the model the run started from, frozen, on the trainer ranks. 0: off (no
        reference model is built). >= 0."""
        kl_estimator: KLEstimator = "k3"
        """Per-token KL estimator (trainer/kl.py): "k1", "k2" or "k3" (low variance, >= 0)."""
        kl_k3_cap: float | None = K3_CAP
        """k3's value is clamped to <= this (its gradient is 0 above it), as verl clamps its
        low_var_kl at 10: an uncapped k3 grows like exp(|log ratio|) on the tokens that drift
        furthest. None: uncapped. > 0."""
        kl_placement: Literal["loss", "reward"] = "loss"
        """Where the KL goes: "loss", a term of the loss; "reward", a penalty -kl_coef * KL_t on
        each generated token's reward before GAE (verl's use_kl_in_reward; needs
        trainer.critic.enabled)."""

        def __post_init__(self) -> None:
            if self.policy_loss not in POLICY_LOSSES:
                raise ValueError(f"loss.policy_loss must be one of {sorted(POLICY_LOSSES)}, got "
                                 f"{self.policy_loss!r}")
            if self.aggregation not in AGGREGATIONS:
                raise ValueError(f"loss.aggregation must be one of {sorted(AGGREGATIONS)}, got "
                                 f"{self.aggregation!r}")
            if not 0 <= self.clip_low < 1:
                raise ValueError(f"loss.clip_low must be in [0, 1), got {self.clip_low}")
            if self.clip_high < 0:
                raise ValueError(f"loss.clip_high must be >= 0, got {self.clip_high}")
            if self.clip_ratio_c is not None and (
                    self.clip_ratio_c <= 1
                    or self.policy_loss not in ("ppo_clip", "dppo_tv", "dppo_kl")):
                raise ValueError(f"loss.clip_ratio_c must be > 1 and needs policy_loss "
                                 f"'ppo_clip', 'dppo_tv' or 'dppo_kl', got {self.clip_ratio_c} "
                                 f"with {self.policy_loss!r}")
            if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
                raise ValueError(f"loss.sapo_tau_pos and loss.sapo_tau_neg must be > 0, got "
                                 f"{self.sapo_tau_pos} and {self.sapo_tau_neg}")
            if not 0 < self.cov_fraction <= 1:
                raise ValueError(f"loss.cov_fraction must be in (0, 1], got {self.cov_fraction}")
            if not self.clip_cov_high > self.clip_cov_low:
                raise ValueError(f"loss.clip_cov_high must be > loss.clip_cov_low, got "
                                 f"{self.clip_cov_high} <= {self.clip_cov_low}")
            if not self.kl_cov_coef >= 0:
                raise ValueError(f"loss.kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
            if self.kl_k3_cap is not None and not self.kl_k3_cap > 0:
                raise ValueError(f"loss.kl_k3_cap must be > 0 or None, got {self.kl_k3_cap}")
            if self.log_ratio_clamp <= 0:
                raise ValueError(
                    f"loss.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}"
                )
            if self.tis_cap is not None:
                if self.tis_cap < 1:
                    raise ValueError(f"loss.tis_cap must be >= 1 or None, got {self.tis_cap}")
                logger.warning("trainer.loss.tis_cap is deprecated: read as "
                               "trainer.loss.off_policy.enabled = 'on', is_level = 'token', "
                               "is_cap = %s, no masks", self.tis_cap)
                self.off_policy = token_tis(self.tis_cap)
                self.tis_cap = None
            if self.norm_length < 0:
                raise ValueError(f"loss.norm_length must be >= 0, got {self.norm_length}")
            if not self.kl_coef >= 0:
                raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")
            if self.kl_placement not in ("loss", "reward"):
                raise ValueError(f"loss.kl_placement must be 'loss' or 'reward', got "
                                 f"{self.kl_placement!r}")
            if self.kl_estimator not in ("k1", "k2", "k3"):
                raise ValueError(f"loss.kl_estimator must be 'k1', 'k2' or 'k3', got "
                                 f"{self.kl_estimator!r}")

        @property
        def uses_reference_model(self) -> bool:
            return self.kl_coef > 0

    def __init__(self, config: Config) -> None:
        self.config = config
        self.policy_loss = POLICY_LOSSES[config.policy_loss]
        self.correction = config.off_policy.build()

    def __call__(
        self,
        trainer_logprobs: torch.Tensor,
        *,
        generator_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        num_global_valid_tokens: int,
        num_global_valid_sequences: int = 0,
        document_ids: torch.Tensor | None = None,
        sequence_valid_tokens: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
        policy_versions: torch.Tensor | None = None,
        policy_version: int | None = None,
        positions: torch.Tensor | None = None,
        old_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Loss of one microbatch and its metric sums and maxima.

        Args:
            trainer_logprobs: [..., seq_len] logprob of each target token under the current
                policy (grad).
            generator_logprobs: [...] logprob the generator reported (may hold NaN/inf).
            advantages: [...] per-token advantage (0 where not trained).
            loss_mask: [...] bool or {0, 1}: tokens the policy sampled.
            num_global_valid_tokens: valid tokens of the whole step (all microbatches, all ranks).
            num_global_valid_sequences: sequences with a valid token in the whole step (needed
                by the seq-mean aggregations).
            document_ids: [...] the sequence each token belongs to (GSPO and seq-mean; a
                sequence's tokens are all in this microbatch).
            sequence_valid_tokens: [...] valid tokens of each token's sequence (seq-mean-token-mean).
            entropy: [...] optional per-token entropy of the current policy (no grad).
            reference_logprobs: [...] the reference policy's logprobs (needed when kl_coef > 0).
            policy_versions: [...] the policy version that sampled each token, with
                ``policy_version`` (the trainer's): the mismatch metrics by policy age.
            positions: [...] each token's position in its sample: the mismatch metrics by turn.
            old_logprobs: [...] the old policy's logprobs (the trainer's weights at the step's
                start, recomputed; several updates a step, trainer/minibatches.py): the PPO
                ratio's reference, and the correction weighs old / generator. None: the
                trainer's own detached logprobs are the old policy (one update a step).

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
        old = logp.detach() if old_logprobs is None else old_logprobs.float()
        raw_diff = torch.where(valid, old - gen, zeros)

        if self.correction.config.active:
            reference = old
        else:
            reference = gen if cfg.ratio_reference == "generator" else old

        log_ratio = torch.where(valid, logp - reference, zeros)
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        if document_ids is None:
            if cfg.policy_loss in SEQUENCE_LOSSES or cfg.aggregation != "token-mean":
                raise ValueError(f"loss {cfg.policy_loss!r} with aggregation "
                                 f"{cfg.aggregation!r} needs document_ids")
            document_ids = torch.zeros_like(loss_mask, dtype=torch.int64)
        ages = None
        if policy_versions is not None and policy_version is not None:
            ages = (policy_version - policy_versions).clamp(min=0)
        turns = turn_indices(loss_mask, positions) if positions is not None else None
        weight, correction_sums, correction_maxima = self.correction(
            raw_diff, valid=valid, document_ids=document_ids, advantages=advantages,
            ages=ages, turns=turns)
        surrogate, clipped_low, clipped_high = self.policy_loss(
            log_ratio, advantages.float(), valid=valid, document_ids=document_ids, clip=cfg,
            reference=reference)
        surrogate = torch.where(valid, surrogate * weight, zeros)
        coefficient = _aggregation_coefficient(
            cfg, valid=valid, row_length=logp.shape[-1],
            num_tokens=num_global_valid_tokens, num_sequences=num_global_valid_sequences,
            sequence_valid_tokens=sequence_valid_tokens)
        if coefficient is None:  # token-mean, as one division (the default's bits unchanged)
            loss = surrogate.sum() / max(int(num_global_valid_tokens), 1)
        else:
            loss = (surrogate * coefficient).sum()
        kl = zeros
        if cfg.kl_coef > 0 and cfg.kl_placement == "loss":
            if reference_logprobs is None:
                raise ValueError("loss.kl_coef > 0 needs the reference model's logprobs")
            kl = torch.where(valid, token_kl(logp, reference_logprobs, cfg.kl_estimator,
                                             k3_cap=cfg.kl_k3_cap), zeros)
            kl_weight = (coefficient if coefficient is not None
                         else 1.0 / max(int(num_global_valid_tokens), 1))
            loss = loss + cfg.kl_coef * (kl * kl_weight).sum()

        with torch.no_grad():
            validf = valid.float()
            ratio = torch.exp(log_ratio)
            sums = {
                "loss": surrogate.sum().detach(),
                "objective": loss.detach(),
                "kl": kl.detach().sum(),
                "ratio": (ratio * validf).sum(),
                "clipped": (clipped_low | clipped_high).float().sum(),
                "clipped_low": clipped_low.float().sum(),
                "clipped_high": clipped_high.float().sum(),
                "entropy": (entropy.float() * validf).sum() if entropy is not None else zeros.sum(),
                "logprob_diff": raw_diff.sum(),
                "abs_logprob_diff": raw_diff.abs().sum(),
                "tis_weight": (weight * validf).sum(),
                "tis_capped": (correction_sums["mm_capped"] if self.correction.config.active
                               else zeros.sum()),
                "num_valid_tokens": validf.sum(),
                "num_loss_tokens": loss_mask.float().sum(),
                "num_nan_generator_logprobs": (loss_mask & ~finite).float().sum(),
                **correction_sums,
            }
            maxima = {"abs_logprob_diff": raw_diff.abs().max() if raw_diff.numel() else zeros.sum(),
                      **correction_maxima}
        return loss, sums, maxima


SEQUENCE_LOSSES = ("gspo", "gmpo")
"""Losses that read whole sequences (they need document_ids)."""

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                "seq-mean-token-sum-norm")


def _aggregation_coefficient(cfg: PolicyLoss.Config, *, valid: torch.Tensor, row_length: int,
                             num_tokens: int, num_sequences: int,
                             sequence_valid_tokens: torch.Tensor | None) -> torch.Tensor | None:
    """c_t of the module docstring on valid tokens (0 elsewhere); None for token-mean."""
    if cfg.aggregation == "token-mean":
        return None
    if num_sequences < 1 and bool(valid.any()):
        raise ValueError(f"aggregation {cfg.aggregation!r} needs num_global_valid_sequences")
    per_sequence = 1.0 / max(int(num_sequences), 1)
    if cfg.aggregation == "seq-mean-token-sum":
        scale = torch.full(valid.shape, per_sequence, device=valid.device)
    elif cfg.aggregation == "seq-mean-token-sum-norm":
        scale = torch.full(valid.shape, per_sequence / (cfg.norm_length or row_length),
                           device=valid.device)
    else:
        if sequence_valid_tokens is None:
            raise ValueError("aggregation 'seq-mean-token-mean' needs sequence_valid_tokens")
        scale = per_sequence / sequence_valid_tokens.float().clamp(min=1)
    return torch.where(valid, scale, torch.zeros_like(scale))


def finalize_loss_metrics(
    sums: dict[str, float], maxima: dict[str, float]
) -> dict[str, float]:
    """Metrics of a step from its reduced sums and maxima (see PolicyLoss.__call__)."""
    num_valid = max(sums["num_valid_tokens"], 1.0)
    num_loss = max(sums["num_loss_tokens"], 1.0)
    return {
        "loss/value": sums["loss"] / num_valid,
        "loss/objective": sums["objective"],
        "loss/kl_mean": sums["kl"] / num_valid,
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
        **off_policy.finalize_metrics(sums, maxima, sums["num_valid_tokens"]),
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
