"""PPO's learned critic (``[trainer.critic]``, with ``rollouter.advantage = "gae"``): a value model
trained beside the policy on the same ranks, and GAE advantages from its values.

    core.forward_backward(batch)         (PolicyTrainerCore, when the critic is enabled)
      critic.advantages(batch)           no-grad values V of every microbatch -> GAE per sequence
                                         -> advantages (whitened over the step) and returns
      per microbatch: policy loss on those advantages; critic.value_loss(...) backward
    core.optim_step() -> critic.optim_step()

The value model is the policy's architecture loaded from the same source, with the output head
replaced by a zero-initialised Linear(dim, 1) (so V = 0 before it learns); its own AdamW. The
value of position p is V(state before token p + 1), the position whose logits sample token p + 1.

GAE (Schulman et al. 2016) over a sequence's generated tokens t_1 .. t_n only, in order:

    delta_k = r_k + gamma * V_{k+1} - V_k          (V_{n+1} = 0: the episode ends)
    A_k     = delta_k + gamma * lam * A_{k+1}       R_k = A_k + V_k (the value target)

``r_k`` is the reward credited to token k: a turn's reward (``credit = "turn"``) on that turn's
last generated token, or the episode's reward on its last generated token (packing.py). Prompt
and environment tokens between two turns are not steps: they have no value target, and the
transition from the last token of turn j goes straight to the first generated token of turn j + 1,
whose state already holds the environment's reply (``V_{k+1}`` is read there).

Value loss, PPO's clipped form (as verl's ``compute_value_loss``), a mean over the step's valid
tokens: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``. With one optimizer step
per batch V_old is V at the step's start, so the clip binds only once ``V`` has moved (it is kept
for the form's sake and for multi-update settings).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.trainer.kl import KLEstimator, token_kl


def gae(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
        document_ids: torch.Tensor, *, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of every valid position of a [rows, seq_len] microbatch (0
    elsewhere); a sequence (document id) is whole in one row."""
    advantages = torch.zeros_like(values, dtype=torch.float32)
    returns = torch.zeros_like(values, dtype=torch.float32)
    r, v = rewards.float().tolist(), values.float().tolist()
    ok, docs = valid.tolist(), document_ids.tolist()
    for row in range(values.shape[0]):
        next_value: dict[int, float] = {}
        next_advantage: dict[int, float] = {}
        for p in range(values.shape[1] - 1, -1, -1):
            if not ok[row][p]:
                continue
            doc = docs[row][p]
            delta = r[row][p] + gamma * next_value.get(doc, 0.0) - v[row][p]
            advantage = delta + gamma * lam * next_advantage.get(doc, 0.0)
            advantages[row, p] = advantage
            returns[row, p] = advantage + v[row][p]
            next_value[doc], next_advantage[doc] = v[row][p], advantage
    return advantages, returns


def kl_penalised_rewards(rewards: torch.Tensor, logprobs: torch.Tensor,
                         reference_logprobs: torch.Tensor, valid: torch.Tensor, *, coef: float,
                         estimator: KLEstimator, k3_cap: float | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_t - coef * KL_t on every generated token, KL_t) for ``loss.kl_placement = "reward"``:
    the policy is penalised, token by token, for leaving the reference (verl's
    use_kl_in_reward); k3 capped at ``k3_cap`` as in the loss."""
    kl = torch.where(valid, token_kl(logprobs, reference_logprobs, estimator, k3_cap=k3_cap),
                     torch.zeros_like(rewards))
    return rewards - coef * kl, kl


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       valid: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over valid tokens of the clipped value loss, number of tokens where the clip bound)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    plain_loss = (values - returns).square()
    clipped_loss = (clipped - returns).square()
    loss = 0.5 * torch.maximum(plain_loss, clipped_loss)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    bound = (clipped_loss > plain_loss) & valid
    return loss.sum(), bound.float().sum()


class ValueCritic(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = False
        """Train a value model beside the policy and give the policy GAE advantages (PPO).
        Needs ``rollouter.advantage = "gae"``; the value model is checkpointed with the policy."""
        lr: float = 1e-4
        """The value model's AdamW learning rate (constant). > 0."""
        gamma: float = 1.0
        """Discount per generated token, in [0, 1]."""
        lam: float = 1.0
        """GAE's lambda, in [0, 1]: 1 = Monte-Carlo returns minus V, 0 = one-step TD."""
        value_clip: float = 0.5
        """c of the clipped value loss. > 0."""
        max_grad_norm: float = 1.0
        """The value model's gradient-norm clip. > 0."""
        whiten_advantages: bool = True
        """Whiten the GAE advantages over the step's valid tokens (verl's GAE does)."""

        def __post_init__(self) -> None:
            if not self.lr > 0:
                raise ValueError(f"critic.lr must be > 0, got {self.lr}")
            for name in ("gamma", "lam"):
                if not 0 <= getattr(self, name) <= 1:
                    raise ValueError(f"critic.{name} must be in [0, 1], got "
                                     f"{getattr(self, name)}")
            if not self.value_clip > 0:
                raise ValueError(f"critic.value_clip must be > 0, got {self.value_clip}")
            if not self.max_grad_norm > 0:
                raise ValueError(f"critic.max_grad_norm must be > 0, got {self.max_grad_norm}")

    def __init__(self, config: Config, *, model: torch.nn.Module) -> None:
        self.config = config
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, foreach=True)

    def whiten(self, advantages: torch.Tensor, valid: torch.Tensor,
               totals: tuple[float, float, float]) -> torch.Tensor:
        """(A - mean) / sqrt(var + 1e-8) from the step's (count, sum, sum of squares)."""
        count, total, squares = totals
        if not self.config.whiten_advantages or count < 2:
            return advantages
        mean = total / count
        var = max(squares / count - mean * mean, 0.0) * count / (count - 1)
        scaled = (advantages - mean) / math.sqrt(var + 1e-8)
        return torch.where(valid, scaled, torch.zeros_like(scaled))
