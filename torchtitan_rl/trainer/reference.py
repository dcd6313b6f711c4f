"""The reference policy of a KL term (``trainer.loss.kl_coef > 0``): the model the run started
from, frozen, on the trainer ranks.

    core.forward_backward(batch)
      kl_placement "loss":   reference.logprobs(microbatch) -> PolicyLoss(reference_logprobs=...)
      kl_placement "reward": reference.penalised_rewards(microbatch, policy logprobs) -> the
                             rewards GAE reads (critic.step_targets)

It is rebuilt from the same source on resume (a flavor's from its seed), so checkpoints do not
hold it.
"""

from __future__ import annotations

import torch

from torchtitan_rl.trainer.batcher import valid_tokens
from torchtitan_rl.trainer.critic import Forward, kl_penalised_rewards
from torchtitan_rl.trainer.loss import PolicyLoss, token_logprobs_and_entropy


class ReferencePolicy:
    """A frozen copy of the starting policy and the KL terms read from it."""

    def __init__(self, model: torch.nn.Module, *, forward: Forward,
                 loss: PolicyLoss.Config) -> None:
        self.model = model.eval().requires_grad_(False)
        self.forward = forward
        self.loss = loss

    def logprobs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's logprob of every label of a microbatch (no grad)."""
        with torch.no_grad():
            logits = self.forward(self.model, data)
        logprobs, _ = token_logprobs_and_entropy(logits, data["labels"])
        return logprobs

    def penalised_rewards(self, data: dict[str, torch.Tensor], policy_logprobs: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(r_t - kl_coef * KL_t on every valid token, KL_t) of a microbatch, KL as the loss
        configures it (estimator, k3 cap)."""
        return kl_penalised_rewards(data["rewards"], policy_logprobs, self.logprobs(data),
                                    valid_tokens(data), coef=self.loss.kl_coef,
                                    estimator=self.loss.kl_estimator, k3_cap=self.loss.kl_k3_cap)
