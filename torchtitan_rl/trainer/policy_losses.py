"""Policy losses by name (``trainer.loss.policy_loss``): each maps per-token log ratios and
advantages to a per-token loss; ``PolicyLoss`` (loss.py) aggregates it and adds TIS and KL.

Notation per valid token t of sequence i: ``log_ratio_t = logp_t - ref_t`` (clamped), ``r_t =
exp(log_ratio_t)``, ``A_t`` its advantage, ``eps_l``/``eps_h`` = ``clip_low``/``clip_high``,
``sg`` stop-gradient. Each function returns ``(per_token_loss, clipped_low, clipped_high)``: the
loss to aggregate (gradient through ``logp``) and which tokens the clip took out of the gradient
(metrics). A loss written with ``logp_t`` uses ``log_ratio_t`` in its place: the two differ by a
constant, so the value moves by a constant and the gradient is the same.

=============  ===============================================================================
``ppo_clip``   PPO's clipped surrogate with DAPO's clip-higher, optionally dual-clip
``gspo``       GSPO: one length-normalised ratio per sequence, clipped per sequence
``cispo``      CISPO: a clipped, stop-gradient importance weight on the logprob
``dppo_tv``    DPPO (binary TV): tokens whose probability moved more than eps are masked
``dppo_kl``    DPPO (binary KL): tokens whose binary KL exceeds eps (moving away) are masked
``sapo``       SAPO: a smooth sigmoid gate of the ratio instead of a hard clip
``gmpo``       GMPO: the geometric mean of the (clipped) token ratios of a sequence
``clip_cov``   Clip-Cov: PPO-clip, plus a few high-covariance tokens taken out of the gradient
``kl_cov``     KL-Cov: r A, plus a |log r| penalty on a few high-covariance tokens
``gpg``        GPG: the plain policy gradient -A logp
=============  ===============================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch

PolicyLossName = Literal["ppo_clip", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "gmpo",
                         "clip_cov", "kl_cov", "gpg"]

DPPO_DEFAULT_TRUNCATION = 20.0
"""DPPO's truncation of its detached ratio when ``clip_ratio_c`` is None (verl's default)."""


class ClipSettings(Protocol):
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float
    cov_fraction: float
    clip_cov_low: float
    clip_cov_high: float
    kl_cov_coef: float


LossTerms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
             document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO, Yu et al. 2025):

        l_t = -min(r_t A_t, clip(r_t, 1 - eps_l, 1 + eps_h) A_t)

    With ``clip_ratio_c = c`` set, dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA
    Games with Deep RL") bounds the loss of a negative-advantage token whose ratio ran away:

        l_t = min(l_t, -c A_t)   where A_t < 0
    """
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip.clip_low, 1 + clip.clip_high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped_low = (ratio < 1 - clip.clip_low) & (advantages < 0) & valid
    clipped_high = (ratio > 1 + clip.clip_high) & (advantages > 0) & valid
    if clip.clip_ratio_c is not None:
        dual_bound = -clip.clip_ratio_c * advantages
        dual = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(dual, dual_bound, loss)
        clipped_low = clipped_low | (dual & valid)
    return loss, clipped_low, clipped_high


