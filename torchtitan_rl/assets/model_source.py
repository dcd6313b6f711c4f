"""Where a run's model comes from: a local HF directory, or one of the project's own sizes made offline."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.task import TaskConfig


class ModelSource(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        path: str = ""
        """A local HF model directory (config.json, safetensors, tokenizer). Empty: use `size`."""
        size: Literal["tiny", "demo", "small"] = "tiny"
        """With an empty `path`: the project's own random model of this size, written to
        `<assets_dir>/<size>` on first use (no hub). tiny: ~0.14M parameters, tied embeddings
        (tests). demo: ~1.1M, untied (the CPU GRPO demo). small: ~32M, torchtitan's Qwen3
        debugmodel shape (benchmarks)."""
        assets_dir: str = "assets/models"
        """Where made models are cached."""
        tokenizer_corpus: Literal["alphabet_sort", "task"] = "alphabet_sort"
        """With an empty `path`: the text the made model's tokenizer is trained on. alphabet_sort:
        the examples' names and prompts. task: the run's task's first solved training
        conversations (a task with a warm start), so its prose is not encoded nearly byte by byte;
        the model is cached per corpus."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def resolve(self, task: TaskConfig | None = None) -> pathlib.Path:
        """The model directory, made first if it is one of ours and absent (``task`` gives the
        tokenizer's corpus with ``tokenizer_corpus = "task"``)."""
        if self.config.path:
            path = pathlib.Path(self.config.path)
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"model.path: {path} is not an HF model directory (no config.json)"
                )
            return path
        from torchtitan_rl.assets.make_model import ensure_model

        corpus = None
        if self.config.tokenizer_corpus == "task":
            corpus = _task_corpus(task)
        return ensure_model(self.config.size, self.config.assets_dir, corpus=corpus)


def _task_corpus(task_config: TaskConfig | None) -> list[str]:
    from torchtitan_rl.assets.tokenizer import task_corpus
    from torchtitan_rl.task import SupervisedTask

    task = task_config.build() if task_config is not None else None
    if not isinstance(task, SupervisedTask):
        raise ConfigError("model.tokenizer_corpus = 'task' needs a task with solved "
                          "conversations (task.solved_conversation): "
                          f"{type(task).__qualname__} has none")
    train = task.dataset("train")
    return task_corpus(lambda i: task.solved_conversation(train[i % len(train)]))
