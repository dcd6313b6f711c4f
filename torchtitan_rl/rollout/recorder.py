"""RolloutRecorder: every K steps, append the step's rollouts as JSON lines for a human to read;
every validation's rollouts go to ``validation.jsonl`` beside them, written the same way.

One line per rollout: step, ids, status, reward, advantage, the first prompt's text, the last
completion's text, and per turn what was added to the prompt, the completion (whole, and token by
token with the generator's logprob of each sampled token, rounded to 4 decimals), its reward parts,
and (per-turn credit) its reward and advantage. ``write_viewer`` turns the file into the run's
rollout viewer page (metrics/rollout_viewer.py).
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.metrics.rollout_viewer import write_viewer
from torchtitan_rl.rollout.types import Rollout, RolloutGroup

logger = logging.getLogger(__name__)


class RolloutRecorder(Configurable):
    """Built with ``cfg.build(run_dir=path)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every_k_steps: int = 10
        """Record the rollouts of steps 0, K, 2K, ...; 0 disables recording."""
        path: str = "rollouts/rollouts.jsonl"
        """JSONL file, relative to the run directory (parents are created)."""
        max_groups_per_step: int | None = None
        """Most groups recorded per step (the first ones); None records all."""
        max_validation_groups: int | None = None
        """Most episodes of a validation recorded (the first ones, every sample of each); None
        records all. A recorded rollout takes about 9 KB of validation.jsonl and of the viewer
        page, so a validation of thousands of episodes is better sampled."""
        viewer_max_steps: int | None = 50
        """The viewer page holds the rollouts of the last this many recorded steps, and of the
        last this many validations (the JSONL files keep all of them); None: every one. Bounds
        what each rewrite reads and holds, which otherwise grows with the run's length."""
        viewer: bool = True
        """Write the rollout viewer, rollout_viewer.html in the run folder: one HTML page of the
        recorded rollouts to open in a browser (docs/reading_a_run.md), rewritten after each
        recorded step and at the run's end. False: not written (`python -m
        torchtitan_rl.metrics.rollout_viewer RUN_DIR` writes it from the run folder any time)."""

        def __post_init__(self) -> None:
            if self.every_k_steps < 0:
                raise ValueError(f"every_k_steps must be >= 0, got {self.every_k_steps}")
            if pathlib.PurePath(self.path).is_absolute():
                raise ValueError(f"path must be relative to the run directory, got {self.path}")
            for name in ("max_groups_per_step", "max_validation_groups", "viewer_max_steps"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"{name} must be >= 1 or None, got {value}")

    def __init__(self, config: Config, *, run_dir: str | pathlib.Path) -> None:
        self.config = config
        self.run_dir = pathlib.Path(run_dir)
        self.path = self.run_dir / config.path

    @property
    def validation_path(self) -> pathlib.Path:
        """Where every validation's rollouts go (`validation_rollouts_path`)."""
        return validation_rollouts_path(self.path)

    def record_validation(self, step: int, groups: list[RolloutGroup], tokenizer: Any) -> bool:
        """Append a validation's rollouts (those of its first `max_validation_groups` episodes,
        written as training rollouts are) to `validation_path`, unless recording is off
        (every_k_steps = 0); True if written."""
        if self.config.every_k_steps == 0:
            return False
        limit = self.config.max_validation_groups
        self.validation_path.parent.mkdir(parents=True, exist_ok=True)
        with self.validation_path.open("a", encoding="utf-8") as f:
            for group in groups if limit is None else groups[:limit]:
                for rollout in group.rollouts:
                    f.write(json.dumps(_record(step, group, rollout, tokenizer)) + "\n")
        logger.info("recorded the validation of step %d to %s", step, self.validation_path)
        return True

    def maybe_record(self, step: int, groups: list[RolloutGroup], tokenizer: Any) -> bool:
        """Append this step's rollouts when ``step`` is a multiple of every_k_steps; True if written."""
        k = self.config.every_k_steps
        if k == 0 or step % k != 0:
            return False
        chosen = groups if self.config.max_groups_per_step is None else groups[
            : self.config.max_groups_per_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for group in chosen:
                for rollout in group.rollouts:
                    f.write(json.dumps(_record(step, group, rollout, tokenizer)) + "\n")
        logger.info("recorded %d groups of step %d to %s", len(chosen), step, self.path)
        self.write_viewer()  # the page follows the run: rewritten whole, at the recording's pace
        return True

    def write_viewer(self) -> pathlib.Path | None:
        """(Re)write the rollout viewer page from the recorded rollouts; its path, or None when
        ``viewer`` is off or nothing is recorded (every_k_steps = 0)."""
        if not self.config.viewer or self.config.every_k_steps == 0:
            return None
        return write_viewer(self.run_dir, rollouts_path=self.config.path,
                            max_steps=self.config.viewer_max_steps)


def validation_rollouts_path(rollouts_path: pathlib.Path) -> pathlib.Path:
    """The validation rollouts' file: ``validation.jsonl`` beside the training rollouts' file."""
    return rollouts_path.with_name("validation.jsonl")


def _record(step: int, group: RolloutGroup, rollout: Rollout, tokenizer: Any) -> dict[str, Any]:
    turns = []
    previous: list[int] = []
    for turn in rollout.turns:
        prompt = turn.prompt_token_ids
        added = prompt[len(previous):] if prompt[: len(previous)] == previous else prompt
        turns.append({
            "prompt_added_text": tokenizer.decode(added, skip_special_tokens=False),
            "completion_text": tokenizer.decode(turn.completion_token_ids,
                                                skip_special_tokens=False),
            "completion_tokens": tokenizer.batch_decode(
                [[token] for token in turn.completion_token_ids], skip_special_tokens=False),
            "completion_logprobs": [round(x, 4) if math.isfinite(x) else None
                                    for x in turn.completion_logprobs],
            "finish_reason": turn.finish_reason,
            "num_prompt_tokens": len(prompt),
            "num_completion_tokens": len(turn.completion_token_ids),
            "reward_parts": turn.reward_parts,
            "reward": turn.reward,
            "advantage": turn.advantage,
            "drift": turn.drift,
        })
        previous = prompt + turn.completion_token_ids
    first = rollout.turns[0] if rollout.turns else None
    last = rollout.turns[-1] if rollout.turns else None
    return {
        "step": step,
        "sample_id": rollout.session_id,
        "group_id": group.group_id,
        "episode_id": _episode_id(group.episode),
        "status": rollout.status.value,
        "error": rollout.error,
        "reward": rollout.reward,
        "advantage": rollout.advantage,
        "group_dropped": group.drop_reason,
        "num_turns": len(rollout.turns),
        "prompt_text": tokenizer.decode(first.prompt_token_ids, skip_special_tokens=False)
        if first else "",
        "completion_text": last.completion_text if last else "",
        "turns": turns,
    }


def _episode_id(episode: Any) -> str | None:
    value = episode.get("episode_id") if isinstance(episode, dict) else getattr(
        episode, "episode_id", None)
    return None if value is None else str(value)