def gspo(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
         document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), its token form:

        s_i   = exp(mean_{t in i} log_ratio_t)                 (length-normalised sequence ratio)
        s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])             (value s_i, gradient s_i grad logp_t)
        l_t   = -min(s_i,t A_t, clip(s_i,t, 1 - eps_l, 1 + eps_h) A_t)

    With one advantage per sequence and ``aggregation = "seq-mean-token-mean"`` this is the
    paper's sequence objective; the clip takes whole sequences out. GSPO's ratios sit much closer
    to 1 than token ratios: the paper clips at 3e-4 / 4e-4.
    """
    sequence_log_ratio = _sequence_mean(log_ratio, valid, document_ids)
    ratio = torch.exp(sequence_log_ratio.detach() + log_ratio - log_ratio.detach())
    clipped_ratio = torch.clamp(ratio, 1 - clip.clip_low, 1 + clip.clip_high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped_low = (ratio < 1 - clip.clip_low) & (advantages < 0) & valid
    clipped_high = (ratio > 1 + clip.clip_high) & (advantages > 0) & valid
    return loss, clipped_low, clipped_high


def cispo(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
          document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """CISPO (MiniMax-M1, 2025): every token keeps its gradient; its importance weight is clipped
    and detached:

        l_t = -sg[clip(r_t, 1 - eps_l, 1 + eps_h)] A_t logp_t

    (``logp_t`` enters as ``log_ratio_t``: the two differ by a constant, so value aside the
    gradient is the same.) MiniMax-M1 leaves the lower side open (``clip_low`` near 1) and sets a
    large upper bound.
    """
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1 - clip.clip_low, 1 + clip.clip_high)
    loss = -weight * advantages * log_ratio
    clipped_low = (ratio < 1 - clip.clip_low) & valid
    clipped_high = (ratio > 1 + clip.clip_high) & valid
    return loss, clipped_low, clipped_high


def dppo_tv(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
            document_ids: torch.Tensor, clip: ClipSettings, reference: torch.Tensor,
            **_: object) -> LossTerms:
    """DPPO, binary-TV form (verl's ``dppo_tv``; prime-rl's default loss): a token trains unless
    its probability already moved past the trust region, in the direction its advantage pushes:

        p_t = exp(logp_t), q_t = exp(ref_t), c = clip_ratio_c (None: 20)
        keep_t = (p_t - q_t <= eps_h)  if A_t > 0  else  (p_t - q_t >= -eps_l)
        l_t = -sg[min(r_t, c)] A_t logp_t keep_t

    ``clip_low`` / ``clip_high`` are the probability-difference bounds eps_l / eps_h.
    """
    ratio, keep = _dppo_ratio_and_keep(log_ratio, advantages, reference, clip, binary_kl=False)
    return _dppo_terms(ratio, keep, log_ratio, advantages, valid, clip)


def dppo_kl(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
            document_ids: torch.Tensor, clip: ClipSettings, reference: torch.Tensor,
            **_: object) -> LossTerms:
    """DPPO, binary-KL form (verl's ``dppo_kl``): the trust region is the KL between the
    two-outcome distributions (the sampled token or not) of the reference and current policy:

        D_t = q_t log(q_t / p_t) + (1 - q_t) log((1 - q_t + 1e-8) / (1 - p_t + 1e-8))
        keep_t = (D_t <= eps_h or p_t <= q_t)  if A_t > 0  else  (D_t <= eps_l or p_t >= q_t)
        l_t = -sg[min(r_t, c)] A_t logp_t keep_t
    """
    ratio, keep = _dppo_ratio_and_keep(log_ratio, advantages, reference, clip, binary_kl=True)
    return _dppo_terms(ratio, keep, log_ratio, advantages, valid, clip)


def sapo(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
         document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """SAPO (Qwen, 2025, "Soft Adaptive Policy Optimization"): a sigmoid gate replaces the hard
    clip, so a token's gradient fades as its ratio leaves 1 instead of dropping to 0:

        tau_t = sapo_tau_pos if A_t > 0 else sapo_tau_neg
        f(r)  = sigmoid(tau_t (r_t - 1)) * 4 / tau_t          (f'(1) = 1: on-policy it is PG)
        l_t   = -f(r_t) A_t

    Nothing is clipped (the masks stay empty). The paper and verl aggregate with
    "seq-mean-token-mean".
    """
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, clip.sapo_tau_pos, clip.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    none = torch.zeros_like(valid)
    return -gate * advantages, none, none


def gmpo(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
         document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"; verl's ``geo_mean``): the
    geometric mean of a sequence's token ratios, each clipped in log space, replaces their
    arithmetic mean:

        c_t  = sgn(A_t) min(sgn(A_t) log_ratio_t, sgn(A_t) clamp(log_ratio_t, -eps_l, eps_h))
        R_i  = exp(mean_{t in i} c_t),  A_i = mean_{t in i} A_t
        l_t  = -R_i A_i   on every token of i

    With ``aggregation = "seq-mean-token-mean"`` (verl's mean over sequences) the step's loss is
    mean_i -R_i A_i. ``clip_low`` / ``clip_high`` are log-space bounds (the paper: 0.4).
    """
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip.clip_low, clip.clip_high)
    clipped_log = sign * torch.minimum(sign * log_ratio, sign * clamped)
    sequence_ratio = torch.exp(_sequence_mean(clipped_log, valid, document_ids))
    sequence_advantage = _sequence_mean(advantages, valid, document_ids)
    clipped = (log_ratio != clamped) & valid
    return (-sequence_ratio * sequence_advantage, clipped & (advantages < 0),
            clipped & (advantages > 0))


def clip_cov(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
             document_ids: torch.Tensor, clip: ClipSettings, reference: torch.Tensor,
             **_: object) -> LossTerms:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's
    ``clip_cov``): PPO-clip, and among the tokens the clip left alone whose centred covariance

        cov_t = (A_t - mean A) (logp_t - mean logp)      (means over the microbatch's valid tokens)

    lies in (clip_cov_low, clip_cov_high), the ``max(1, cov_fraction * N)`` largest lose their
    gradient (l_t = 0): the tokens that drive entropy down fastest. verl picks them at random
    within the band; the largest are picked here, so a step draws no random numbers.
    """
    loss, clipped_low, clipped_high = ppo_clip(log_ratio, advantages, valid=valid,
                                               document_ids=document_ids, clip=clip)
    ratio = torch.exp(log_ratio.detach())
    clipped_ratio = torch.clamp(ratio, 1 - clip.clip_low, 1 + clip.clip_high)
    clipped_by_ppo = -advantages * clipped_ratio > -advantages * ratio
    covariance = _covariance(advantages, log_ratio.detach() + reference, valid)
    band = valid & ~clipped_by_ppo & (covariance > clip.clip_cov_low) & (
        covariance < clip.clip_cov_high)
    picked = _largest(covariance, band, _num_picked(valid, clip.cov_fraction))
    return torch.where(picked, 0.0, loss), clipped_low | (picked & (advantages < 0)), (
        clipped_high | (picked & (advantages >= 0)))


def kl_cov(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
           document_ids: torch.Tensor, clip: ClipSettings, reference: torch.Tensor,
           **_: object) -> LossTerms:
    """KL-Cov (same paper; verl's ``kl_cov``): the unclipped surrogate, plus a KL penalty on the
    ``max(1, cov_fraction * N)`` valid tokens of largest covariance cov_t (as in clip_cov):

        l_t = -r_t A_t + kl_cov_coef |log_ratio_t| [t picked]

    The picked tokens are reported as clipped (high for A >= 0, low for A < 0).
    """
    ratio = torch.exp(log_ratio)
    covariance = _covariance(advantages, log_ratio.detach() + reference, valid)
    picked = _largest(covariance, valid, _num_picked(valid, clip.cov_fraction))
    loss = -advantages * ratio + torch.where(picked, clip.kl_cov_coef * log_ratio.abs(), 0.0)
    return loss, picked & (advantages < 0), picked & (advantages >= 0)


def gpg(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
        document_ids: torch.Tensor, clip: ClipSettings, **_: object) -> LossTerms:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline"; verl's ``gpg``): no ratio,
    no clip, the plain policy gradient

        l_t = -A_t logp_t

    (GPG's advantage is the group-mean-centred reward: ``rollouter.advantage = "grpo"`` with
    ``advantage_std = "none"``; the paper's batch rescaling alpha = B / M is left out.)
    """
    none = torch.zeros_like(valid)
    return -advantages * log_ratio, none, none


POLICY_LOSSES: dict[str, Callable[..., LossTerms]] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "sapo": sapo,
    "gmpo": gmpo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "gpg": gpg,
}


def _dppo_ratio_and_keep(log_ratio: torch.Tensor, advantages: torch.Tensor,
                         reference: torch.Tensor, clip: ClipSettings,
                         binary_kl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        old_logp = reference.float()
        old_p = torch.exp(old_logp)
        p = torch.exp(old_logp + log_ratio)
        if binary_kl:
            divergence = old_p * (-log_ratio) + (1 - old_p) * torch.log(
                (1.0 - old_p + 1e-8) / (1.0 - p + 1e-8))
            keep_positive = (divergence <= clip.clip_high) | (p <= old_p)
            keep_negative = (divergence <= clip.clip_low) | (p >= old_p)
        else:
            keep_positive = p - old_p <= clip.clip_high
            keep_negative = p - old_p >= -clip.clip_low
        return ratio, torch.where(advantages > 0, keep_positive, keep_negative)


def _dppo_terms(ratio: torch.Tensor, keep: torch.Tensor, log_ratio: torch.Tensor,
                advantages: torch.Tensor, valid: torch.Tensor, clip: ClipSettings) -> LossTerms:
    truncation = clip.clip_ratio_c if clip.clip_ratio_c is not None else DPPO_DEFAULT_TRUNCATION
    weight = torch.clamp(ratio, max=truncation)
    loss = torch.where(keep, -weight * advantages * log_ratio, 0.0)
    dropped = ~keep & valid
    return loss, dropped & (advantages <= 0), dropped & (advantages > 0)


def _covariance(advantages: torch.Tensor, logprobs: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A)(logp_t - mean logp) over the valid tokens; -inf elsewhere."""
    count = valid.float().sum().clamp(min=1)
    mean_advantage = torch.where(valid, advantages, 0.0).sum() / count
    mean_logp = torch.where(valid, logprobs, 0.0).sum() / count
    covariance = (advantages - mean_advantage) * (logprobs - mean_logp)
    return torch.where(valid, covariance, -torch.inf)


def _num_picked(valid: torch.Tensor, fraction: float) -> int:
    return max(int(fraction * int(valid.sum())), 1)


def _largest(values: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The (at most) k candidates of largest value (ties as torch.topk orders them)."""
    picked = torch.zeros_like(candidates)
    k = min(k, int(candidates.sum()))
    if k == 0:
        return picked
    flat = torch.where(candidates, values, -torch.inf).flatten()
    index = torch.topk(flat, k).indices
    return picked.flatten().index_fill(0, index, True).view_as(candidates)


def _sequence_mean(values: torch.Tensor, valid: torch.Tensor,
                   document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's mean of ``values`` over the valid tokens of its sequence (document id);
    0 on tokens whose sequence has none. A sequence never spans two microbatches or ranks."""
    ids = torch.where(valid, document_ids, torch.zeros_like(document_ids)).flatten()
    size = int(ids.max()) + 1 if ids.numel() else 1
    masked = torch.where(valid, values, torch.zeros_like(values)).flatten()
    totals = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, ids, masked)
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(
        0, ids, valid.flatten().to(values.dtype))
    means = totals / counts.clamp(min=1)
    return torch.where(valid, means[ids].view_as(values), torch.zeros_like(values))
