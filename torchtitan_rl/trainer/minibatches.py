"""Several optimizer updates per step (``trainer.num_minibatches`` k, ``trainer.ppo_epochs`` e):
the step's groups split into k mini-batches, e passes over them, k * e AdamW updates, one policy
version (one push) per step.

    core.forward_backward_samples(samples)   every rank, the same split and packing:
      split_groups(samples, k)                 k mini-batches of whole groups, in order
      old logprobs of every mini-batch         the weights before the step's first update
      critic targets of every mini-batch       GAE from the values before the first update
      for epoch in e: for mini-batch in k:     forward/backward (loss normalised by the
                                               mini-batch's own tokens and sequences), then
                                               AdamW, except the last update's, which
    core.optim_step()                          takes and bumps policy_version

Three policies (the decoupled form of verl's rollout correction, Hilton et al. 2022's decoupled
PPO): the rollout policy (the generator's logprobs), the old policy (the trainer's weights at the
step's start, its logprobs recomputed before the first update) and the current one. The PPO ratio
is pi_current / pi_old and the off-policy correction weighs pi_old / pi_rollout, whenever the
ratio is the trainer's own (``loss.ratio_reference = "trainer"`` or the correction on). With
``ratio_reference = "generator"`` and the correction off the ratio is pi_current / pi_rollout at
every update (verl's "bypass" mode, GRPO as published): no recompute is needed.

k = e = 1 is today's single update: nothing is split or recomputed, the same bits. Every update
of a step uses the step's learning rate; a non-finite gradient norm skips that update's AdamW
step alone (``trainer/num_skipped_updates``), and the step counts as skipped
(``trainer/skipped_step`` 1: no push) only when every update was.

Metrics of a step with several updates: each ``loss/*``, ``mismatch/*`` and ``critic/*`` value is
the mean over the updates (``*_max`` the maximum), counts (``loss/num_*``, ``batcher/num_*``) sum
over the mini-batches of one epoch, ``trainer/num_updates`` is k * e and ``loss/ratio_mean_last``
is the last update's mean ratio (1 at the first update up to the recompute's rounding; not 1
once the weights moved).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan_rl.types import TrainingSample


def split_groups(samples: Sequence[TrainingSample], num_minibatches: int
                 ) -> list[list[TrainingSample]]:
    """``samples`` in ``num_minibatches`` runs of whole groups (by ``group_id``, in first-seen
    order), sizes as equal as the group count allows (the first ones one group larger); fewer
    mini-batches when the step has fewer groups. Example: groups a, b, c, d, e and k = 2 ->
    [a b c] [d e]."""
    groups: dict[int, list[TrainingSample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    ordered = list(groups.values())
    k = max(1, min(num_minibatches, len(ordered)))
    size, extra = divmod(len(ordered), k)
    parts, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        parts.append([s for group in ordered[start:end] for s in group])
        start = end
    return parts


def combine_update_metrics(updates: list[dict[str, float]], *, num_minibatches: int
                           ) -> dict[str, float]:
    """One step's metrics from its updates' (see the module docstring)."""
    combined: dict[str, float] = {}
    first_epoch = updates[:num_minibatches]
    for key in updates[0]:
        values = [u[key] for u in updates if key in u]
        if key.startswith(("loss/num_", "batcher/num_")):
            combined[key] = sum(u[key] for u in first_epoch if key in u)
        elif key.endswith("_max"):
            combined[key] = max(values)
        elif key.endswith("_s"):
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    combined["trainer/num_updates"] = float(len(updates))
    combined["loss/ratio_mean_last"] = updates[-1]["loss/ratio_mean"]
    return combined
