"""Policy losses by name (``trainer.loss.policy_loss``): each maps per-token log ratios and
advantages to a per-token loss; ``PolicyLoss`` (loss.py) aggregates it and adds TIS and KL.

Notation per valid token t of sequence i: ``log_ratio_t = logp_t - ref_t`` (clamped), ``r_t =
exp(log_ratio_t)``, ``A_t`` its advantage, ``eps_l``/``eps_h`` = ``clip_low``/``clip_high``.
Each function returns ``(per_token_loss, clipped_low, clipped_high)``: the loss to aggregate
(gradient through ``logp``) and which tokens the clip took out of the gradient (metrics).

=============  ===============================================================================
``ppo_clip``   PPO's clipped surrogate with DAPO's clip-higher, optionally dual-clip
``gspo``       GSPO: one length-normalised ratio per sequence, clipped per sequence
``cispo``      CISPO: a clipped, stop-gradient importance weight on the logprob
=============  ===============================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch

PolicyLossName = Literal["ppo_clip", "gspo", "cispo"]


class ClipSettings(Protocol):
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None


LossTerms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, *, valid: torch.Tensor,
             document_ids: torch.Tensor, clip: ClipSettings) -> LossTerms:
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
         document_ids: torch.Tensor, clip: ClipSettings) -> LossTerms:
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
          document_ids: torch.Tensor, clip: ClipSettings) -> LossTerms:
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


POLICY_LOSSES: dict[str, Callable[..., LossTerms]] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
}


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
