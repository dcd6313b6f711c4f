"""The constant-answer baseline: what the validation episodes score when every one of them gets
the task's most frequent answer, whatever it asks.

    TrainingLoop.validate (the first one) -> constant_answer_baseline(task, episodes)
        task.solved_conversation(e) for each e -> per turn, the most frequent assistant message
        task.make_env(e): init(), step(that turn's answer) ... -> env.score(replies, parts)
    -> ConstantAnswer(answer, reward): beside every validation line and in summary.json

A policy that learned to answer one thing for every question (its reward rises while its answers
collapse: run_health.py) scores about this; a policy that learned the task scores above it. A
task gives one when it can solve its episodes (a `SupervisedTask`), its environments are
MessageEnvs, and an answer repeats across the episodes (with every answer its episode's own, a
constant answer is a wrong answer almost everywhere, and says nothing).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
from collections.abc import Sequence
from typing import Any

from torchtitan_rl.rollout.message_env import MessageEnv
from torchtitan_rl.task import SupervisedTask

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ConstantAnswer:
    answers: tuple[str, ...]
    """The answer given at each turn (the most frequent solved answer of that turn)."""
    reward: float
    """The mean score over the episodes."""
    share: float
    """The share of the episodes whose own first-turn answer is ``answers[0]``."""

    def describe(self) -> str:
        answer = self.answers[0] if len(self.answers) == 1 else " / ".join(self.answers)
        if len(answer) > 40:
            answer = answer[:37] + "..."
        return f"the constant answer {answer!r} scores {self.reward:.4f}"


async def constant_answer_baseline(task: Any, episodes: Sequence[Any]) -> ConstantAnswer | None:
    """The baseline of ``episodes`` (module docstring); None where the task cannot give one. The
    task's own code raising is logged (DEBUG) and gives None: a baseline never stops a run."""
    if not isinstance(task, SupervisedTask) or len(episodes) < 2:
        return None
    try:
        solved = [[m.get("content") or "" for m in task.solved_conversation(e)
                   if m.get("role") == "assistant"] for e in episodes]
        counts = [collections.Counter(s[t] for s in solved if len(s) > t)
                  for t in range(max(len(s) for s in solved))]
        if not counts or counts[0].most_common(1)[0][1] < 2:
            return None  # no answer repeats: a constant answer is its own episode's alone
        answers = tuple(c.most_common(1)[0][0] for c in counts)
        scores = [await _play(task.make_env(e), answers) for e in episodes]
    except _NotAMessageEnv:
        return None
    except Exception:
        logger.debug("constant-answer baseline: the task raised", exc_info=True)
        return None
    return ConstantAnswer(answers=answers, reward=statistics.fmean(scores),
                          share=counts[0][answers[0]] / len(episodes))


class _NotAMessageEnv(Exception):
    pass


async def _play(env: Any, answers: tuple[str, ...]) -> float:
    """One episode answered with ``answers``, turn by turn, until the env says done."""
    if not isinstance(env, MessageEnv):
        raise _NotAMessageEnv
    try:
        await env.init()
        replies: list[str] = []
        parts: list[dict[str, float]] = []
        for answer in answers:
            step = await env.step({"role": "assistant", "content": answer})
            replies.append(answer)
            parts.append(dict(step.reward_parts))
            if step.done:
                break
        return float(env.score(replies, parts))
    finally:
        await env.close()
