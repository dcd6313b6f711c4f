"""Signs that a run looks fine but is not: steps that trained nothing, answers that collapsed.

    TrainingLoop._train_step -> RunHealth.end_step(step, groups, trained, reward)
                                -> run/* and rollout/answers_* metrics; one console warning the
                                   first time the answers collapse (then never again)
    TrainingLoop.run's end    -> RunHealth.warn_if_hollow(): one console warning when most of the
                                 run's steps trained nothing, saying why

A step trains nothing when it has no training sample (every group was dropped: its rollouts all
scored alike, or all failed) or when the trainer skipped its update (a non-finite loss). Each
such step is one INFO line in the log file; the console gets the run's one line at its end.

Collapse: the rollouts of different questions give the same answer (a rollout's answer is its
last reply, stripped). When one answer is `COLLAPSE_SHARE` or more of a step's rollouts, over
at least two groups, for `COLLAPSE_STEPS` steps in a row, the policy answers that one thing
whatever it is asked; its reward is then the score of a constant answer, not of solving the
task (validation's constant-answer baseline says what that scores).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from typing import Any

from torchtitan_rl.rollout.types import RolloutGroup

logger = logging.getLogger(__name__)

COLLAPSE_SHARE = 0.9
"""Share of a step's rollouts giving its most frequent answer at which the step counts as
collapsed."""
COLLAPSE_STEPS = 3
"""Collapsed steps in a row that make the warning."""
HOLLOW_RUN_SHARE = 0.5
"""A run in which more than this share of the steps trained nothing ends with a warning."""
NO_SIGNAL_DOC = "docs/environments.md#which-datasets-give-the-demo-model-a-signal"
_ZERO_SPREAD = "zero reward spread in every group"
_ANSWER_CHARS = 40
"""An answer is quoted in a warning up to this many characters."""


def answer_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """``rollout/answers_distinct_per_group``: the mean over groups of how many different
    answers (the tuple of a rollout's replies) its rollouts gave; ``rollout/answers_top_share``:
    the share of the rollouts whose answer (last reply) is the step's most frequent one;
    ``rollout/entropy_estimate``: the mean of -logprob over every sampled token (the policy's
    per-token entropy, estimated from the generator's own logprobs, at the sampling
    temperature)."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return {}
    answers = collections.Counter(_answer(r.replies) for r in rollouts)
    metrics = {
        "rollout/answers_distinct_per_group": statistics.fmean(
            len({tuple(s.strip() for s in r.replies) for r in g.rollouts})
            for g in groups if g.rollouts),
        "rollout/answers_top_share": answers.most_common(1)[0][1] / len(rollouts),
    }
    logprobs = [x for r in rollouts for t in r.turns for x in t.completion_logprobs
                if math.isfinite(x)]
    if logprobs:
        metrics["rollout/entropy_estimate"] = -statistics.fmean(logprobs)
    return metrics


def top_answer(groups: list[RolloutGroup]) -> tuple[str, float]:
    """The most frequent answer of ``groups``' rollouts and its share of them."""
    answers = collections.Counter(_answer(r.replies) for g in groups for r in g.rollouts)
    answer, count = answers.most_common(1)[0]
    return answer, count / sum(answers.values())


def _answer(replies: list[str]) -> str:
    return replies[-1].strip() if replies else ""


@dataclasses.dataclass(kw_only=True, slots=True)
class Collapse:
    """The first collapse of a run: the step it was called at, the answer and its share."""

    step: int
    answer: str
    share: float

    def to_data(self) -> dict[str, Any]:
        return {"step": self.step, "answer": self.answer, "share": round(self.share, 4)}


class RunHealth:
    """Counts the steps that trained nothing (and why) and watches for collapsed answers.

    ``untrained_steps`` is the run's list (ControllerState's, so a resumed run keeps counting).
    """

    def __init__(self, untrained_steps: list[int]) -> None:
        self.untrained_steps = untrained_steps
        self.num_steps_this_run = 0
        self.untrained_this_run: collections.Counter[str] = collections.Counter()
        """Why the steps of this process's run trained nothing: reason -> steps."""
        self.zero_spread_reward_means: list[float] = []
        """The mean reward of each step that trained nothing for zero spread."""
        self._collapsed_in_row = 0
        self.collapse: Collapse | None = None

    def end_step(self, step: int, groups: list[RolloutGroup], *, num_samples: int,
                 skipped: bool) -> dict[str, float]:
        """Count ``step`` (``num_samples`` trained on; ``skipped``: the trainer kept the
        weights) and return its metrics."""
        self.num_steps_this_run += 1
        reason = self._untrained_reason(groups, num_samples=num_samples, skipped=skipped)
        if reason is not None:
            self.untrained_steps.append(step)
            self.untrained_this_run[reason] += 1
            rewards = [r.reward for g in groups for r in g.rollouts]
            if reason == _ZERO_SPREAD and rewards:
                self.zero_spread_reward_means.append(statistics.fmean(rewards))
            logger.info("step %d trained nothing: %s; the weights are unchanged", step, reason)
        metrics = {
            "run/step_trained": float(reason is None),
            "run/steps_trained": float(step + 1 - len(self.untrained_steps)),
            **answer_metrics(groups),
        }
        self._watch_collapse(step, groups, metrics)
        return metrics

    @staticmethod
    def _untrained_reason(groups: list[RolloutGroup], *, num_samples: int,
                          skipped: bool) -> str | None:
        if skipped:
            return "a non-finite loss (update skipped)"
        if num_samples:
            return None
        reasons = collections.Counter(g.drop_reason for g in groups)
        if reasons and set(reasons) <= {"zero_std"}:
            return _ZERO_SPREAD
        if reasons and set(reasons) <= {"all_errored"}:
            return "every rollout failed"
        return "no training sample (" + ", ".join(
            f"{n} groups {reason or 'empty'}" for reason, n in sorted(
                reasons.items(), key=lambda item: str(item[0]))) + ")"

    def _watch_collapse(self, step: int, groups: list[RolloutGroup],
                        metrics: dict[str, float]) -> None:
        if len(groups) < 2 or "rollout/answers_top_share" not in metrics:
            self._collapsed_in_row = 0
            return
        collapsed = metrics["rollout/answers_top_share"] >= COLLAPSE_SHARE
        self._collapsed_in_row = self._collapsed_in_row + 1 if collapsed else 0
        if self._collapsed_in_row < COLLAPSE_STEPS or self.collapse is not None:
            return
        answer, share = top_answer(groups)
        self.collapse = Collapse(step=step, answer=answer, share=share)
        quoted = answer if len(answer) <= _ANSWER_CHARS else answer[:_ANSWER_CHARS - 3] + "..."
        reward = statistics.fmean(r.reward for g in groups for r in g.rollouts)
        logger.warning(
            "step %d: the answers collapsed: %.0f%% of the rollouts answered %r (%.1f distinct "
            "answers per group) whatever the question, %d steps in a row; the reward (%.3f) is "
            "what that answer scores (see validation's constant-answer baseline)",
            step, 100 * share, quoted, metrics["rollout/answers_distinct_per_group"],
            COLLAPSE_STEPS, reward)

    def warn_if_hollow(self) -> None:
        """One warning when more than `HOLLOW_RUN_SHARE` of this run's steps trained nothing."""
        untrained = sum(self.untrained_this_run.values())
        if not self.num_steps_this_run or untrained <= HOLLOW_RUN_SHARE * self.num_steps_this_run:
            return
        why = "; ".join(f"{n}: {reason}" for reason, n in self.untrained_this_run.most_common())
        line = f"{untrained} of {self.num_steps_this_run} steps trained nothing ({why})"
        if self.untrained_this_run.most_common(1)[0][0] == _ZERO_SPREAD:
            mean = statistics.fmean(self.zero_spread_reward_means)
            line += (f": every rollout of a question got the same reward (mean {mean:.3f}): the "
                     f"task gives this model no learning signal; see {NO_SIGNAL_DOC}")
        logger.warning("%s", line)
