"""Off-policy correction (``trainer.loss.off_policy``): what a token sampled by another policy
(the generator's numerics, an older policy version) weighs in the policy loss, and the
trainer/generator mismatch metrics, logged whatever is on.

Per valid token t of sequence i (T_i valid tokens), with the trainer's detached logprob logp_t
and the generator's gen_t: ``log r_t = logp_t - gen_t`` (r_t = pi_trainer / pi_generator). The
divergences are Schulman's estimators of KL(pi_generator || pi_trainer) from the generator's
samples:

    k1_t = -log r_t            k2_t = (log r_t)^2 / 2            k3_t = r_t - 1 - log r_t

Importance weight (detached), by ``is_level``, truncated at ``is_cap`` (None: not truncated):

    token       w_t = min(r_t, cap)
    sequence    w_t = min(exp(sum_{s in i} log r_s), cap)      (the product of i's ratios)
    geometric   w_t = min(exp(mean_{s in i} log r_s), cap)     (their geometric mean)
    none        w_t = 1

Keep mask m_t in {0, 1}, the product of every option that is set:

    token mask (IcePop)         token_mask_low <= r_t <= token_mask_high
    sequence mask               seq_mask_low <= R_i <= seq_mask_high, R_i by seq_mask_metric:
                                exp(mean_{s in i} log r_s) ("geometric") or
                                exp(sum_{s in i} log r_s) ("product")
    rejection "<level>_k<n>"    with threshold tau (``reject`` / ``reject_threshold``):
        token_kn  k_n,t <= tau;  seq_sum_kn  sum_i k_n <= tau;  seq_mean_kn  mean_i k_n <= tau;
        seq_max_kn  max_i k_n <= tau;  for k1 (signed) the bound is on |k1| (|log r| <= tau:
        verl's k1 bounds (e^-tau, e^tau)); seq_max_k1 bounds every token's |log r| in i
    OPSM                        not (A_t < 0 and mean_{s in i} k1_s > opsm_threshold)

With ``batch_normalize`` the kept weights are divided by their mean: over the kept valid tokens
(token level) or the kept sequences (sequence levels) of the microbatch on this rank (a step's
global mean is not known before its microbatches' backward passes).

The policy loss of token t is multiplied by ``w_t m_t``. A masked token adds 0 to the loss and
still counts in its denominators (N_tokens, N_seqs), so masking never rescales the other tokens.
While the correction is on, the PPO ratio is taken against the trainer's own detached logprob
(loss.py), so with one optimizer step per batch the gradient is ``-w_t m_t A_t grad logp_t``.

Metrics (``mismatch/*``, always logged; while the correction is off its weight, mask and cap
figures say what the configured menu would do, and ``loss/tis_weight_mean`` stays 1): k1 and k3
token means, the largest token k3, the largest sequence-mean |k1| and k3 over sequences, the
fractions of tokens masked (all causes and each), of sequences with a masked token and of tokens
whose weight was truncated, the mean and max applied weight and the max raw ratio; and by policy
age (trainer version - token version: 0, 1, 2, 3, "4+") and by turn (the k-th sampled span of a
training sample: 0, 1, 2, "3+"). A sequence sits whole in one microbatch row, so every
per-sequence statistic is local.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from torchtitan_rl.config.configurable import Configurable

IsLevel = Literal["token", "sequence", "geometric", "none"]

REJECT_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                  "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k1", "seq_max_k2",
                  "seq_max_k3")

LOG_RATIO_BOUND = 20.0
"""|sum or mean of log r| is clamped to this before exp (verl's SAFETY_BOUND)."""

AGE_BUCKETS = ("0", "1", "2", "3", "4+")
TURN_BUCKETS = ("0", "1", "2", "3+")
_BUCKET_STATS = ("tokens", "k1", "k3", "masked", "weight")

SUM_KEYS = (
    "mm_k1", "mm_k3", "mm_sequences", "mm_masked_tokens", "mm_masked_sequences",
    "mm_token_masked", "mm_seq_masked", "mm_rejected", "mm_opsm", "mm_capped", "mm_weight",
    *(f"age{b}_{s}" for b in AGE_BUCKETS for s in _BUCKET_STATS),
    *(f"turn{b}_{s}" for b in TURN_BUCKETS for s in _BUCKET_STATS),
)
"""Sums the trainer adds over microbatches and data-parallel ranks (finalize_metrics divides)."""
MAX_KEYS = ("mm_k3_token", "mm_k1_seq", "mm_k3_seq", "mm_weight", "mm_ratio")
"""Maxima (all >= 0) the trainer reduces with MAX."""


class OffPolicyCorrection(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: Literal["auto", "on", "off"] = "auto"
        """auto: on when a job's tokens can be off-policy (loop.staleness.max_staleness >= 1,
        which partial rollouts need), else off, the loss exactly as at S = 0; a trainer built
        outside a job reads auto as off. on / off: always / never."""
        is_level: IsLevel = "token"
        """Importance weight pi_trainer / pi_generator: "token" (per token, truncated IS as verl
        and SkyRL), "sequence" (the product over the sequence), "geometric" (the geometric mean
        over the sequence), "none" (weight 1: masks and rejection only)."""
        is_cap: float | None = 2.0
        """Truncation of the importance weight (TIS); None: not truncated. >= 1."""
        batch_normalize: bool = False
        """Divide the weights by their mean (over the microbatch's kept tokens or sequences)."""
        token_mask_low: float | None = 0.125
        """IcePop: tokens whose ratio is below this are masked; None: no lower bound. > 0."""
        token_mask_high: float | None = 8.0
        """IcePop: tokens whose ratio is above this are masked; None: no upper bound. > low."""
        seq_mask_low: float | None = None
        """Sequences whose ratio (``seq_mask_metric``) is below this are masked (seq-mask-tis,
        SkyRL's sequence mask); None: no lower bound. > 0."""
        seq_mask_high: float | None = None
        """Sequences whose ratio is above this are masked; None: no upper bound."""
        seq_mask_metric: Literal["geometric", "product"] = "geometric"
        """The sequence mask's ratio: "geometric" (the geometric mean of the token ratios) or
        "product" (their product: TRL's sequence_mask, SkyRL's product mask)."""
        reject: list[str] = dataclasses.field(default_factory=list)
        """Rejection by divergence, combinable (all must pass): any of token_k1..3,
        seq_sum_k1..3, seq_mean_k1..3, seq_max_k1..3 (verl's rollout_rs names; seq_max_k1 is
        SkyRL's outlier-token sequence mask)."""
        reject_threshold: list[float] = dataclasses.field(default_factory=list)
        """One threshold per ``reject`` entry, or one for all. > 0."""
        opsm_threshold: float | None = None
        """Off-policy sequence masking (DeepSeek-V3.2, TRL's off_policy_mask_threshold):
        a negative-advantage token of a sequence whose mean k1 exceeds this is masked; None:
        off. > 0 (TRL suggests 0.5)."""

        def __post_init__(self) -> None:
            key = "loss.off_policy"
            if self.enabled not in ("auto", "on", "off"):
                raise ValueError(f"{key}.enabled must be 'auto', 'on' or 'off', got "
                                 f"{self.enabled!r}")
            if self.seq_mask_metric not in ("geometric", "product"):
                raise ValueError(f"{key}.seq_mask_metric must be 'geometric' or 'product', got "
                                 f"{self.seq_mask_metric!r}")
            if self.is_level not in ("token", "sequence", "geometric", "none"):
                raise ValueError(f"{key}.is_level must be 'token', 'sequence', 'geometric' or "
                                 f"'none', got {self.is_level!r}")
            if self.is_cap is not None and not self.is_cap >= 1:
                raise ValueError(f"{key}.is_cap must be >= 1 or None, got {self.is_cap}")
            for side in ("token", "seq"):
                low, high = getattr(self, f"{side}_mask_low"), getattr(self, f"{side}_mask_high")
                if low is not None and not low > 0:
                    raise ValueError(f"{key}.{side}_mask_low must be > 0 or None, got {low}")
                if low is not None and high is not None and not high > low:
                    raise ValueError(f"{key}.{side}_mask_high must be > {side}_mask_low, got "
                                     f"{high} <= {low}")
            unknown = [o for o in self.reject if o not in REJECT_OPTIONS]
            if unknown:
                raise ValueError(f"{key}.reject: unknown option {unknown[0]!r}; one of "
                                 f"{', '.join(REJECT_OPTIONS)}")
            if self.reject and len(self.reject_threshold) not in (1, len(self.reject)):
                raise ValueError(f"{key}.reject_threshold needs 1 or {len(self.reject)} values "
                                 f"(one per reject option), got {len(self.reject_threshold)}")
            if not self.reject and self.reject_threshold:
                raise ValueError(f"{key}.reject_threshold is set but {key}.reject is empty")
            if any(not t > 0 for t in self.reject_threshold):
                raise ValueError(f"{key}.reject_threshold must be > 0, got "
                                 f"{self.reject_threshold}")
            if self.opsm_threshold is not None and not self.opsm_threshold > 0:
                raise ValueError(f"{key}.opsm_threshold must be > 0 or None, got "
                                 f"{self.opsm_threshold}")

        @property
        def active(self) -> bool:
            """Whether the weights and masks enter the loss ("auto" unresolved: no)."""
            return self.enabled == "on"

        def thresholds(self) -> dict[str, float]:
            """{reject option: threshold}."""
            values = self.reject_threshold * (len(self.reject) if len(self.reject_threshold) == 1
                                              else 1)
            return dict(zip(self.reject, values))

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, log_ratio: torch.Tensor, *, valid: torch.Tensor,
                 document_ids: torch.Tensor, advantages: torch.Tensor,
                 ages: torch.Tensor | None = None, turns: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(per-token factor w_t m_t, metric sums, metric maxima) of one microbatch.

        Args:
            log_ratio: [...] detached log r_t (0 where not valid).
            valid: [...] bool: trained tokens with a finite generator logprob.
            document_ids: [...] the sequence of each token (whole in this microbatch).
            advantages: [...] A_t (OPSM reads its sign).
            ages: [...] optional policy age of each token (metrics by age).
            turns: [...] optional turn index of each token (metrics by turn).

        Returns the all-ones tensor (bit for bit the uncorrected loss) while the correction is
        not active; the metrics (what the menu does, or would do) are computed either way.
        """
        cfg = self.config
        with torch.no_grad():
            log_ratio = torch.where(valid, log_ratio.float(), 0.0)
            seq = _Sequences(valid, document_ids)
            k1 = -log_ratio
            k2 = 0.5 * log_ratio.square()
            k3 = torch.where(valid, torch.expm1(log_ratio.clamp(max=LOG_RATIO_BOUND)) - log_ratio,
                             0.0).clamp(min=0)
            mean_log_ratio = seq.broadcast(seq.mean(log_ratio))
            raw = self._raw_weight(log_ratio, seq, mean_log_ratio)
            weight = raw.clamp(max=cfg.is_cap) if cfg.is_cap is not None else raw
            capped = (raw > cfg.is_cap) & valid if cfg.is_cap is not None else valid & False
            ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))

            token_keep = _within(ratio, cfg.token_mask_low, cfg.token_mask_high)
            sequence_log_ratio = (mean_log_ratio if cfg.seq_mask_metric == "geometric"
                                  else seq.broadcast(seq.sum(log_ratio)))
            sequence_ratio = torch.exp(sequence_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            seq_keep = _within(sequence_ratio, cfg.seq_mask_low, cfg.seq_mask_high)
            reject_keep = torch.ones_like(valid)
            for option, tau in cfg.thresholds().items():
                reject_keep &= _passes(option, tau, {"k1": k1, "k2": k2, "k3": k3}, seq)
            opsm_keep = torch.ones_like(valid)
            if cfg.opsm_threshold is not None:
                opsm_keep = ~((advantages < 0) & (seq.broadcast(seq.mean(k1))
                                                  > cfg.opsm_threshold))
            keep = token_keep & seq_keep & reject_keep & opsm_keep
            applied = torch.where(keep & valid, weight, 0.0)
            if cfg.batch_normalize:
                applied = self._normalized(applied, keep & valid, seq)

            masked = ~keep & valid
            validf = valid.float()
            sums = {
                "mm_k1": (k1 * validf).sum(),
                "mm_k3": k3.sum(),
                "mm_sequences": seq.num_sequences(),
                "mm_masked_tokens": masked.float().sum(),
                "mm_masked_sequences": (seq.sum(masked.float()) > 0).float().sum(),
                "mm_token_masked": (~token_keep & valid).float().sum(),
                "mm_seq_masked": (~seq_keep & valid).float().sum(),
                "mm_rejected": (~reject_keep & valid).float().sum(),
                "mm_opsm": (~opsm_keep & valid).float().sum(),
                "mm_capped": capped.float().sum(),
                "mm_weight": applied.sum(),
            }
            for prefix, index, buckets in (("age", ages, AGE_BUCKETS),
                                           ("turn", turns, TURN_BUCKETS)):
                _bucket_sums(sums, prefix, buckets, index, valid=valid, k1=k1, k3=k3,
                             masked=masked, weight=applied)
            maxima = {
                "mm_k3_token": _max(k3),
                "mm_k1_seq": _max(seq.mean(k1).abs()),
                "mm_k3_seq": _max(seq.mean(k3)),
                "mm_weight": _max(applied),
                "mm_ratio": _max(torch.where(valid, ratio, 0.0)),
            }
        if not cfg.active:
            return torch.ones_like(log_ratio), sums, maxima
        return applied, sums, maxima

    def _raw_weight(self, log_ratio: torch.Tensor, seq: _Sequences,
                    mean_log_ratio: torch.Tensor) -> torch.Tensor:
        level = self.config.is_level
        if level == "token":
            return torch.exp(log_ratio)  # as loss.py's TIS always computed it (its bits)
        if level == "none":
            return torch.ones_like(log_ratio)
        per_token = (seq.broadcast(seq.sum(log_ratio)) if level == "sequence"
                     else mean_log_ratio)
        return torch.exp(per_token.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))

    def _normalized(self, applied: torch.Tensor, kept: torch.Tensor,
                    seq: _Sequences) -> torch.Tensor:
        if self.config.is_level in ("sequence", "geometric"):
            per_sequence = seq.sum(applied) / seq.sum(kept.float()).clamp(min=1)
            has_kept = seq.sum(kept.float()) > 0
            mean = per_sequence[has_kept].mean() if bool(has_kept.any()) else applied.new_ones(())
        else:
            mean = applied.sum() / kept.float().sum().clamp(min=1)
        return applied / mean if float(mean) > 1e-8 else applied


def token_tis(cap: float) -> OffPolicyCorrection.Config:
    """Token-level truncated IS at ``cap``, no masks: what the deprecated ``tis_cap`` keys meant."""
    return OffPolicyCorrection.Config(enabled="on", is_level="token", is_cap=cap,
                                      token_mask_low=None, token_mask_high=None)


def finalize_metrics(sums: dict[str, float], maxima: dict[str, float],
                     num_valid_tokens: float) -> dict[str, float]:
    """``mismatch/*`` metrics of a step from its reduced sums and maxima."""
    n = max(num_valid_tokens, 1.0)
    metrics = {
        "mismatch/k1_token_mean": sums["mm_k1"] / n,
        "mismatch/k3_token_mean": sums["mm_k3"] / n,
        "mismatch/k3_token_max": maxima["mm_k3_token"],
        "mismatch/k1_seq_max": maxima["mm_k1_seq"],
        "mismatch/k3_seq_max": maxima["mm_k3_seq"],
        "mismatch/masked_token_frac": sums["mm_masked_tokens"] / n,
        "mismatch/masked_seq_frac": sums["mm_masked_sequences"] / max(sums["mm_sequences"], 1.0),
        "mismatch/token_mask_frac": sums["mm_token_masked"] / n,
        "mismatch/seq_mask_frac": sums["mm_seq_masked"] / n,
        "mismatch/rejected_token_frac": sums["mm_rejected"] / n,
        "mismatch/opsm_token_frac": sums["mm_opsm"] / n,
        "mismatch/capped_token_frac": sums["mm_capped"] / n,
        "mismatch/weight_mean": sums["mm_weight"] / n,
        "mismatch/weight_max": maxima["mm_weight"],
        "mismatch/ratio_max": maxima["mm_ratio"],
    }
    for prefix, buckets in (("age", AGE_BUCKETS), ("turn", TURN_BUCKETS)):
        for bucket in buckets:
            tokens = sums[f"{prefix}{bucket}_tokens"]
            if tokens <= 0:
                continue
            name = f"mismatch/{prefix}_{bucket}"
            metrics[f"{name}/num_tokens"] = tokens
            metrics[f"{name}/k1_token_mean"] = sums[f"{prefix}{bucket}_k1"] / tokens
            metrics[f"{name}/k3_token_mean"] = sums[f"{prefix}{bucket}_k3"] / tokens
            metrics[f"{name}/masked_token_frac"] = sums[f"{prefix}{bucket}_masked"] / tokens
            metrics[f"{name}/weight_mean"] = sums[f"{prefix}{bucket}_weight"] / tokens
    return metrics


def turn_indices(loss_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each position's turn: how many sampled spans (runs of loss_mask 1) of its sample start
    at or before it, minus 1 (a multi-turn sample's k-th completion is its k-th span). A sample
    starts where its position is 0; packed rows hold several."""
    mask = loss_mask.bool()
    start_of_sample = positions == 0
    previous = torch.zeros_like(mask)
    previous[..., 1:] = mask[..., :-1]
    starts = (mask & ~(previous & ~start_of_sample)).long()
    count = starts.cumsum(-1)
    before_sample = torch.where(start_of_sample, count - starts, 0)
    return count - torch.cummax(before_sample, dim=-1).values - 1


def _within(values: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    keep = torch.ones_like(values, dtype=torch.bool)
    if low is not None:
        keep &= values >= low
    if high is not None:
        keep &= values <= high
    return keep


def _passes(option: str, tau: float, per_token: dict[str, torch.Tensor],
            seq: _Sequences) -> torch.Tensor:
    """Tokens an option keeps: its statistic (|.| for k1) <= tau."""
    level, estimator = option.rsplit("_", 1)
    values = per_token[estimator]
    if level == "token":
        stat = values
    elif level == "seq_sum":
        stat = seq.broadcast(seq.sum(values))
    elif level == "seq_mean":
        stat = seq.broadcast(seq.mean(values))
    elif estimator == "k1":  # seq_max_k1: the largest |k1| of the sequence
        return seq.broadcast(seq.max(values.abs())) <= tau
    else:
        stat = seq.broadcast(seq.max(values))
    return (stat.abs() if estimator == "k1" else stat) <= tau


def _bucket_sums(sums: dict[str, torch.Tensor], prefix: str, buckets: tuple[str, ...],
                 index: torch.Tensor | None, *, valid: torch.Tensor, k1: torch.Tensor,
                 k3: torch.Tensor, masked: torch.Tensor, weight: torch.Tensor) -> None:
    zero = k1.new_zeros(())
    for b, bucket in enumerate(buckets):
        if index is None:
            for stat in _BUCKET_STATS:
                sums[f"{prefix}{bucket}_{stat}"] = zero
            continue
        last = b == len(buckets) - 1
        member = valid & ((index >= b) if last else (index == b))
        memberf = member.float()
        sums[f"{prefix}{bucket}_tokens"] = memberf.sum()
        sums[f"{prefix}{bucket}_k1"] = (k1 * memberf).sum()
        sums[f"{prefix}{bucket}_k3"] = (k3 * memberf).sum()
        sums[f"{prefix}{bucket}_masked"] = (masked & member).float().sum()
        sums[f"{prefix}{bucket}_weight"] = (weight * memberf).sum()


def _max(values: torch.Tensor) -> torch.Tensor:
    return values.max().clamp(min=0) if values.numel() else values.new_zeros(())


class _Sequences:
    """Per-sequence reductions over the valid tokens of a microbatch, by document id."""

    def __init__(self, valid: torch.Tensor, document_ids: torch.Tensor) -> None:
        self.valid = valid
        self.ids = torch.where(valid, document_ids, torch.zeros_like(document_ids)).flatten()
        self.size = int(self.ids.max()) + 1 if self.ids.numel() else 1
        self.counts = self.sum(valid.float())

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        masked = torch.where(self.valid, values.float(), 0.0).flatten()
        return torch.zeros(self.size, dtype=masked.dtype,
                           device=masked.device).index_add(0, self.ids, masked)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return self.sum(values) / self.counts.clamp(min=1)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        masked = torch.where(self.valid, values.float(), -math.inf).flatten()
        out = torch.full((self.size,), -math.inf, dtype=masked.dtype, device=masked.device)
        out = out.scatter_reduce(0, self.ids, masked, reduce="amax")
        return torch.where(self.counts > 0, out, 0.0)

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """Each valid token's value of its sequence (0 elsewhere)."""
        return torch.where(self.valid, per_sequence[self.ids].view_as(self.valid), 0.0)

    def num_sequences(self) -> torch.Tensor:
        return (self.counts > 0).float().sum()
