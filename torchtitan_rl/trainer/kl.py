"""KL to a frozen reference policy, per token (``trainer.loss.kl_estimator``), as Schulman's
"Approximating KL Divergence" (2020) writes the estimators of KL(pi_theta || pi_ref) from samples of
pi_theta. With ``log_rho_t = ref_t - logp_t`` (log pi_ref / pi_theta of the sampled token):

    k1 = -log_rho                      unbiased, can be negative, high variance
    k2 = log_rho^2 / 2                 biased, >= 0, low variance
    k3 = exp(log_rho) - 1 - log_rho    unbiased, >= 0, low variance (verl's "low_var_kl")

The gradient flows through ``logp_t``. ``log_rho`` is clamped to [-20, 20] before exp (a token the
reference finds impossible must not overflow k3), and k3's value is clamped to <= ``k3_cap``
(``trainer.loss.kl_k3_cap``, default 10), as verl clamps its low-variance KL. Above the cap the
token's KL gradient is 0; below it k3 <= cap keeps log_rho in about [-(cap + 1), 2.61] (at cap 10),
so the gradient |d k3 / d logp| = |1 - exp(log_rho)| stays below 12.7 there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]

LOG_RHO_CLAMP = 20.0

K3_CAP = 10.0
"""verl's clamp of its low_var_kl (k3) value."""


def k1(log_rho: torch.Tensor) -> torch.Tensor:
    return -log_rho


def k2(log_rho: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_rho.square()


def k3(log_rho: torch.Tensor) -> torch.Tensor:
    # expm1 keeps the small differences exact; the clamp takes the last rounding below 0 away.
    return (torch.expm1(log_rho) - log_rho).clamp(min=0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def token_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor,
             estimator: KLEstimator, k3_cap: float | None = None) -> torch.Tensor:
    """Per-token KL estimate of the current policy from the reference (gradient through
    ``logprobs``); k3 clamped to <= ``k3_cap`` when given."""
    log_rho = torch.clamp(reference_logprobs.float() - logprobs.float(), -LOG_RHO_CLAMP,
                          LOG_RHO_CLAMP)
    kl = KL_ESTIMATORS[estimator](log_rho)
    if estimator == "k3" and k3_cap is not None:
        kl = kl.clamp(max=k3_cap)
    return kl
