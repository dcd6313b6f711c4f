"""PPO's learned critic (``[trainer.critic]``, with ``rollouter.advantage = "gae"``): a value model
trained beside the policy on the same ranks, and GAE advantages from its values.

    core.forward_backward(batch)         (PolicyTrainerCore, when the critic is enabled)
      critic.step_targets(microbatches)  no-grad values V of every microbatch -> GAE per sequence
                                         -> advantages (whitened over the step) and returns
      per microbatch: policy loss on those advantages + critic.value_loss(...), backward
      critic.step_metrics(...)           critic/* (reduced over data-parallel ranks)
    core.optim_step() -> critic.clip_gradients(), critic.step(finite)

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
from collections.abc import Callable, Iterable

import torch

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.trainer.batcher import valid_tokens
from torchtitan_rl.trainer.kl import KLEstimator, token_kl

Forward = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""A model's output at every position of a microbatch (its tensors by field name), computed as
the trainer computes (compute dtype, gathered over tensor-parallel ranks)."""

ReduceSums = Callable[[torch.Tensor], torch.Tensor]
"""Float64 sums of this rank -> the sums over the data-parallel ranks (a collective)."""


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


@dataclasses.dataclass(frozen=True, slots=True)
class CriticTargets:
    """One microbatch's GAE results, [rows, seq_len] float32 (0 off valid tokens)."""

    advantages: torch.Tensor
    """GAE advantages, whitened over the step when ``whiten_advantages``."""
    returns: torch.Tensor
    """The value targets R = A + V (before whitening)."""
    old_values: torch.Tensor
    """V before any update of the step (the clipped value loss's V_old)."""


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

    def __init__(self, config: Config, *, model: torch.nn.Module, forward: Forward) -> None:
        self.config = config
        self.model = model
        """The value model: the policy's architecture with a zero-initialised Linear(dim, 1)."""
        self.forward = forward
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, foreach=True)
        self._sums = torch.zeros(4, dtype=torch.float64)
        """The step's (value loss, clipped, value, return) sums over valid tokens."""
        self._reward_kl_sum = 0.0
        """The step's sum of KL_t over valid tokens when the KL enters the rewards."""

    def values(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """V at every position of a microbatch, float32 [rows, seq_len]."""
        return self.forward(self.model, data).squeeze(-1).float()

    def step_targets(
        self, microbatches: Iterable[dict[str, torch.Tensor]], *, reduce_sums: ReduceSums,
        penalised_rewards: Callable[[dict[str, torch.Tensor]],
                                    tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[CriticTargets]:
        """Per microbatch of this rank, before any update: GAE advantages (whitened over the
        step's valid tokens of every rank), returns and the values they came from.
        ``penalised_rewards``: (rewards - kl_coef * KL_t, KL_t) of a microbatch, when the KL
        enters the rewards. Starts the step's value-loss sums."""
        raw = []
        totals = torch.zeros(3, dtype=torch.float64)
        kl_sum = 0.0
        for data in microbatches:
            rewards = data["rewards"]
            with torch.no_grad():
                values = self.values(data)
                if penalised_rewards is not None:
                    rewards, kl = penalised_rewards(data)
                    kl_sum += float(kl.sum())
            advantages, returns = gae(rewards, values, data["loss_mask"], data["document_ids"],
                                      gamma=self.config.gamma, lam=self.config.lam)
            valid = valid_tokens(data)
            picked = advantages[valid].double().cpu()
            totals += torch.stack([torch.tensor(float(picked.numel()), dtype=torch.float64),
                                   picked.sum(), picked.square().sum()])
            raw.append((advantages, returns, values, valid))
        totals = reduce_sums(torch.cat([totals, torch.tensor([kl_sum], dtype=torch.float64)]))
        self._reward_kl_sum = float(totals[3])
        self._sums = torch.zeros(4, dtype=torch.float64)
        return [CriticTargets(advantages=self.whiten(a, valid, tuple(totals[:3].tolist())),
                              returns=r, old_values=v)
                for a, r, v, valid in raw]

    def value_loss(self, data: dict[str, torch.Tensor], targets: CriticTargets,
                   num_valid_tokens: int) -> torch.Tensor:
        """This microbatch's share of the step's value loss (a mean over the step's valid
        tokens), with grad; adds its sums into the step's."""
        valid = valid_tokens(data)
        values = self.values(data)
        loss_sum, clipped = clipped_value_loss(values, targets.old_values, targets.returns, valid,
                                               self.config.value_clip)
        self._sums += torch.stack([loss_sum.detach().double().cpu(), clipped.double().cpu(),
                                   values.detach()[valid].double().sum().cpu(),
                                   targets.returns[valid].double().sum().cpu()])
        return loss_sum / max(int(num_valid_tokens), 1)

    def step_metrics(self, num_valid_tokens: int, *, reduce_sums: ReduceSums,
                     reward_kl: bool) -> dict[str, float]:
        """critic/* of the step (a collective); with ``reward_kl``, loss/kl_mean of the KL that
        entered the rewards."""
        value_loss, clipped, value, target = reduce_sums(self._sums).tolist()
        n = max(num_valid_tokens, 1)
        metrics = {"critic/value_loss": value_loss / n, "critic/clipped_frac": clipped / n,
                   "critic/value_mean": value / n, "critic/return_mean": target / n}
        if reward_kl:
            metrics["loss/kl_mean"] = self._reward_kl_sum / n
        return metrics

    def clip_gradients(self) -> torch.Tensor:
        """Clip the value model's gradient norm (a collective); returns the norm before."""
        from torchtitan.distributed import utils as dist_utils

        return dist_utils.clip_grad_norm_(list(self.model.parameters()),
                                          self.config.max_grad_norm, foreach=True)

    def step(self, finite: bool) -> None:
        """AdamW step when every gradient of the step is finite; zero the gradients."""
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

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
